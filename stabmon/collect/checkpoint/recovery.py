"""The live run's recovery verbs: rollback and checkpoint-and-stop, joint across ranks.

:class:`Recovery` restores the last-known-good checkpoint (rollback), saves a checkpoint and asks the loop to stop
(checkpoint-and-stop), and keeps the stop request and the follow-ups a change leaves (the rollback's and the
stop's checkpoints, written once the change is committed: :mod:`stabmon.interventions.commit`). It is built from
its collaborators (the :class:`~stabmon.collect.run_state.RunState`, the training state, the outbox, the
checkpoints); :meth:`Recovery.handle` hands its verbs to the executor in the
:class:`~stabmon.interventions.handle.Handle` every intervention acts on, and the monitor's ``rollback``,
``checkpoint_and_stop``, ``should_stop`` and ``exit_code`` are this object's.

Rollback asks the :class:`~stabmon.checkpoints.CheckpointManager` for the newest checkpoint that validates
(exists -> byte count -> loads -> finite -> fits the model and optimizer) saved at least ``lookback`` steps
before the anomaly's onset, restores the training state and step counter from it (``reason="rollback"``: the
detectors, engine, executor, alert gates and overrides are excluded and stay as they are now, the engine being
in the middle of handling the incident), and skips the
next ``skip_batches`` batches (recorded in the store). A one-shot iterator cannot be rewound: the data then keeps
flowing forward and the skip starts at the current position.

Under torch.distributed the :class:`~stabmon.collect.cluster.rank_policy.RankPolicy` says which ranks save and write the
registry, and the runbook's rollback and checkpoint-and-stop (the kill switch's too) are joint
(:mod:`stabmon.collect.cluster.joint`): rank 0 calls every rank in, the rollback restores the newest checkpoint step
every rank holds and validates, and a rank that fails or disagrees is reported as a ``rank_disagreement``
anomaly. :meth:`Recovery.rollback_here` and :meth:`Recovery.stop_here` are one rank's own (the monitor's
public methods, which every rank calls itself).

>>> import torch
>>> from stabmon.collect.failsafe import Failsafe
>>> from stabmon.collect.flushing import Outbox
>>> from stabmon.collect.checkpoint.restore import TrainingState
>>> from stabmon.collect.run_state import RunState
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> run = RunState(step=5); safe = Failsafe(run)
>>> recovery = Recovery(run, state=TrainingState({"model": model, "optimizer": opt}),
...                     outbox=Outbox(None, None, failsafe=safe, run_name="doc"), failsafe=safe, stop_code=86)
>>> recovery.checkpoint_and_stop(reason="operator")["exit_code"], recovery.should_stop, recovery.exit_code
(86, True, 86)
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from stabmon.checkpoints import CheckpointStore
from stabmon.collect.checkpoint.landing import RerunLanding
from stabmon.collect.checkpoint.restore import ROLLBACK, TrainingState
from stabmon.collect.cluster.joint import LANDING, Agreement, Joint, RankChannel, restore_agreed
from stabmon.collect.cluster.rank_policy import RankPolicy, SavePath
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Outbox
from stabmon.collect.run_state import RunState
from stabmon.diagnose.verdict import Diagnosis
from stabmon.events import Anomaly, Event, Severity
from stabmon.interventions.commit import FollowUps
from stabmon.interventions.handle import Handle, Training

STOPPED = Agreement(same=("step", "exit_code"))
"""Every rank stopped at rank 0's step with its code."""
ROLLED_BACK = Agreement(same=("checkpoint_step", "restored_step"), problems=("registry_not_updated", LANDING))
"""Every rank restored rank 0's checkpoint step, and recorded the rollback where it keeps a registry (a rank whose
checkpoint of a newer agreed step restored another step, refused on every rank, says so)."""

log = logging.getLogger(__name__)


class Recovery:
    """The live run's rollback and checkpoint-and-stop; see the module docstring."""

    def __init__(
        self,
        run: RunState,
        *,
        state: TrainingState,
        outbox: Outbox,
        failsafe: Failsafe,
        stop_code: int,
        checkpoints: CheckpointStore | None = None,
        policy: RankPolicy | None = None,
        channel: RankChannel | None = None,
        reports: deque[Event] | None = None,
        landing: RerunLanding | None = None,
    ) -> None:
        self.run = run
        self.landing = landing
        """The state a diagnosis' re-run left in this flush, which a rollback lands on first
        (:mod:`stabmon.collect.checkpoint.landing`; one process only)."""
        self.state, self.outbox, self.failsafe = state, outbox, failsafe
        self.stop_code = stop_code
        self.policy = policy if policy is not None else RankPolicy()
        """Who saves, decides and writes (:mod:`stabmon.collect.cluster.rank_policy`)."""
        self.checkpoints = checkpoints
        self.reports: deque[Event] = reports if reports is not None else deque()
        """Ranks that disagreed after a joint action, as anomalies for the next publish."""
        self._gather = channel.gather if channel is not None else _alone
        joint = partial(Joint, rank=self.policy.rank, world_size=self.policy.world_size, channel=channel,
                        report=self._disagreed)
        self._stop = joint("checkpoint_and_stop", self.stop_here, agreement=STOPPED)
        choose = self._agreed if self.policy.distributed else self._own
        self._rollback = joint("rollback", partial(self._rollback_from, choose), agreement=ROLLED_BACK)
        self.should_stop = False
        self.stop_reason: str | None = None
        self.follow_ups = FollowUps()
        """The checkpoints this flush's changes leave to write once they are committed."""

    def handle(self, *, hparams: Callable[[], dict[str, float]], diagnose: Callable[..., Diagnosis],
               loss_first: Callable[[], bool | None] = lambda: None) -> Handle:
        """What the executor passes every intervention: the run's overrides and step, ``hparams`` (the values in
        force), this object's rollback and stop, ``diagnose``, this rank's model and optimizer, the follow-ups.
        ``loss_first``: whether the loop observed its last step's loss before ``optimizer.step()``; a data screen
        acts only then, and only in one process (each rank's loss is its own: ranks would discard apart)."""
        run = self.run
        return Handle(run.overrides, clock=lambda: run.step, hparams=hparams, rollback=self.rollback,
                      checkpoint_and_stop=self.checkpoint_and_stop, diagnose=diagnose,
                      training=Training(model=self.state.model, optimizer=self.state.optimizer),
                      follow_ups=self.follow_ups,
                      screens=lambda: not self.policy.distributed and loss_first() is True)

    @property
    def checkpoints(self) -> CheckpointStore | None:
        """The :class:`~stabmon.checkpoints.CheckpointManager` or :class:`~stabmon.checkpoints.UserCheckpoints`
        (None: no checkpoints, no rollback). On a rank that does not keep the registry (a directory every rank
        shares), it reads rank 0's afresh before each use."""
        return self._checkpoints

    @checkpoints.setter
    def checkpoints(self, manager: CheckpointStore | None) -> None:
        if manager is not None:
            manager.reader = not self.policy.keeps_registry
        self._checkpoints = manager

    @property
    def step(self) -> int:
        """Optimizer steps completed (the index the next step will get)."""
        return self.run.step

    @property
    def exit_code(self) -> int:
        """0, or ``stop_code`` after a requested stop."""
        return self.stop_code if self.should_stop else 0

    def request_stop(self, reason: str | None) -> None:
        """Ask the training loop to stop at the next step boundary (no checkpoint)."""
        self.should_stop, self.stop_reason = True, reason

    @property
    def joiners(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """What a rank other than 0 runs when rank 0 calls it into a joint action."""
        return {self._stop.action: self._stop.join, self._rollback.action: self._rollback.join}

    def _disagreed(self, action: str, lines: list[str]) -> None:
        self.reports.append(Anomaly(kind="rank_disagreement", metric=f"ranks/{action}", step=self.step,
                                    score=float(len(lines)), severity=Severity.ERROR, detector="rank_policy",
                                    message=f"{action}: " + "; ".join(lines)))

    # -- checkpoints -------------------------------------------------------------------------------------
    @property
    def can_save(self) -> bool:
        """There is a checkpoint manager and it can write (user checkpoints without ``save=`` cannot)."""
        return self.checkpoints is not None and self.checkpoints.can_save

    def saves(self, path: SavePath) -> bool:
        """Whether this rank writes a checkpoint on ``path``: it can, and the rank policy lets it."""
        return self.can_save and self.policy.saves(path)

    def save_checkpoint(self, path: SavePath = SavePath.PERIODIC) -> Any:
        """Save the training state through the checkpoint manager; failures are logged and counted. None on a
        rank the policy does not let save (rank 0 saves the state they share)."""
        manager = self.checkpoints
        if manager is None:
            raise ValueError("checkpoint_dir: the monitor has no checkpoints (pass checkpoint_dir= or checkpoints=)")
        if not self.policy.saves(path):
            return None
        return self.failsafe.call("checkpoint", lambda: manager.save(self.state.state_dict, step=self.step))

    def starts_at(self, step: int) -> None:
        """This process trains from ``step`` on (its first step; a resume's state is loaded by then): checkpoints
        registered after it are of a line it does not continue and are set aside (``CheckpointStore.starts_at``),
        said in one line. Before, a fresh run in the directory of a longer one counted the other's later files
        against ``keep``, pruned its own, and its rollback found no checkpoint before the incident."""
        manager = self.checkpoints
        if manager is None or not self.policy.keeps_registry:
            return
        aside = self.failsafe.call("checkpoint", partial(manager.starts_at, step)) or []
        if aside:
            steps = sorted({e.step for e in aside})
            log.warning("stabmon: %s holds %d checkpoint(s) after step %d (steps %d-%d) of a line this run does "
                        "not continue (an earlier run in this directory, or the steps after the checkpoint it "
                        "resumed from): set aside, never restored, not deleted", manager.directory, len(aside),
                        step, steps[0], steps[-1])

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        """Save a checkpoint (when there is a manager) and ask the loop to stop with ``exit_code`` (default
        ``stop_code``); under torch.distributed on every rank together, from rank 0's decision."""
        return self._stop(reason=reason, exit_code=exit_code)

    def stop_here(self, *, reason: str | None, exit_code: int | None = None) -> dict[str, Any]:
        """:meth:`checkpoint_and_stop` on this rank alone. The checkpoint (where the rank policy lets this rank
        save) is a follow-up: written once the stop is committed, so that it holds the decision to stop."""
        if self.saves(SavePath.STOP):
            self.follow_ups.add("checkpoint_and_stop", self._save_stop)
        if exit_code is not None:
            self.stop_code = exit_code
        self.request_stop(reason)
        log.warning("stabmon: stopping the run at step %d: %s", self.step, reason)
        return {"path": None, "step": self.step, "exit_code": self.stop_code, "reason": reason}

    def _save_stop(self) -> dict[str, Any]:
        info = self.save_checkpoint(SavePath.STOP)
        if info is not None:
            return {"path": info.path}
        where = self.checkpoints.directory if self.checkpoints is not None else "the checkpoint directory"
        log.error("stabmon: STOPPING WITHOUT A CHECKPOINT at step %d: it could not be written to %s; resume "
                  "from the last checkpoint there, if any", self.step, where)
        return {"checkpoint_error": f"the stop checkpoint could not be written to {where} (see the log)"}

    def commit_now(self, facts: dict[str, Any]) -> dict[str, Any]:
        """``facts`` of a change made outside a flush (the monitor's public ``rollback`` and
        ``checkpoint_and_stop``), with what its follow-ups add once they are done."""
        for found in self.follow_ups.run().values():
            facts.update(found)
        return facts

    # -- rollback ----------------------------------------------------------------------------------------
    def rollback(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Restore the last-known-good checkpoint and skip data; returns the audit facts. Raises when no
        checkpoint validates (the executor records the failure and the engine escalates). Under
        torch.distributed every rank together, on the newest checkpoint step every rank holds and validates."""
        return self._rollback(onset_step=onset_step, lookback=lookback, skip_batches=skip_batches,
                              checkpoint_dir=checkpoint_dir)

    def rollback_here(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """:meth:`rollback` on this rank alone, to its own last-known-good checkpoint."""
        return self._rollback_from(self._own, onset_step=onset_step, lookback=lookback, skip_batches=skip_batches,
                                   checkpoint_dir=checkpoint_dir)

    def _own(self, manager: CheckpointStore, before_step: int, restore: Callable[[dict[str, Any]], int]
             ) -> tuple[Any, dict[str, Any]]:
        if self.landing is not None:  # a diagnosis' re-run left the state after the steps that reproduced
            newest = next(iter(manager.candidates(before_step)), None)
            landed = self.landing.take(before_step, newest=newest.step if newest is not None else None,
                                       check=self.state.mismatch)
            if landed is not None:
                restore(landed.state)
                return landed.info, {"landed_on_rerun": [landed.start, landed.info.step]}
        info, state = manager.last_known_good(before_step=before_step, check=self.state.mismatch)
        restore(state)
        return info, {}

    def _agreed(self, manager: CheckpointStore, before_step: int, restore: Callable[[dict[str, Any]], int]
                ) -> tuple[Any, dict[str, Any]]:
        return restore_agreed(manager, before_step, rank=self.policy.rank, check=self.state.mismatch,
                              gather=self._gather, restore=restore, keep=self._keep)

    def _keep(self) -> Callable[[], int]:
        """What puts this rank's training state back as it is now (a rollback every rank refused together): a
        copy of it, the optimizer's state by reference (a load builds that anew and leaves these tensors as
        they are), so one copy of the weights is held while the ranks agree."""
        now = self.state.state_dict()
        saved = {name: value if name == "optimizer" else copy.deepcopy(value) for name, value in now.items()}
        return partial(self._restore, saved, self.run.cursor.position)

    def _rollback_from(
        self, choose: Callable[[Any, int, Callable[[dict[str, Any]], int]], tuple[Any, dict[str, Any]]], *,
        onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None,
    ) -> dict[str, Any]:
        manager = self._manager(checkpoint_dir)
        from_step, from_position = self.step, self.run.cursor.position
        # a run younger than the lookback goes back to its oldest checkpoint (the initial state is saved at step 0)
        land = partial(self._restore, from_position=from_position)  # returns the step it restored
        info, landing = choose(manager, max(0, onset_step - lookback), land)
        start = self.run.cursor.position
        # skipping needs the loop to draw its batches through monitor.steps(); a hand-written loop that
        # samples its own batches (nanoGPT's get_batch) gets no skip, and the record says so
        skip = skip_batches if self.run.cursor.drawing else 0
        skipped = self.run.cursor.skip_range(start, skip)
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
            "rewound_data": self.run.cursor.rewindable and self.run.cursor.drawing,
        }
        if skip_batches and not skip:
            facts["skip_not_applied"] = "the loop does not draw its batches through monitor.steps()"
        return facts | unrecorded | landing

    def _manager(self, checkpoint_dir: str | None) -> Any:
        from stabmon.checkpoints import CheckpointManager

        if checkpoint_dir is not None:
            return CheckpointManager(checkpoint_dir)
        if self.checkpoints is None:
            raise RuntimeError("rollback needs checkpoints: create the Monitor with checkpoint_dir= or checkpoints=")
        return self.checkpoints

    def _restore(self, state: dict[str, Any], from_position: int) -> int:
        """The checkpoint's training state (the overrides in force are excluded), the skip set in force kept;
        returns the step restored."""
        skipped_before = set(self.run.cursor.skip)
        self.state.load(state, reason=ROLLBACK)
        self.run.cursor.skip |= skipped_before
        if self.run.cursor.rewindable:
            self.run.cursor.rewind(self.run.cursor.position)
        else:  # a one-shot iterator cannot be rewound: the data keeps flowing forward
            self.run.cursor.position = from_position
        return self.step

    def _record_timeline(self, manager: CheckpointStore, target: Any) -> dict[str, str]:
        """The rollback in the registry: later checkpoints abandoned; and, once the rollback is committed (its
        learning-rate change made, the executor and the engine told), the rolled-back state saved at once on
        the new timeline (a follow-up), so a resume continues from here and not from undone training, with the
        change in force. Returns what could not be recorded (a read-only directory): the restore and the skip
        stand, and the rollback's record says what is missing."""
        own = manager is self.checkpoints
        if not (self.policy.keeps_registry if own else self.policy.leader):
            return {}
        missing = {}
        problem = manager.rolled_back(target)
        if problem is not None:
            missing["registry_not_updated"] = problem
        if own and self.saves(SavePath.ROLLBACK):
            self.follow_ups.add("rollback", self._save_timeline)
        return missing

    def _save_timeline(self) -> dict[str, Any]:
        info = self.save_checkpoint(SavePath.ROLLBACK)
        if info is None:
            return {"rolled_back_state_not_saved": "the checkpoint save failed (see the log)"}
        return {"rolled_back_state": info.path}


def _alone(value: Any) -> list[Any]:
    """One process's gather: its own value."""
    return [value]
