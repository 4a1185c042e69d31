"""Why did it spike? The verdict of ``diagnose``: ``data``, ``state`` or ``hardware_suspect``.

Two experiments answer it (:mod:`stabmon.diagnose.experiments` runs them on the live model, at the flush that
decided to diagnose; docs/diagnose.md has the costs):

1. **re-run**: from the newest valid checkpoint at or before the incident's first step, the recorded steps are
   trained again on the same batches with the same RNG state and the hyper-parameters in force then, up to
   that first step; each step's loss and grad norm are compared with the recorded ones. A deterministic
   re-run reproduces them; one that differs beyond ``rtol`` means the first execution did not compute what the
   same inputs compute: a transient fault (Megatron's rerun state machine) -> ``hardware_suspect``.
2. **replay**: at that same checkpoint state (before the incident), the loss of the incident's batches is
   compared with the loss of the batches just before them. If the incident's batches stand out there too by
   at least ``recur`` of the excess that was recorded (and clearly above the reference batches' spread), the
   spike recurs from a good state: the batches are to blame -> ``data`` (roll back and skip them). If they are
   ordinary there, it was the state meeting those batches (PaLM's finding) -> ``state`` (roll back and change
   the recipe).

Under torch.distributed every rank runs both experiments on its own batches; :func:`combine_reruns` names the
rank whose own loss did not reproduce, and the replay takes each step's mean over ranks (:func:`mean_values`).

When the evidence is missing (no checkpoint, the batches are gone from the batch log, ranks that cannot agree
on a plan) the verdict is ``inconclusive`` and says why; a runbook then goes on to the diagnose rung's next
rung. The result travels as a :class:`Diagnosis`.

This module is pure (no torch): which steps to replay, and the verdict from the measured numbers.

>>> window = [(10, 1.7), (11, 1.6), (12, 4.5), (13, 4.4), (14, 4.3)]
>>> incident_steps(window, baseline=[1.7, 1.65, 1.6], limit=8)
[12, 13, 14]
>>> replay_recurs(incident=[4.4, 4.5], reference=[1.7, 1.6, 1.65], recorded_excess=2.8, recur=0.5)["recurs"]
True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

VERDICTS = ("data", "state", "hardware_suspect")
"""The verdicts a runbook rule can branch on (``when: {verdict: ...}``)."""
INCONCLUSIVE = "inconclusive"

MIN_EXCESS = 0.05
"""A replayed excess must also exceed this fraction of the reference batches' median to count as a recurrence."""
SPREAD_FACTOR = 3.0
"""... and this many median absolute deviations of the reference batches' values."""


@dataclass(frozen=True)
class Diagnosis:
    """What ``diagnose`` found: the verdict, a one-line summary, and the evidence behind them.

    ``rank`` / ``host``: the process that made it, or for ``hardware_suspect`` the rank whose first execution
    did not reproduce (the one to move away from). ``evidence``: the experiments' results (``signal``,
    ``checkpoint_step``, ``checkpoint_path``, ``incident_steps``, ``reference_steps``, ``replay``, ``rerun``,
    ``batches``; docs/diagnose.md). ``not_run``: why no experiment ran (``"replay"``: a replay has no model).
    :meth:`as_after` is the form the intervention record keeps (only what is known).

    >>> d = Diagnosis("data", "the batches are to blame", onset_step=150, step=152, metric="loss")
    >>> d.verdict in VERDICTS, d.as_after()
    (True, {'onset_step': 150, 'step': 152, 'metric': 'loss', 'verdict': 'data', 'summary': 'the batches are to blame'})
    >>> Diagnosis.inconclusive("no checkpoint").verdict
    'inconclusive'
    """

    verdict: str
    summary: str
    rank: int | None = None
    host: str | None = None
    onset_step: int | None = None
    step: int | None = None
    metric: str | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    simulated: bool = False
    not_run: str | None = None

    @classmethod
    def inconclusive(cls, why: str, **known: Any) -> Diagnosis:
        """No verdict, and why."""
        return cls(INCONCLUSIVE, why, **known)

    def as_after(self) -> dict[str, Any]:
        """The intervention record's ``after``: the fields that are known, the evidence's entries inline."""
        out: dict[str, Any] = {k: v for k, v in (("rank", self.rank), ("host", self.host),
                                                 ("onset_step", self.onset_step), ("step", self.step),
                                                 ("metric", self.metric)) if v is not None}
        out.update(verdict=self.verdict, summary=self.summary, **self.evidence)
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.simulated:
            out.update(simulated=True, not_run=self.not_run)
        return out


def finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def plain(v: float | None) -> float | str | None:
    """A JSON-safe number: non-finite values as their name (``"nan"``, ``"inf"``)."""
    if v is None:
        return None
    return float(v) if math.isfinite(v) else str(float(v))


def incident_steps(window: Sequence[tuple[int, float]], *, baseline: Sequence[float], limit: int) -> list[int]:
    """The steps of the incident's window that carry the trouble, at most ``limit``: those whose value rose
    more than half way from the baseline (the median before the window) to the peak, non-finite ones included;
    without a clear rise (a run that is not learning), the window's last ``limit`` steps."""
    if not window:
        return []
    base = [v for v in baseline if finite(v)]
    values = [v for _, v in window]
    peak = math.inf if any(not finite(v) for v in values) else max(values)
    if base:
        b = statistics.median(base)
        if not math.isfinite(peak):
            return [s for s, v in window if not finite(v)][:limit]
        if peak > b + max(abs(b) * MIN_EXCESS, 1e-12):
            threshold = b + 0.5 * (peak - b)
            return [s for s, v in window if v > threshold][:limit]
    return [s for s, _ in window][-limit:]


def reference_steps(available: Sequence[int], incident: Sequence[int], limit: int) -> list[int]:
    """Up to ``limit`` available steps nearest to the incident, before it first (the batches just before the
    onset), then after it."""
    if not incident:
        return []
    first, chosen = min(incident), set(incident)
    before = sorted((s for s in available if s < first and s not in chosen), reverse=True)[:limit]
    after = sorted(s for s in available if s > first and s not in chosen)[: max(0, limit - len(before))]
    return sorted(before + after)


def mad(values: Sequence[float]) -> float:
    med = statistics.median(values)
    return statistics.median(abs(v - med) for v in values)


def replay_recurs(
    *, incident: Sequence[float], reference: Sequence[float], recorded_excess: float | None, recur: float
) -> dict[str, Any]:
    """Does the incident stand out at the checkpoint state? ``incident`` / ``reference``: the values of those
    batches there; ``recorded_excess``: how far the incident stood above its baseline when it happened."""
    ref = [v for v in reference if finite(v)]
    if not ref or not incident:
        return {"recurs": None, "reason": "no finite reference values at the checkpoint state"}
    ref_med = statistics.median(ref)
    bad = [v for v in incident if not finite(v)]
    inc_med = math.inf if len(bad) * 2 > len(incident) else statistics.median(v for v in incident if finite(v))
    excess = inc_med - ref_med
    floor = max(MIN_EXCESS * abs(ref_med), SPREAD_FACTOR * mad(ref))
    needed = max(floor, recur * recorded_excess) if recorded_excess is not None and finite(recorded_excess) else floor
    return {"recurs": bool(excess > needed), "incident_median": plain(inc_med), "reference_median": plain(ref_med),
            "excess": plain(excess), "recorded_excess": plain(recorded_excess), "needed": plain(needed)}


def mean_values(per_rank: Sequence[dict[int, float]]) -> dict[int, float]:
    """Each step's mean over ranks (NaN on any rank stays NaN), as the record's cross-rank mean."""
    return {s: sum(r[s] for r in per_rank) / len(per_rank) for s in per_rank[0]}


def combine_reruns(reruns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One re-run result from every rank's (each with its ``rank`` and ``host``; one process: one).

    The earliest step any rank failed to reproduce decides: the ranks whose *own* value (the loss they
    computed themselves) differs there are the suspects, the first of them is named in ``mismatch``; when only
    values reduced across ranks differ (the fault was in a backward pass or a collective, and every rank saw
    it) no rank is named. ``ranks``: each rank's recorded and re-run values at that step (or the last one).

    >>> ok = {"rank": 0, "host": "a", "from_step": 5, "to_step": 7, "rtol": 1e-4, "reproduced": True, "steps": []}
    >>> bad = {**ok, "rank": 1, "host": "b", "reproduced": False,
    ...        "mismatch": {"step": 7, "metric": "loss", "recorded": "nan", "rerun": 1.7, "own": True}}
    >>> out = combine_reruns([ok, bad]); out["mismatch"]["rank"], out["mismatch"]["host"], out["suspect_ranks"]
    (1, 'b', [1])
    """
    first = reruns[0]
    out: dict[str, Any] = {k: first.get(k) for k in ("from_step", "to_step", "rtol")}
    skipped = next((r for r in reruns if r.get("reproduced") is None), None)
    if skipped is not None:
        return {**out, "reproduced": None, "skipped": skipped.get("skipped")}
    bad = [r for r in reruns if r["reproduced"] is False]
    step = min((r["mismatch"]["step"] for r in bad), default=first.get("to_step"))
    out["ranks"] = [_at(r, step) for r in reruns]
    if not bad:
        return {**out, "reproduced": True}
    there = [r for r in bad if r["mismatch"]["step"] == step]
    own = [r for r in there if r["mismatch"].get("own")]
    chosen = (own or there)[0]
    named = {"rank": chosen["rank"], "host": chosen["host"]} if own else {"rank": None, "host": None}
    return {**out, "reproduced": False, "mismatch": {**chosen["mismatch"], **named},
            "suspect_ranks": [r["rank"] for r in own]}


def _at(rerun: dict[str, Any], step: Any) -> dict[str, Any]:
    """A rank's recorded and re-run values at ``step``."""
    row: dict[str, Any] = next((s for s in rerun.get("steps", []) if s["step"] == step), {})
    return {"rank": rerun.get("rank"), "host": rerun.get("host"), "reproduced": rerun.get("reproduced"),
            "step": step, "recorded": row.get("recorded"), "rerun": row.get("rerun")}


def verdict_of(rerun: dict[str, Any] | None, replay: dict[str, Any] | None) -> tuple[str, str]:
    """(verdict, one-line summary) from the two experiments' results."""
    if rerun is not None and rerun.get("reproduced") is False:
        m = rerun.get("mismatch", {})
        who, what = "the run", "the first execution was not reproducible"
        if len(rerun.get("ranks", ())) > 1:
            if m.get("rank") is not None:
                who = f"rank {m['rank']} ({m.get('host')})"
                what = f"rank {m['rank']}'s first execution was not reproducible"
            else:
                who, what = "every rank", "a value reduced across ranks did not reproduce: no rank can be named"
        return "hardware_suspect", (f"re-running step {m.get('step')} from the checkpoint of step "
                                    f"{rerun.get('from_step')} gave {m.get('metric')} {_g(m.get('rerun'))} where "
                                    f"{who} recorded {_g(m.get('recorded'))}: {what}")
    if replay is None or replay.get("recurs") is None:
        why = (replay or {}).get("reason", "the incident's batches could not be replayed")
        return INCONCLUSIVE, why
    where = f"at the checkpoint of step {replay.get('checkpoint_step')}"
    if replay["recurs"]:
        return "data", (f"the incident's batches stand out {where} too (excess {_g(replay['excess'])} over the "
                        f"batches before them, needed {_g(replay['needed'])}): the data is to blame")
    return "state", (f"the incident's batches are ordinary {where} (excess {_g(replay['excess'])}, needed "
                     f"{_g(replay['needed'])}): the state met them; change the recipe")


def _g(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
