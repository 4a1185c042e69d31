"""What a runbook's interventions act on in a live run: the :class:`~stabmon.pipeline.InterventionTarget`.

:class:`LiveTarget` holds the overrides the optimizer hooks apply around ``optimizer.step()``, reports the
values in force, restores the last-known-good checkpoint (rollback), saves a checkpoint and asks the loop to stop
(checkpoint-and-stop). The monitor builds it from its collaborators and hands it to the live executor; the
monitor's ``overrides``, ``rollback``, ``checkpoint_and_stop``, ``should_stop`` and ``exit_code`` are this
object's.

Rollback asks the :class:`~stabmon.checkpoints.CheckpointManager` for the newest checkpoint that validates
(exists -> byte count -> loads -> finite -> fits the model and optimizer) saved at least ``lookback`` steps
before the anomaly's onset, restores the training state and step counter from it, keeps the detectors, engine,
executor and overrides as they are now (the engine is in the middle of handling the incident), and skips the
next ``skip_batches`` batches (recorded in the store). A one-shot iterator cannot be rewound: the data then keeps
flowing forward and the skip starts at the current position.

>>> import torch
>>> from stabmon.collect.data import DataCursor
>>> from stabmon.collect.failsafe import Failsafe
>>> from stabmon.collect.flushing import Outbox
>>> from stabmon.collect.restore import TrainingState
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> safe = Failsafe()
>>> target = LiveTarget(hparams=lambda: {"lr": 0.1}, step=lambda: 5, state=TrainingState(model, opt),
...                     cursor=DataCursor(), outbox=Outbox(None, None, failsafe=safe, run_name="doc"),
...                     failsafe=safe, stop_code=86)
>>> target.checkpoint_and_stop(reason="operator")["exit_code"], target.should_stop, target.exit_code
(86, True, 86)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from stabmon.collect.data import DataCursor
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Outbox
from stabmon.collect.restore import TrainingState
from stabmon.interventions._state import RunFacts
from stabmon.overrides import Overrides

log = logging.getLogger(__name__)


class LiveTarget:
    """The live run's intervention target; see the module docstring."""

    def __init__(
        self,
        *,
        hparams: Callable[[], dict[str, float]],
        step: Callable[[], int],
        state: TrainingState,
        cursor: DataCursor,
        outbox: Outbox,
        failsafe: Failsafe,
        stop_code: int,
        overrides: Overrides | None = None,
        checkpoints: Any = None,
        rank: int = 0,
    ) -> None:
        self.overrides = overrides if overrides is not None else Overrides()
        self._hparams, self._step = hparams, step
        self.state, self.cursor, self.outbox, self.failsafe = state, cursor, outbox, failsafe
        self.stop_code = stop_code
        self.checkpoints = checkpoints
        """The :class:`~stabmon.checkpoints.CheckpointManager` or :class:`~stabmon.checkpoints.UserCheckpoints`
        (None: no checkpoints, no rollback)."""
        self.rank = rank
        self.should_stop = False
        self.stop_reason: str | None = None
        self.diagnoser: Callable[..., dict[str, Any]] | None = None
        """What the ``diagnose`` intervention calls (the monitor's re-run and replay); None: cannot diagnose."""

    @property
    def step(self) -> int:
        """Optimizer steps completed (the index the next step will get)."""
        return self._step()

    def hparams(self) -> dict[str, float]:
        """lr, beta2, weight_decay and clip in force for the next step (overrides included)."""
        return self._hparams()

    @property
    def exit_code(self) -> int:
        """0, or ``stop_code`` after a requested stop."""
        return self.stop_code if self.should_stop else 0

    def request_stop(self, reason: str | None) -> None:
        """Ask the training loop to stop at the next step boundary (no checkpoint: another rank saves it)."""
        self.should_stop, self.stop_reason = True, reason

    # -- the optimizer state and the weights, in place (stabmon.interventions._state) -------------------
    def facts(self) -> RunFacts:
        """What the state-level interventions can act on in this run."""
        from stabmon.collect.inplace import adam_like
        from stabmon.collect.moments import missing_state
        from stabmon.collect.qk import attention_layers
        from stabmon.collect.sharding import clean_name

        model, opt = self.state.model, self.state.optimizer
        return RunFacts(tensors=frozenset(clean_name(n) for n, _ in model.named_parameters()),
                        second_moment=missing_state(opt, "exp_avg_sq"), adam_update=adam_like(opt),
                        attention=tuple(attention_layers(model)))

    def reset_moments(self, *, tensors: Sequence[str], second_moment: bool) -> dict[str, Any]:
        """Zero the first (and second) moments of ``tensors`` (all when empty); returns the audit facts."""
        from stabmon.collect.moments import reset_moments

        done = reset_moments(self.state.model, self.state.optimizer, names=tensors, second=second_moment)
        log.warning("stabmon: moments of %d tensors reset at step %d (%s)", len(done), self.step,
                    ", ".join(tensors) or "all")
        return {"reset": len(done), "tensors": done[:20]}

    def qk_clip(self, *, layer: str | None, heads: Sequence[int] | None, factor: float) -> dict[str, Any]:
        """Scale the query/key weights of ``heads`` of ``layer`` so their logits scale by ``factor``."""
        from stabmon.collect.qk import qk_clip

        facts = qk_clip(self.state.model, layer=layer, heads=heads, factor=factor)
        log.warning("stabmon: qk_clip at step %d: %s heads %s x %.4g logits", self.step, facts["layer"],
                    facts["heads"], factor)
        return facts

    # -- checkpoints -------------------------------------------------------------------------------------
    @property
    def can_save(self) -> bool:
        """There is a checkpoint manager and it can write (user checkpoints without ``save=`` cannot)."""
        return self.checkpoints is not None and bool(getattr(self.checkpoints, "can_save", True))

    def save_checkpoint(self) -> Any:
        """Save the training state through the checkpoint manager; failures are logged and counted."""
        manager = self.checkpoints
        if manager is None:
            raise ValueError("checkpoint_dir: the monitor has no checkpoints (pass checkpoint_dir= or checkpoints=)")
        return self.failsafe.call("checkpoint", lambda: manager.save(self.state.state_dict, step=self.step))

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        """Save a checkpoint (when there is a manager) and ask the loop to stop with ``exit_code`` (default
        ``stop_code``)."""
        info = self.save_checkpoint() if self.can_save else None
        if exit_code is not None:
            self.stop_code = exit_code
        self.request_stop(reason)
        facts = {"path": getattr(info, "path", None), "step": self.step, "exit_code": self.stop_code, "reason": reason}
        if self.can_save and info is None:
            where = getattr(self.checkpoints, "directory", "the checkpoint directory")
            facts["checkpoint_error"] = f"the stop checkpoint could not be written to {where} (see the log)"
            log.error("stabmon: STOPPING WITHOUT A CHECKPOINT at step %d: it could not be written to %s; resume "
                      "from the last checkpoint there, if any", self.step, where)
        log.warning("stabmon: stopping the run at step %d: %s", self.step, reason)
        return facts

    def diagnose(self, **params: Any) -> dict[str, Any]:
        """The verdict of re-running and replaying an incident's steps (:mod:`stabmon.collect.rerun`)."""
        if self.diagnoser is None:
            raise RuntimeError("diagnose: this target cannot re-run steps")
        return self.diagnoser(**params)

    # -- rollback ----------------------------------------------------------------------------------------
    def rollback(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Restore the last-known-good checkpoint and skip data; returns the audit facts. Raises when no
        checkpoint validates (the executor records the failure and the engine escalates)."""
        manager = self._manager(checkpoint_dir)
        from_step, from_position = self.step, self.cursor.position
        # a run younger than the lookback goes back to its oldest checkpoint (the initial state is saved at step 0)
        info, state = manager.last_known_good(before_step=max(0, onset_step - lookback), check=self.state.mismatch)
        self._restore(state, from_position)
        start = self.cursor.position
        # skipping needs the loop to draw its batches through monitor.steps(); a hand-written loop that
        # samples its own batches (nanoGPT's get_batch) gets no skip, and the record says so
        skip = skip_batches if self.cursor.drawing else 0
        skipped = self.cursor.skip_range(start, skip)
        if skipped:
            self.outbox.write_skipped_batches(step=self.step, batch_indices=skipped)
        unrecorded = self._record_timeline(manager, info)
        if skip:
            skipping = f"; skipping batches [{start}, {start + skip})"
        elif skip_batches:
            skipping = "; no batches skipped (the loop does not draw its batches through monitor.steps())"
        else:
            skipping = ""
        log.warning("stabmon: rolled back from step %d to checkpoint step %d (%s)%s", from_step, info.step,
                    info.path, skipping)
        facts = {
            "checkpoint_path": info.path,
            "checkpoint_step": info.step,
            "restored_step": self.step,
            "from_step": from_step,
            "skipped": [start, start + skip],
            "rewound_data": self.cursor.rewindable and self.cursor.drawing,
        }
        if skip_batches and not skip:
            facts["skip_not_applied"] = "the loop does not draw its batches through monitor.steps()"
        return facts | unrecorded

    def _manager(self, checkpoint_dir: str | None) -> Any:
        from stabmon.checkpoints import CheckpointManager

        if checkpoint_dir is not None:
            return CheckpointManager(checkpoint_dir)
        if self.checkpoints is None:
            raise RuntimeError("rollback needs checkpoints: create the Monitor with checkpoint_dir= or checkpoints=")
        if self.rank != 0:
            self.checkpoints.reload()  # rank 0 wrote the registry: read it afresh
        return self.checkpoints

    def _restore(self, state: dict[str, Any], from_position: int) -> None:
        """The checkpoint's training state, with the overrides and the skip set in force kept in force."""
        overrides = self.overrides.state_dict()
        skipped_before = set(self.cursor.skip)
        self.state.load(state, pipeline=False)
        self.overrides.load_state_dict(overrides)
        self.cursor.skip |= skipped_before
        if self.cursor.rewindable:
            self.cursor.rewind(self.cursor.position)
        else:  # a one-shot iterator cannot be rewound: the data keeps flowing forward
            self.cursor.position = from_position

    def _record_timeline(self, manager: Any, target: Any) -> dict[str, str]:
        """The rollback in the registry: later checkpoints abandoned, and the rolled-back state (skip set in
        force) saved at once on the new timeline, so a resume continues from here and not from undone
        training. Returns what could not be recorded (a read-only directory): the restore and the skip stand,
        and the rollback's record says what is missing."""
        if self.rank != 0:
            return {}
        missing = {}
        problem = manager.rolled_back(target)
        if problem is not None:
            missing["registry_not_updated"] = problem
        if manager is self.checkpoints and self.can_save and self.save_checkpoint() is None:
            missing["rolled_back_state_not_saved"] = "the checkpoint save failed (see the log)"
        return missing
