"""The two experiments of ``diagnose`` on the live model: replay the incident's batches at a checkpoint, and
re-run the steps from that checkpoint to the incident (the verdict logic is :mod:`stabmon.diagnose.verdict`).

Everything happens inside one flush, on the model and optimizer themselves, with the monitor's hooks paused:
their state (and a GradScaler's) is copied first (one copy of parameters and optimizer state, on their
device) and restored after, exactly, with the RNG state, whatever happens; a failure becomes an
``inconclusive`` verdict with its reason. Work: ``2 x max_batches`` forward+backward passes (no update) for
the replay, and at most the checkpoint interval of training steps for the re-run
(:mod:`stabmon.diagnose.rerun`). Nothing runs unless a runbook rung asks for ``diagnose``. Under
torch.distributed every rank runs this together (:mod:`stabmon.diagnose.ranks`). The collaborators come in a
:class:`Bench`, built by :func:`stabmon.diagnose.build.build_diagnoser`.

The loss of a batch is computed by ``loss_fn(model, batch)``; the default, :func:`call_model`, calls
``model(*batch)`` (a tuple or list), ``model(**batch)`` (a mapping) or ``model(batch)`` and takes the
result, or its ``loss`` (a HF ``ModelOutput``).

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> float(call_model(lambda x: (x ** 2).sum(), torch.ones(3)))
3.0
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stabmon.checkpoints import CheckpointStore
from stabmon.collect.batches import BatchEntry, BatchLog
from stabmon.collect.signals.grads import GradNorms
from stabmon.diagnose import verdict as dx
from stabmon.diagnose.ranks import RankChannel
from stabmon.diagnose.rerun import LossFn, rerun_steps, seed
from stabmon.diagnose.verdict import Diagnosis
from stabmon.events import Metric, StepRecord


def call_model(model: Any, batch: Any) -> torch.Tensor:
    """The default ``loss_fn``: the model's output for the batch is its loss (see the module docstring)."""
    if isinstance(batch, (tuple, list)):
        out = model(*batch)
    elif isinstance(batch, Mapping):
        out = model(**batch)
    else:
        out = model(batch)
    loss = out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("diagnose: the model's output is not a scalar loss; pass Monitor(loss_fn=...)")
    return loss


@dataclass(frozen=True)
class Bench:
    """What the experiments work with: the monitor's collaborators, passed in (nothing calls back into it).
    ``own``: under torch.distributed, this rank's own recorded loss per step
    (:attr:`~stabmon.collect.cluster.ranks.RankGather.own`); None in one process. ``channel``: the exchanges
    between ranks (None: one process)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grads: GradNorms
    loss_fn: LossFn
    batches: BatchLog
    records: Iterable[StepRecord]
    checkpoints: CheckpointStore | None
    check: Callable[[dict[str, Any]], str | None]
    paused: Callable[[], contextlib.AbstractContextManager[Any]]
    scaler: Any = None
    own: Mapping[int, Mapping[str, float]] | None = None
    channel: RankChannel | None = None
    rank: int = 0
    land: Callable[..., str | None] | None = None
    """Where one process hands the state a re-run that did not reproduce left (``RerunLanding.offer``; it returns
    why it cannot keep it); None: nowhere."""


@dataclass
class Plan:
    """What both experiments will do, chosen by each rank alone (the ranks then check they agree)."""

    signal: str
    incident: list[int]
    reference: list[int]
    baseline: list[float]
    entries: dict[int, BatchEntry]
    recorded: dict[int, StepRecord]
    checkpoint: Any
    state: dict[str, Any]
    rerun_skipped: str | None

    def key(self) -> tuple[Any, ...]:
        return (self.signal, self.incident, self.reference, self.checkpoint.step, self.rerun_skipped)


def run(bench: Bench, *, onset_step: int, step: int, metric: str, max_batches: int, rtol: float,
        recur: float) -> Diagnosis:
    """Both experiments and the verdict. Under torch.distributed every rank calls it with the same arguments and
    enters the same exchanges, in order; each holds rank 0's verdict, with its own ``seconds``."""
    t0 = time.perf_counter()
    host = socket.gethostname()
    where: dict[str, Any] = {"rank": bench.rank, "host": host, "onset_step": onset_step, "step": step,
                             "metric": metric}
    channel = bench.channel or RankChannel(rank=0, world_size=1, timeout=1.0)
    try:
        plan = _agreed(channel, bench, onset_step, step, metric, max_batches)
        local = _local(bench, plan, rtol, recur, host)
        found: Diagnosis = channel.share(_verdict(plan, channel.gather(local), recur, where))
    except _Missing as exc:
        found = Diagnosis.inconclusive(str(exc), **where)
    except Exception as exc:  # noqa: BLE001 - an exchange between ranks failed or timed out
        found = Diagnosis.inconclusive(f"rank {bench.rank}: the exchange between ranks failed: "
                                       f"{type(exc).__name__}: {exc}", **where)
    return dataclasses.replace(found, seconds=round(time.perf_counter() - t0, 3))


class _Missing(RuntimeError):
    """The evidence an experiment needs is not there (the verdict is then inconclusive)."""


def _agreed(channel: RankChannel, bench: Bench, onset: int, step: int, metric: str, k: int) -> Plan:
    """This rank's plan, once every rank has one and they are the same; else :class:`_Missing` on every rank."""
    try:
        plan: Plan | None = _plan(bench, onset, step, metric, k)
        mine: tuple[Any, ...] | str = plan.key()  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - _Missing, or anything else: the other ranks must hear of it
        plan, mine = None, str(exc) if isinstance(exc, _Missing) else f"{type(exc).__name__}: {exc}"
    plans = channel.gather(mine)
    missing = [(r, p) for r, p in enumerate(plans) if isinstance(p, str)]
    if missing:
        rank, why = missing[0]
        raise _Missing(why if len(plans) == 1 else f"rank {rank}: {why}")
    if any(p != plans[0] for p in plans):
        raise _Missing(f"the ranks chose different steps or checkpoints: {plans}")
    assert plan is not None
    return plan


def _plan(bench: Bench, onset: int, step: int, metric: str, k: int) -> Plan:
    recorded = {r.step: r for r in bench.records}  # a step trained again after a rollback: the newest wins
    signal = metric if metric in (Metric.LOSS, Metric.GRAD_NORM) else Metric.LOSS
    incident, reference, baseline = _choose(bench, recorded, signal, onset, step, k)
    entries = {s: _entry(bench.batches, s) for s in incident + reference}
    if bench.checkpoints is None:
        raise _Missing("diagnose needs checkpoints: create the Monitor with checkpoint_dir=...")
    before = min(min(incident), _peak(recorded, onset, step, k))
    try:
        info, state = bench.checkpoints.last_known_good(before_step=before, check=bench.check)
    except Exception as exc:  # noqa: BLE001 - no usable checkpoint: say so
        raise _Missing(f"no valid checkpoint at or before step {before}: {exc}") from None
    return Plan(signal=signal, incident=incident, reference=reference, baseline=baseline, entries=entries,
                recorded=recorded, checkpoint=info, state=state,
                rerun_skipped=_rerun_gap(bench, recorded, info.step, min(incident)))


PEAK_RATIO = 50.0
"""A gradient norm this many times its median before the onset (the default runbook's first sign), or a non-finite
one, marks a step the diagnosis starts before (:func:`_peak`)."""


def _peak(recorded: Mapping[int, StepRecord], onset: int, step: int, k: int) -> int:
    """The first step of the incident (``onset..step``) whose gradient norm is non-finite or :data:`PEAK_RATIO`
    times its median over the ``4 k`` steps before the onset (``step`` when there is none). The diagnosis starts
    from a state before it as well as before the incident's first step: a step that does not reproduce shows there
    first, and the incident's steps, chosen on the loss, can all come after it (a gradient spike whose damage to
    Adam's second moment shows in the loss 10-20 steps later)."""
    before = [v for s in range(onset - 4 * k, onset)
              if (v := _value(recorded.get(s), Metric.GRAD_NORM)) is not None and math.isfinite(v)]
    bar = PEAK_RATIO * statistics.median(before) if before else math.inf
    for s in range(onset, step + 1):
        v = _value(recorded.get(s), Metric.GRAD_NORM)
        if v is not None and (not math.isfinite(v) or v > bar):
            return s
    return step


def _rerun_gap(bench: Bench, recorded: Mapping[int, StepRecord], start: int, stop: int) -> str | None:
    """Why steps ``start..stop`` cannot be re-run (None: they can)."""
    for s in range(start, stop + 1):
        if bench.batches.get(s) is None or s not in recorded:
            return f"step {s} is no longer in the batch log or the records"
        if bench.own is not None and s not in bench.own:
            return f"rank {bench.rank} no longer holds its own values of step {s}"
    return None


def _choose(bench: Bench, recorded: dict[int, StepRecord], signal: str, onset: int, step: int,
            k: int) -> tuple[list[int], list[int], list[float]]:
    """(incident steps, reference steps, the recorded baseline before the onset)."""
    window = [(s, v) for s in range(onset, step + 1) if (v := _value(recorded.get(s), signal)) is not None]
    baseline = [v for s in range(onset - 4 * k, onset) if (v := _value(recorded.get(s), signal)) is not None]
    incident = dx.incident_steps(window, baseline=baseline, limit=k)
    handed = bench.batches.steps()
    if not handed:
        raise _Missing("no batch was handed to the monitor (draw them through monitor.steps(loader), or pass "
                       "begin_step(batch=...) or monitor.hand_batch(batch))")
    if not incident:
        raise _Missing(f"no {signal} recorded for the incident (steps {onset}-{step})")
    reference = dx.reference_steps(handed, incident, k)
    if not reference:
        raise _Missing(f"no batches before the incident (steps {onset}-{step}) are still in the batch log"
                       f"{_bound(bench.batches)}")
    return incident, reference, baseline


def _value(record: StepRecord | None, name: str) -> float | None:
    return None if record is None else record.get(name)


def _median(values: Sequence[float | None]) -> float:
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    return statistics.median(finite) if finite else math.nan


def _entry(batches: BatchLog, step: int) -> BatchEntry:
    entry = batches.get(step)
    if entry is None:
        raise _Missing(f"the batch of step {step} is no longer in the batch log{_bound(batches)}")
    return entry


def _bound(batches: BatchLog) -> str:
    size = "" if batches.max_bytes is None else f", at most {batches.max_bytes} bytes"
    return f" (it keeps {batches.capacity} batches{size}: MonitorConfig.diagnose)"


REPLAY_NOT_NEEDED = "the re-run did not reproduce: the verdict is hardware_suspect whatever the replay shows"
"""Why one process replays no batch after a re-run that did not reproduce (see :func:`_local`)."""


FIRST_HALF = "the first half of the batches decided it by a margin; the rest were not replayed"
"""Why one process replayed only half the batches (see :func:`_settled`)."""


def _local(bench: Bench, plan: Plan, rtol: float, recur: float, host: str) -> dict[str, Any]:
    """This rank's evidence: its replayed values and its re-run, or the error that stopped them.

    The re-run comes first. In one process it stops at the first step that does not reproduce, and the batches
    are then not replayed: that verdict (``hardware_suspect``) depends on neither the later steps nor the replay,
    and each is a forward and backward pass. Also in one process, the replay runs in two halves and stops after
    the first when its answer is settled by a margin (:func:`_settled`). Under torch.distributed every rank
    re-runs every step (a backward under DDP is a collective) and replays every batch: another rank's re-run may
    be the one that did not reproduce, and the ranks' values are averaged before any answer."""
    pick = 0 if plan.signal == Metric.LOSS else 1
    mine: dict[str, Any] = {"rank": bench.rank, "host": host, "measured": None}
    alone = bench.channel is None or bench.channel.world_size == 1
    trained: dict[str, Any] | None = None
    try:
        with bench.paused(), _restored(bench):
            _load(bench, plan.state)
            mine["rerun"] = _rerun(bench, plan, rtol, first_mismatch=alone)
            if alone and mine["rerun"].get("reproduced") is False:
                trained = _trained(bench) if bench.land is not None else None
            else:
                _load(bench, plan.state)  # the replay is at the checkpoint's state, not the re-run's
                measured: dict[int, float] = {}
                for part in _halves(plan) if alone else [plan.incident + plan.reference]:
                    measured.update({s: _measure(bench, plan.entries[s])[pick] for s in part})
                    mine["measured"] = measured
                    if alone and _settled(plan, measured, recur):
                        break
        if trained is not None and bench.land is not None:  # (restored by now: the live state is the run's again)
            mine["landing"] = _landing(bench, plan, mine["rerun"], trained)
    except Exception as exc:  # noqa: BLE001 - the other ranks must still hear from this one
        mine["error"] = f"{type(exc).__name__}: {exc}"
    return mine


def _trained(bench: Bench) -> dict[str, Any]:
    """The state a re-run left, to outlive the restore: a copy of the weights (the restore copies into them), the
    optimizer's state by reference (the restore replaces its tensors), the GradScaler's."""
    out = {"model": copy.deepcopy(bench.model.state_dict()), "optimizer": bench.optimizer.state_dict()}
    if bench.scaler is not None:
        out["scaler"] = copy.deepcopy(bench.scaler.state_dict())
    return out


def _landing(bench: Bench, plan: Plan, rerun: Mapping[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """The re-run's state offered as the restart's landing (the state before the first step that did not
    reproduce); the record says where, or why not."""
    stop = int(rerun["to_step"])
    assert bench.land is not None
    why = bench.land(checkpoint=plan.state, start=plan.checkpoint.step, stop=stop, trained=trained,
                     recorded=plan.recorded, batches=bench.batches)
    return {"step": stop} if why is None else {"step": stop, "refused": why}


def _halves(plan: Plan) -> list[list[int]]:
    """The replay in two parts: the earlier half of the incident's steps (at least one) with the half of the
    reference steps nearest them, then the rest."""
    inc, ref = plan.incident, plan.reference
    first = inc[: (len(inc) + 1) // 2] + ref[len(ref) // 2:]
    return [first, [s for s in inc + ref if s not in first]]


def _settled(plan: Plan, measured: Mapping[int, float], recur: float) -> bool:
    """Whether the batches replayed so far decide by a factor of two either side of the bar: the incident's stand
    out by at least twice the excess needed (data), or by at most half of it (not data). In between, the rest is
    replayed and the answer is taken on every batch."""
    if len(measured) == len(plan.incident) + len(plan.reference):
        return True
    found = _replay(plan, measured, recur)
    if found.get("recurs") is None:
        return False
    excess, needed = float(found["excess"]), float(found["needed"])  # "inf": the incident's batches are non-finite
    return excess >= 2 * needed if found["recurs"] else excess <= needed / 2


def _replay(plan: Plan, measured: Mapping[int, float], recur: float) -> dict[str, Any]:
    """The replay's answer on the batches ``measured`` (each step's value at the checkpoint state)."""
    recorded, signal = plan.recorded, plan.signal
    incident = [s for s in plan.incident if s in measured]
    recorded_excess = _median([_value(recorded.get(s), signal) for s in incident]) - _median(plan.baseline)
    return dx.replay_recurs(incident=[measured[s] for s in incident],
                            reference=[measured[s] for s in plan.reference if s in measured],
                            recorded_excess=recorded_excess, recur=recur)


def _rerun(bench: Bench, plan: Plan, rtol: float, first_mismatch: bool) -> dict[str, Any]:
    start, stop = plan.checkpoint.step, min(plan.incident)
    if plan.rerun_skipped is not None:
        return {"from_step": start, "to_step": stop, "rtol": rtol, "reproduced": None,
                "skipped": plan.rerun_skipped}
    return rerun_steps(model=bench.model, optimizer=bench.optimizer, grads=bench.grads, loss_fn=bench.loss_fn,
                       batches=bench.batches, recorded=plan.recorded, own=bench.own, scaler=bench.scaler,
                       start=start, stop=stop, rtol=rtol, first_mismatch=first_mismatch)


def _verdict(plan: Plan, evidence: Sequence[dict[str, Any]], recur: float, where: dict[str, Any]) -> Diagnosis:
    """The verdict from every rank's evidence (the same on every rank: the same inputs)."""
    failed = [e for e in evidence if "error" in e]
    if failed:
        raise _Missing(f"rank {failed[0]['rank']} could not run the experiments: {failed[0]['error']}")
    rerun = dx.combine_reruns([{**e["rerun"], "rank": e["rank"], "host": e["host"]} for e in evidence])
    recorded, signal, incident, reference = plan.recorded, plan.signal, plan.incident, plan.reference
    if any(e["measured"] is None for e in evidence):  # one process, its re-run did not reproduce
        measured: dict[int, float] = {}
        replay: dict[str, Any] = {"recurs": None, "skipped": REPLAY_NOT_NEEDED}
    else:
        measured = dx.mean_values([e["measured"] for e in evidence])
        replay = {**_replay(plan, measured, recur), "replayed": len(measured)}
        if len(measured) < len(incident) + len(reference):
            replay["settled"] = FIRST_HALF
    replay["checkpoint_step"] = plan.checkpoint.step
    verdict, summary = dx.verdict_of(rerun, replay)
    batches = [{**plan.entries[s].describe(), "role": "incident" if s in incident else "reference",
                "recorded": dx.plain(_value(recorded.get(s), signal)), "at_checkpoint": dx.plain(measured.get(s))}
               for s in sorted(plan.entries)]
    found = {"signal": signal, "checkpoint_step": plan.checkpoint.step, "checkpoint_path": str(plan.checkpoint.path),
             "incident_steps": incident, "reference_steps": reference, "replay": replay, "rerun": rerun,
             "batches": batches}
    if verdict == "hardware_suspect" and isinstance((rerun.get("mismatch") or {}).get("step"), int):
        # every step before the first one that did not reproduce did, on every rank: the state after them is good
        found["cleared_step"] = rerun["mismatch"]["step"]
    landing = evidence[0].get("landing") if len(evidence) == 1 else None
    if landing is not None:
        found["landing"] = landing
    named = (rerun.get("mismatch") or {}).get("rank")
    if verdict == "hardware_suspect" and named is not None:  # the rank and host to move away from
        where = {**where, "rank": named, "host": rerun["mismatch"]["host"]}
    return Diagnosis(verdict, summary, evidence=found, **where)


@contextlib.contextmanager
def _restored(bench: Bench) -> Iterator[None]:
    """Model, optimizer, GradScaler, gradients and RNG exactly as they were, afterwards. The GradScaler's
    per-optimizer stage too, which its ``state_dict`` leaves out: a re-run ends on ``unscale_`` with no update,
    and a scaler left at that stage would hand the loop's next step its gradients still scaled (and the re-run's
    overflow flag)."""
    model_state = copy.deepcopy(bench.model.state_dict())
    opt_state = copy.deepcopy(bench.optimizer.state_dict())
    scaler_state = copy.deepcopy(bench.scaler.state_dict()) if bench.scaler is not None else None
    scaler = bench.scaler
    stages = getattr(scaler, "_per_optimizer_states", None)  # (scaler.update() replaces the dict)
    stages = copy.deepcopy(stages) if stages is not None else None
    grads = [None if p.grad is None else p.grad.detach().clone() for p in bench.grads.params]
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        bench.model.load_state_dict(model_state)
        bench.optimizer.load_state_dict(opt_state)
        if scaler_state is not None:
            bench.scaler.load_state_dict(scaler_state)
        if stages is not None:
            scaler._per_optimizer_states = stages
        for p, g in zip(bench.grads.params, grads, strict=True):
            p.grad = g
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _load(bench: Bench, state: dict[str, Any]) -> None:
    bench.model.load_state_dict(state["model"])
    bench.optimizer.load_state_dict(state["optimizer"])
    if bench.scaler is not None:
        if state.get("scaler") is None:
            raise _Missing("the checkpoint holds no GradScaler state to re-run from")
        bench.scaler.load_state_dict(state["scaler"])


def _measure(bench: Bench, entry: BatchEntry) -> tuple[float, float]:
    """(loss, grad norm) of one batch at the state loaded, without an update."""
    bench.optimizer.zero_grad(set_to_none=True)
    seed(entry)
    loss = bench.loss_fn(bench.model, entry.batch)
    loss.backward()
    result = bench.grads.compute()
    norm = float(result.total) if result is not None else math.nan
    bench.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), norm
