"""How long a change is observed, and whether it resolved its incident (kept apart from the engine).

A rung's window is the next ``observe`` records after its change lands, judged on its last
``success.quiet_steps`` (default: all of them): no anomaly the rule matches, the success tests the rung
names (``loss_within`` the baseline, the signal ``signal_below`` a bound), and, whatever the rung names, a loss
not clearly worse than the run's own pre-incident trajectory (the median of the ``baseline_steps`` losses
before the onset, plus ``CLEARLY_WORSE_NOISE`` of their spreads and at least ``CLEARLY_WORSE_REL`` of it): an
incident is not "resolved" while the run stays clearly worse than it was, so the ladder goes on. Every judgement
records the comparison (``pre_incident``: the median before, the lowest loss reached, the spread, the loss now).

A **rollback** is judged over the steps that caused it. Rolling back from step S to a checkpoint C re-trains
C..S, and whatever broke the run at S (a learning-rate schedule's peak, a bad stretch of data not skipped) comes
back only as the run reaches S again. So a rollback's window runs from the restored step until ``observe``
records at or past S have been seen (``Incident.until_step`` = S, the step the run was about to train when it
rolled back: steps up to S-1 had been trained). It is judged on every record from the incident's onset step on
(the re-trained steps that went wrong the first time, and the new ground after them), besides the usual last
``quiet_steps``: a matching anomaly there fails the rollback at once, and the same incident goes on to its next
rung (no new incident opens while it is observed). The re-trained steps before the onset are treated like the
start of any window: a transient there counts only if it falls in the last ``quiet_steps``. In replay a
simulated rollback does not rewind the steps, so its window is the usual one.

>>> from stabmon.runbook.state import Incident, WindowRow
>>> inc = Incident(id="i", rule="r", anomaly_id=None, metric="loss", onset_step=38, baseline=None, trigger="t")
>>> inc.until_step = 41  # rolled back to 30 after step 40
>>> inc.window = [WindowRow(step=s, loss=2.0, signal=1.0, matched=0) for s in range(30, 43)]
>>> window_over(inc, observe=5)  # 13 records, only 2 of them (41, 42) new ground
False
>>> inc.window.append(WindowRow(step=43, loss=2.0, signal=9.0, matched=1))
>>> window_over(inc, observe=5)  # the trouble came back: judged now
True
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from stabmon.runbook.state import Incident, WindowRow


def window_over(incident: Incident, observe: int) -> bool:
    """Whether the current change has been observed long enough to be judged."""
    window = incident.window
    if incident.until_step is None:
        return len(window) >= observe
    if window and window[-1].matched and window[-1].step >= incident.onset_step + incident.rewound_by:
        # it did not hold: judge now
        return True
    return sum(1 for w in window if w.step >= incident.until_step) >= observe


def criteria(incident: Incident, rung: Any) -> tuple[bool, dict[str, Any]]:
    """(resolved?, the evidence of the judgement) for the current change over its window."""
    window = incident.window
    k = rung.success.quiet_steps or rung.observe
    tail = window[-k:]
    scope = tail if incident.until_step is None else _from_onset(window, incident.onset_step + incident.rewound_by, k)
    matched = sum(w.matched for w in scope)
    ev: dict[str, Any] = {"observed_steps": len(window), "judged_steps": len(scope),
                          "matching_anomalies": matched, "metric": incident.metric}
    if incident.until_step is not None:
        ev["rolled_back_from"] = incident.until_step
    if incident.others:
        ev["other_rules"] = list(incident.others)
    ok = matched == 0 and len(window) >= rung.observe
    if incident.error is not None:
        ev["error"] = incident.error
        ok = False
    if rung.success.loss_within is not None:
        ok = _loss_within(incident, rung, tail, ev) and ok
    if _clearly_worse(incident, tail, ev):
        ok = False  # the run has not come back to where it was: the ladder goes on
    if rung.success.signal_below is not None:
        values = [w.signal for w in tail if w.signal is not None]
        peak = max(values, key=lambda v: math.inf if math.isnan(v) else v) if values else None
        ev.update(signal_max=peak, signal_below=rung.success.signal_below)
        ok = ok and peak is not None and not math.isnan(peak) and peak < rung.success.signal_below
    return ok, ev


CLEARLY_WORSE_NOISE = 4.0
"""How many of the pre-incident losses' spreads (1.4826 x MAD) above their median the judged loss must be to
count as clearly worse than before the incident."""
CLEARLY_WORSE_REL = 0.1
"""... and at least this fraction of that median: a run whose loss barely moved before is not judged on noise."""


MIN_LOSSES = 5
"""The fewest losses that make a baseline or a spread (fewer: none)."""

SCREEN_NOISE = 6.0
"""A data screen (``rollback`` with ``screen``) discards the update of a batch whose loss is above the pre-incident
median by this many spreads (1.4826 x MAD of the losses before the onset) ..."""
SCREEN_REL = 0.25
"""... and by at least this fraction of that median. One batch's loss is noisier than a median of them: both
margins are wider than the ones a judgement uses (``CLEARLY_WORSE_*``). A clean batch above the bar costs its
update, a bad one below it is trained on."""


def screen_bar(baseline: float | None, noise: float | None) -> float | None:
    """The loss above which a data screen discards a batch's update (None: no baseline to screen against).

    >>> screen_bar(2.0, 0.02), screen_bar(2.0, 0.2), screen_bar(None, 0.1)
    (2.5, 3.2, None)
    """
    if baseline is None or noise is None or not math.isfinite(baseline):
        return None
    return baseline + max(SCREEN_NOISE * noise, SCREEN_REL * abs(baseline))


def spread(losses: list[float]) -> float | None:
    """1.4826 x the median absolute deviation of ``losses`` (None: fewer than ``MIN_LOSSES`` finite ones).

    >>> round(spread([2.0, 2.1, 1.9, 2.0, 2.2]), 5)
    0.14826
    """
    finite = [v for v in losses if math.isfinite(v)]
    if len(finite) < MIN_LOSSES:
        return None
    mid = statistics.median(finite)
    return 1.4826 * statistics.median(abs(v - mid) for v in finite)


def _clearly_worse(incident: Incident, tail: list[Any], ev: dict[str, Any]) -> bool:
    """Compare the judged loss with the run's own pre-incident trajectory (put in ``ev`` as ``pre_incident``);
    True when it is clearly worse: above the pre-incident median by ``CLEARLY_WORSE_NOISE`` spreads and by
    ``CLEARLY_WORSE_REL`` of it. Only an incident that is open compares: a healthy run has none."""
    finite = [w.loss for w in tail if w.loss is not None and math.isfinite(w.loss)]
    if incident.baseline is None or incident.noise is None or not finite:
        return False
    now = statistics.median(finite)
    bar = max(CLEARLY_WORSE_NOISE * incident.noise, CLEARLY_WORSE_REL * abs(incident.baseline))
    worse = now - incident.baseline > bar
    ev["pre_incident"] = {"loss_median": incident.baseline, "loss_reached": incident.reached,
                          "loss_noise": incident.noise, "loss_now": now, "worse_by": now - incident.baseline,
                          "clearly_worse": worse}
    return worse


def _from_onset(window: list[Any], onset: int, k: int) -> list[Any]:
    """A rollback's judged records: those from the incident's onset step on, and the last ``k``."""
    first = len(window) - k
    return [w for i, w in enumerate(window) if w.step >= onset or i >= first]


def _loss_within(incident: Incident, rung: Any, tail: list[Any], ev: dict[str, Any]) -> bool:
    """The median loss of the judged rows is within ``loss_within`` of the baseline (and finite)."""
    losses = [w.loss for w in tail]
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    now = statistics.median(finite) if finite else None
    ev.update(loss_baseline=incident.baseline, loss_now=now, loss_within=rung.success.loss_within)
    if now is None or len(finite) < len([v for v in losses if v is not None]):
        ev["loss_nonfinite"] = True
        return False
    if incident.baseline is None:
        return True
    ev["loss_ratio"] = now / incident.baseline if incident.baseline else None
    return now <= incident.baseline * (1 + rung.success.loss_within)


def held(window: list[WindowRow]) -> int:
    """How long a failed attempt held the trouble off: steps from the first record observed after it landed to
    the first record with an anomaly its rule matches (the whole window where none did; it failed on its other
    tests). A rung with ``repeat`` is tried again only while each attempt holds the trouble off longer than the one
    before: a learning-rate cap that comes back at the same step after every rollback is not helping, and halving
    it again only costs the run more (a fault that is not the learning rate's doing, recurring after every
    restart).

    >>> rows = [WindowRow(step=s, loss=2.0, signal=None, matched=int(s == 130)) for s in range(100, 140)]
    >>> held(rows), held(rows[:20])
    (30, 20)
    """
    if not window:
        return 0
    first = window[0].step
    hit = next((r.step for r in window if r.matched), None)
    return (hit if hit is not None else window[-1].step + 1) - first
