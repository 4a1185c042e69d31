"""The causal chain of each incident, built from a run's recorded events (pure: events in, plain dicts out).

For every incident: the evidence window the detector judged (and, when the steps' data positions are given,
the batches that made those steps) -> the anomaly -> each decision (runbook, rule, rung, reason, every status
it went through) -> the intervention it caused (values before / after; for ``diagnose`` its verdict, the
re-run and replay that decided it and the batches involved, with their sample ids when recorded) -> the
outcome that judged it (verdict and the metrics that decided). ``stabmon trace RUN`` prints this.

>>> from stabmon.events import Anomaly, Decision, DecisionStatus, Severity
>>> a = Anomaly(kind="spike", metric="loss", step=5, score=8.0, severity=Severity.ERROR, detector="z",
...             evidence=((4, 2.0), (5, 9.0)), id="a1")
>>> d = Decision(step=5, action="set_clip", params={"max_norm": 1.0}, status=DecisionStatus.APPLY,
...              runbook="rb", rule="spikes", rung=0, reason="r", anomaly_id="a1", incident_id="i1", id="d1")
>>> (inc,) = build_trace([a, d])["incidents"]
>>> inc["anomaly"]["evidence"], inc["steps"][0]["decision"]["action"]
([[4, 2.0], [5, 9.0]], 'set_clip')
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from stabmon.events import Anomaly, Decision, InterventionRecord, Outcome, to_dict
from stabmon.interventions.traits import recorded_traits as _traits
from stabmon.runbook.hangs import hang_summary


def build_trace(events: Iterable[Any], positions: Sequence[tuple[int, int | None]] = ()) -> dict[str, Any]:
    """``{"incidents": [...], "unhandled_anomalies": n}`` from a run's events in causal order; ``positions``:
    the (step, batch_index) of every recorded step in record order (adds each incident's ``batches``)."""
    events = list(events)
    anomalies = {e.id: e for e in events if isinstance(e, Anomaly)}
    records: dict[str, list[InterventionRecord]] = {}
    for e in events:
        if isinstance(e, InterventionRecord):
            records.setdefault(e.decision_id, []).append(e)
    outcomes = {e.decision_id: e for e in events if isinstance(e, Outcome)}
    incidents: dict[str, dict[str, Any]] = {}
    steps: dict[str, dict[str, Any]] = {}
    for e in events:
        if not isinstance(e, Decision):
            continue
        key = e.incident_id or e.id
        inc = incidents.get(key)
        if inc is None:
            anomaly = anomalies.get(e.anomaly_id or "")
            inc = incidents[key] = {
                "incident": key, "runbook": e.runbook, "rule": e.rule,
                "anomaly": _anomaly(anomaly) if anomaly else None, "steps": [],
                "batches": _batches(anomaly, positions) if anomaly else [],
            }
        if e.id in steps:  # a later status of the same decision (approved, expired, ...)
            steps[e.id]["decision"].update(status=e.status.value, step=e.step, reason=e.reason)
            steps[e.id]["statuses"].append([e.status.value, e.step])
            continue
        entry = steps[e.id] = {
            "decision": _plain(e, ("id", "step", "action", "params", "status", "rule", "rung", "reason")),
            "statuses": [[e.status.value, e.step]],
            "intervention": None, "outcome": None,
        }
        recs = records.get(e.id, [])
        if recs:
            entry["intervention"] = _plain(recs[-1], ("id", "step", "action", "before", "after", "reverted",
                                                      "simulated"))
        out = outcomes.get(e.id)
        if out is not None:
            entry["outcome"] = _plain(out, ("id", "step", "verdict", "evidence", "intervention_id"))
        inc["steps"].append(entry)
    handled = {i["anomaly"]["id"] for i in incidents.values() if i["anomaly"]}
    hang = hang_summary(anomalies.values())
    handled |= {r["id"] for r in hang["ranks"]} if hang else set()
    return {"incidents": list(incidents.values()), "hang": hang,
            "unhandled_anomalies": sum(1 for a in anomalies if a not in handled)}


def format_trace(trace: dict[str, Any]) -> list[str]:
    """Human-readable lines of a trace."""
    lines: list[str] = []
    for inc in trace["incidents"]:
        lines.append(f"incident {inc['incident']}  rule {inc['rule']}  runbook {inc['runbook']}")
        a = inc["anomaly"]
        if a:
            ev = a["evidence"]
            if ev:
                lines.append(f"  evidence     {_evidence_line(a['metric'], ev)}")
            thr = f" >= {a['threshold']:.4g}" if a.get("threshold") is not None else ""
            lines.append(f"  anomaly      {a['kind']} on {a['metric']} at step {a['step']} "
                         f"(score {a['score']:.4g}{thr}, {a['severity']}, {a['detector']})")
        if inc.get("batches"):
            shown = ", ".join(f"{st}:{b}" for st, b in inc["batches"][-8:])
            lines.append(f"  batches      step:batch_index {shown}")
        for s in inc["steps"]:
            d = s["decision"]
            params = ", ".join(f"{k}={v}" for k, v in d["params"].items())
            history = " -> ".join(f"{st}@{step}" for st, step in s["statuses"])
            lines.append(f"  decision     {d['id']} rule {d['rule']} rung {d['rung'] + 1}: {d['action']}({params}) "
                         f"[{history}]")
            lines.append(f"               {d['reason']}")
            iv = s["intervention"]
            if iv and _traits(iv["action"]).diagnoses and "error" not in iv["after"]:
                lines.extend(diagnosis_lines(iv))
            elif iv:
                traits = _traits(d["action"])
                label = ("revert" if iv["reverted"] else "release" if traits.releases
                         else "reapply" if traits.reapplies else "skipped" if "not_applied" in iv["after"]
                         else "intervention")
                lines.append(f"  {label:<13}step {iv['step']}: {_changes(iv)}")
            if d["status"] == "rejected":
                lines.append(f"  rejected     {_rejection(s, inc['steps'])}")
            o = s["outcome"]
            if o:
                ev = ", ".join(f"{k}={_short(v)}" for k, v in o["evidence"].items())
                lines.append(f"  outcome      {o['verdict']} at step {o['step']}: {ev}")
    lines.extend(hang_lines(trace.get("hang")))
    lines.append(f"{len(trace['incidents'])} incident(s); {trace['unhandled_anomalies']} anomaly(ies) "
                 "without an incident")
    return lines


def hang_lines(hang: dict[str, Any] | None) -> list[str]:
    """The hang reports of a run: each rank's last step, wait and where its main thread was; the culprit."""
    if not hang:
        return []
    culprit = hang["culprit"]
    lines = ["hang  " + (f"culprit rank {culprit}: {hang['why']}" if culprit is not None else hang["why"])]
    for r in hang["ranks"]:
        if r["silent"]:
            lines.append(f"  rank {r['rank']:<5} sent no hang report: stopped, frozen or dead (its peers waited "
                         f"{r['waited']:.3g} s after step {r['step']})")
            continue
        where = r["where"][0] if r["where"] else "no stack recorded"
        state = "waiting in a collective" if r["in_collective"] else "not in a collective"
        lines.append(f"  rank {r['rank']:<5} no step for {r['waited']:.3g} s after step {r['step']}; "
                     f"{state}: {where}")
    return lines


def _rejection(step: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    """What a rejection did to the incident's earlier changes: the values its reverts restored, or the
    changes left in force (``approval.on_reject: keep``, or a change that cannot be undone).

    >>> iv = {"before": {"clip": 1.5}, "after": {"clip": 1.0}, "action": "set_clip", "reverted": True, "step": 45}
    >>> rejected = {"decision": {"id": "d2", "step": 40, "action": "scale_lr", "params": {}}, "intervention": None,
    ...             "statuses": [["proposed", 40], ["rejected", 45]]}
    >>> revert = {"decision": {"id": "d3", "step": 45, "action": "revert", "params": {"rejected": "d2"}},
    ...           "intervention": iv}
    >>> _rejection(rejected, [rejected, revert])
    'at step 45: reverted clip 1.5 -> 1; nothing of this incident is left in force'
    """
    when = step["statuses"][-1][1]  # a stored decision keeps the step it was proposed at, its answer's is here
    d = step["decision"]
    reverts = [s for s in steps if _traits(s["decision"]["action"]).undoes and s["intervention"]
               and "error" not in s["intervention"]["after"]]
    undone = {str(s["decision"]["params"].get("intervention_id")) for s in reverts}
    mine = [s["intervention"] for s in reverts if s["decision"]["params"].get("rejected") == d["id"]]
    kept = [s["intervention"] for s in steps if _in_force(s) and s["intervention"]["id"] not in undone]
    parts = [f"reverted {'; '.join(_changes(iv) for iv in mine)}"] if mine else []
    listed = "; ".join(f"{iv['action']} {_changes(iv)}" for iv in kept)
    parts.append(f"kept in force {listed}" if kept else "nothing of this incident is left in force")
    return f"at step {mine[0]['step'] if mine else when}: {'; '.join(parts)}"


def _in_force(step: dict[str, Any]) -> bool:
    iv = step["intervention"]
    return (iv is not None and _traits(step["decision"]["action"]).stays_in_force and not iv["reverted"]
            and "error" not in iv["after"] and "not_applied" not in iv["after"])


def diagnosis_lines(iv: dict[str, Any]) -> list[str]:
    """A diagnose intervention: verdict, the two experiments, the batches (sample ids when recorded)."""
    after = iv["after"]
    lines = [f"  diagnosis    step {iv['step']}: verdict {after.get('verdict')}: {after.get('summary', '')}"]
    rerun = after.get("rerun") or {}
    if rerun:
        what = {True: "reproduced", False: "NOT reproduced", None: f"not run ({rerun.get('skipped')})"}
        m = rerun.get("mismatch")
        differs = (f": at step {m['step']} {m['metric']} {_short(m['rerun'])} re-run, {_short(m['recorded'])} "
                   "recorded" if m else "")
        lines.append(f"               re-run steps {rerun.get('from_step')}-{rerun.get('to_step')} from the "
                     f"checkpoint: {what[rerun.get('reproduced')]}{differs}")
        ranks = rerun.get("ranks", [])
        for r in ranks if len(ranks) > 1 else []:
            lines.append(f"               rank {r['rank']} on {r['host']} at step {r['step']}: "
                         f"recorded {_values(r['recorded'])}; re-run {_values(r['rerun'])}")
        landing = after.get("landing") or {}
        if landing:  # the state before the step that did not reproduce: where the restart after it lands
            lines.append(f"               the re-run's state at step {landing.get('step')} kept for the restart"
                         if "refused" not in landing else
                         f"               the re-run's state at step {landing.get('step')} not kept for the restart: "
                         f"{landing['refused']}")
    replay = after.get("replay") or {}
    skipped = replay.get("skipped")
    if skipped:
        lines.append(f"               replay of the batches: not run ({skipped})")
    elif replay.get("settled"):
        lines.append(f"               replay of the batches: {replay.get('replayed')} replayed ({replay['settled']})")
    for b in after.get("batches", []):
        ids = f" samples {b['sample_ids']}" if b.get("sample_ids") is not None else ""
        at = ("" if skipped or b.get("at_checkpoint") is None else
              f", {_short(b['at_checkpoint'])} at the checkpoint of step {after.get('checkpoint_step')}")
        lines.append(f"               {b['role']:<9} step {b['step']} batch {b['batch_index']}: "
                     f"{after.get('signal')} {_short(b['recorded'])} recorded{at}{ids}")
    if after.get("host") is not None:  # a replay's diagnosis ran nowhere
        lines.append(f"               rank {after.get('rank')} on {after.get('host')}, {after.get('seconds')} s")
    return lines


def _batches(anomaly: Anomaly, positions: Sequence[tuple[int, int | None]]) -> list[list[int | None]]:
    """[step, batch_index] of the steps of the anomaly's evidence window: the first stretch of recorded steps
    that runs up to the anomaly's step (later timelines after a rollback repeat step numbers)."""
    if not anomaly.evidence or not positions:
        return []
    first, last = anomaly.evidence[0][0], anomaly.step
    for i, (step, _) in enumerate(positions):
        if step == last:
            stretch: list[tuple[int, int | None]] = []
            for s, b in reversed(positions[: i + 1]):
                if s < first or (stretch and s >= stretch[-1][0]):
                    break
                stretch.append((s, b))
            return [[s, b] for s, b in reversed(stretch)]
    return []


def _changes(iv: dict[str, Any]) -> str:
    if "error" in iv["after"]:
        return f"FAILED: {iv['after']['error']}"
    before, after = iv["before"], iv["after"]
    shared = [k for k in before if k in after]
    parts = [f"{k} {_short(before[k])} -> {_short(after[k])}" for k in shared]
    # what only one side has (a rollback's request vs. what it restored) is listed as such, not as "None ->"
    for side, values in (("before", before), ("after", after)):
        only = [f"{k}={_short(v)}" for k, v in values.items() if k not in shared]
        if only:
            parts.append(f"{side}: {', '.join(only)}")
    return "; ".join(parts) or "no change"


def _values(values: dict[str, Any] | None) -> str:
    return ", ".join(f"{k} {_short(v)}" for k, v in (values or {}).items() if v is not None) or "-"


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _anomaly(a: Anomaly) -> dict[str, Any]:
    return _plain(a, ("id", "kind", "metric", "step", "score", "severity", "detector", "threshold", "message",
                      "evidence"))


def _plain(event: Any, fields: Sequence[str]) -> dict[str, Any]:
    d = to_dict(event)
    return {f: d[f] for f in fields}


def _evidence_line(metric: str, evidence: list[Any]) -> str:
    """The window in one line: its baseline (median of the values before the peak) and peak, then the last
    values, labelled as the last ones when the window holds more.

    >>> _evidence_line("loss", [(1, 2.0), (2, 2.1), (3, 1.9), (4, 6.0)])
    'loss steps 1-4: baseline 2, peak 6 at step 4; values 2, 2.1, 1.9, 6'
    """
    values = [(s, v) for s, v in evidence if isinstance(v, (int, float))]
    finite = [(s, v) for s, v in values if math.isfinite(v)]
    head = f"{metric} steps {evidence[0][0]}-{evidence[-1][0]}"
    broken = [(s, v) for s, v in values if not math.isfinite(v)]
    if finite or broken:
        peak_step, peak = broken[0] if broken else max(finite, key=lambda sv: sv[1])
        before = [v for s, v in finite if s < peak_step]
        base = f"baseline {statistics.median(before):.4g}, " if before else ""
        head += f": {base}peak {peak:.4g} at step {peak_step}"
    tail = values[-8:]
    label = "values" if len(tail) == len(values) else f"last {len(tail)} of {len(values)}"
    return f"{head}; {label} " + ", ".join(f"{v:.4g}" for _, v in tail)
