"""Conversions between events and table rows, and a JSON encoding that keeps NaN and infinities.

PostgreSQL's JSON types reject NaN and Infinity, and SQLite cannot hold a NaN REAL. JSON columns therefore
store a non-finite float ``x`` as ``{"$float": "nan" | "inf" | "-inf"}`` and :func:`decode` turns it back; a
NaN in a REAL column is stored as NULL (:func:`to_real` / :func:`from_real`).

>>> decode(encode({"v": float("nan"), "w": [1.0, float("-inf")]}))
{'v': nan, 'w': [1.0, -inf]}
>>> event_from_row("anomalies", event_row(Anomaly("spike", "loss", 3, 9.0, Severity.ERROR, "z", ((3, 9.0),),
...     id="a1"), run_id="r", seq=1)).evidence
((3, 9.0),)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum
from typing import Any

from stabmon.events import (
    Anomaly,
    Decision,
    DecisionStatus,
    InterventionRecord,
    Outcome,
    Severity,
    Verdict,
)

_MARK = "$float"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(value: Any) -> Any:
    """A JSON-safe copy of ``value``: enums as values, tuples as lists, non-finite floats as markers."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_MARK: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, Enum):
        return encode(value.value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return str(value)


def decode(value: Any) -> Any:
    """Inverse of :func:`encode` (tuples come back as lists)."""
    if isinstance(value, dict):
        if len(value) == 1 and _MARK in value:
            return _NONFINITE[value[_MARK]]
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def to_real(v: float | None) -> float | None:
    return None if v is None or v != v else float(v)


def from_real(v: float | None) -> float:
    return math.nan if v is None else v


EVENT_TABLES: dict[type, str] = {
    Anomaly: "anomalies",
    Decision: "decisions",
    InterventionRecord: "interventions",
    Outcome: "outcomes",
}


def event_row(event: Any, *, run_id: str, seq: int) -> dict[str, Any]:
    """The row of an Anomaly / Decision / InterventionRecord / Outcome (JSON columns already encoded)."""
    base = {"id": event.id, "run_id": run_id, "seq": seq, "step": int(event.step)}
    if isinstance(event, Anomaly):
        return base | {
            "kind": event.kind,
            "metric": event.metric,
            "score": to_real(event.score),
            "severity": Severity(event.severity).value,
            "detector": event.detector,
            "threshold": to_real(event.threshold),
            "message": event.message,
            "evidence": encode({"window": [list(p) for p in event.evidence]}),
        }
    if isinstance(event, Decision):
        return base | {
            "action": event.action,
            "params": encode(dict(event.params)),
            "status": DecisionStatus(event.status).value,
            "runbook": event.runbook,
            "rule": event.rule,
            "rung": int(event.rung),
            "reason": event.reason,
            "anomaly_id": event.anomaly_id,
            "incident_id": event.incident_id,
        }
    if isinstance(event, InterventionRecord):
        return base | {
            "decision_id": event.decision_id,
            "action": event.action,
            "before": encode(dict(event.before)),
            "after": encode(dict(event.stored_after())),
            "reverted": bool(event.reverted),
            "simulated": bool(event.simulated),
        }
    if isinstance(event, Outcome):
        return base | {
            "intervention_id": event.intervention_id,
            "decision_id": event.decision_id,
            "verdict": Verdict(event.verdict).value,
            "evidence": encode(dict(event.evidence)),
            "incident_id": event.incident_id,
        }
    raise TypeError(f"not a storable event: {type(event).__name__}")


def event_from_row(table: str, row: Mapping[str, Any]) -> Anomaly | Decision | InterventionRecord | Outcome:
    """Rebuild the event dataclass from a row of ``table`` (inverse of :func:`event_row`)."""
    if table == "anomalies":
        window = decode(row["evidence"] or {}).get("window", [])
        return Anomaly(
            kind=row["kind"],
            metric=row["metric"],
            step=int(row["step"]),
            score=from_real(row["score"]),
            severity=Severity(row["severity"]),
            detector=row["detector"],
            evidence=tuple((int(s), float(v)) for s, v in window),
            threshold=row["threshold"],
            message=row["message"],
            id=row["id"],
        )
    if table == "decisions":
        return Decision(
            step=int(row["step"]),
            action=row["action"],
            params=decode(row["params"] or {}),
            status=DecisionStatus(row["status"]),
            runbook=row["runbook"],
            rule=row["rule"],
            rung=int(row["rung"]),
            reason=row["reason"],
            anomaly_id=row["anomaly_id"],
            incident_id=row["incident_id"],
            id=row["id"],
        )
    if table == "interventions":
        return InterventionRecord.from_stored(
            decision_id=row["decision_id"],
            step=int(row["step"]),
            action=row["action"],
            before=decode(row["before"] or {}),
            after=decode(row["after"] or {}),
            reverted=bool(row["reverted"]),
            simulated=bool(row["simulated"]),
            id=row["id"],
        )
    if table == "outcomes":
        return Outcome(
            intervention_id=row["intervention_id"],
            decision_id=row["decision_id"],
            step=int(row["step"]),
            verdict=Verdict(row["verdict"]),
            evidence=decode(row["evidence"] or {}),
            incident_id=row["incident_id"],
            id=row["id"],
        )
    raise ValueError(f"not an event table: {table}")
