"""What a checkpoint holds, how it is restored, and rollback to the last-known-good checkpoint.

:func:`training_state` is everything needed to continue exactly: model, optimizer, GradScaler, scheduler and
the monitor's own state (step counter, data position and skipped batches, overrides, detector/engine/executor
state).
:func:`rollback` asks the :class:`~stabmon.checkpoints.CheckpointManager` for the newest checkpoint that
validates (exists -> byte count -> loads -> finite) saved at least ``lookback`` steps before the anomaly's
onset, restores the training state and step counter from it, keeps the detectors, engine, executor and
overrides as they are now (the engine is in the middle of handling the incident), and skips the next
``skip_batches`` batches.

>>> import torch
>>> from stabmon.monitor import Monitor
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> mon = Monitor(model, opt, store=None)
>>> sorted(training_state(mon))
['model', 'monitor', 'optimizer', 'scaler', 'scheduler']
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def training_state(monitor: Any) -> dict[str, Any]:
    return {
        "model": monitor.model.state_dict(),
        "optimizer": monitor.optimizer.state_dict(),
        "scaler": monitor.scaler.state_dict() if monitor.scaler is not None else None,
        "scheduler": monitor.scheduler.state_dict() if monitor.scheduler is not None else None,
        "monitor": monitor.state_dict(),
    }


def mismatch(monitor: Any, state: Any) -> str | None:
    """Why ``state`` cannot be restored into the monitor's model and optimizer (missing or unexpected keys,
    another shape or dtype, another optimizer layout), or None when it fits. Reads metadata only."""
    import torch

    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return "holds no model state"
    mine, theirs = monitor.model.state_dict(), state["model"]
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        return f"does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
    for key, t in mine.items():
        o = theirs[key]
        if not isinstance(o, torch.Tensor) or o.shape != t.shape or o.dtype != t.dtype:
            got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
            return f"does not match the model: {key} is {got}, the model has {tuple(t.shape)} {t.dtype}"
    groups = (state.get("optimizer") or {}).get("param_groups")
    want = [len(g["params"]) for g in monitor.optimizer.param_groups]
    if groups is None or [len(g.get("params", ())) for g in groups] != want:
        return f"does not match the optimizer: parameter groups of sizes {want} expected"
    return None


def load_training_state(monitor: Any, state: dict[str, Any], *, pipeline: bool = True) -> None:
    """Restore everything :func:`training_state` saved (``pipeline=False`` keeps detector/engine state).

    All or nothing: ``ValueError`` before anything is touched when the state does not fit the model or the
    optimizer, and the previous state is put back if loading fails part-way."""
    problem = mismatch(monitor, state)
    if problem is not None:
        raise ValueError(f"checkpoint {problem}")
    import copy

    before = copy.deepcopy({k: v for k, v in training_state(monitor).items() if k != "monitor"})
    try:
        _load(monitor, state, pipeline=pipeline)
    except BaseException:
        _load(monitor, {**before, "monitor": None}, pipeline=pipeline)
        raise


def _load(monitor: Any, state: dict[str, Any], *, pipeline: bool) -> None:
    monitor.model.load_state_dict(state["model"])
    monitor.optimizer.load_state_dict(state["optimizer"])
    if monitor.scaler is not None and state.get("scaler") is not None:
        monitor.scaler.load_state_dict(state["scaler"])
    if monitor.scheduler is not None and state.get("scheduler") is not None:
        monitor.scheduler.load_state_dict(state["scheduler"])
    if state.get("monitor") is not None:
        monitor.load_state_dict(state["monitor"], pipeline=pipeline)


def _record_timeline(monitor: Any, manager: Any, target: Any) -> None:
    """The rollback in the registry: later checkpoints abandoned, and the rolled-back state (skip set in
    force) saved at once on the new timeline, so a resume continues from here and not from undone training."""
    if getattr(monitor, "rank", 0) != 0:
        return
    manager.rolled_back(target)
    if manager is monitor.checkpoints:
        monitor.save_checkpoint()


def rollback(
    monitor: Any, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
) -> dict[str, Any]:
    """Restore the last-known-good checkpoint and skip data; returns the audit facts. Raises when no
    checkpoint validates (the executor records the failure and the engine escalates)."""
    manager = monitor.checkpoints
    if checkpoint_dir is not None:
        from stabmon.checkpoints import CheckpointManager

        manager = CheckpointManager(checkpoint_dir)
    if manager is None:
        raise RuntimeError("rollback needs checkpoints: create the Monitor with checkpoint_dir=...")
    if getattr(monitor, "rank", 0) != 0 and checkpoint_dir is None:
        from stabmon.checkpoints import CheckpointManager

        manager = CheckpointManager(manager.directory)  # rank 0 wrote the registry: read it afresh
    from_step, from_position = monitor.step, monitor.cursor.position
    # a run younger than the lookback goes back to its oldest checkpoint (the initial state is saved at step 0)
    info, state = manager.last_known_good(
        before_step=max(0, onset_step - lookback), check=lambda s: mismatch(monitor, s)
    )
    overrides = monitor.overrides.state_dict()
    skipped_before = set(monitor.cursor.skip)
    load_training_state(monitor, state, pipeline=False)
    monitor.overrides.load_state_dict(overrides)  # interventions in force stay in force
    monitor.cursor.skip |= skipped_before
    if monitor.cursor.rewindable:
        monitor.cursor.rewind(monitor.cursor.position)
    else:  # a one-shot iterator cannot be rewound: the data keeps flowing forward
        monitor.cursor.position = from_position
    start = monitor.cursor.position
    skipped = monitor.cursor.skip_range(start, skip_batches)
    if skipped:
        monitor._guard(
            "store",
            lambda: monitor.store.write_skipped_batches(
                run_id=monitor.run_id, step=monitor.step, batch_indices=skipped
            ),
        )
    _record_timeline(monitor, manager, info)
    skipping = f"; skipping batches [{start}, {start + skip_batches})" if skip_batches else ""
    log.warning("stabmon: rolled back from step %d to checkpoint step %d (%s)%s", from_step, info.step, info.path,
                skipping)
    return {
        "checkpoint_path": info.path,
        "checkpoint_step": info.step,
        "restored_step": monitor.step,
        "from_step": from_step,
        "skipped": [start, start + skip_batches],
        "rewound_data": monitor.cursor.rewindable,
    }
