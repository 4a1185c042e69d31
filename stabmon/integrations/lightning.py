"""PyTorch Lightning integration: one callback (needs the ``lightning`` extra).

``L.Trainer(callbacks=[StabmonCallback(store=..., runbook=...)]).fit(module, loader)``

What the callback does at each Lightning hook:

- ``__init__``: checks its arguments (store URL, runbook, mode, config, alerts) and opens the store, so a
  mistake is one ``ValueError`` before ``fit`` starts.
- ``on_fit_start``: builds a :class:`~stabmon.monitor.Monitor` on the LightningModule, its one optimizer,
  scheduler and the precision plugin's GradScaler; takes over gradient clipping (below); on a resume, loads
  the monitor state Lightning restored from the checkpoint and continues the same run in the store.
- ``on_train_batch_start`` opens the monitor's record of an optimizer step, ``on_train_batch_end`` closes it
  once the optimizer has stepped (with ``accumulate_grad_batches=k``, one record per k batches); the record's
  ``batch_index`` is Lightning's ``batch_idx``.
- the batch: ``on_train_batch_start`` hands each micro-batch to the monitor (references: nothing is copied), so a
  runbook's ``diagnose`` rung can replay and re-run the step (its loss: the module's ``training_step`` on each
  micro-batch, divided by their number as Lightning does, :func:`training_step_loss`; its ``self.log`` calls are
  dropped while a diagnosis runs).
- a rollback (``checkpoint_dir=``): the monitor restores module, optimizer, scheduler and its own state from its
  last-known-good checkpoint in place; Lightning's ``global_step``, data position and logs go on counting
  (:class:`~stabmon.spec.Loop`), and the record names the step the weights came from (``checkpoint_step``).
- the loss: ``on_before_backward`` receives each micro-batch's loss tensor (Lightning has already divided it by
  ``accumulate_grad_batches``); their sum goes to the monitor as a device tensor, before the optimizer step
  (``outputs["loss"]`` in ``on_train_batch_end`` arrives after the GradScaler update, too late for the scale).
- ``on_train_batch_end`` also logs ``stabmon/lr``, the learning rate in force (the monitor's overrides
  applied), to Lightning's loggers: ``LearningRateMonitor`` logs the schedule's value.
- ``on_before_optimizer_step`` runs the monitor's pre-step work: norms, clip, overrides. Lightning calls
  ``optimizer.step(closure)`` and the closure runs forward and backward *inside* ``step()``, so a
  ``torch.optim`` step pre-hook would fire before backward, on the previous step's gradients. The callback
  therefore takes the monitor's optimizer hooks off (``Monitor.remove_optimizer_hooks``) and calls
  ``Monitor.before_optimizer_step`` from this hook (after backward, after AMP unscaling, before Lightning's
  own clipping) and ``Monitor.after_optimizer_step`` from a real step post-hook. When the GradScaler skips an
  overflow step, the post work (restoring the scheduler-visible hyper-parameters) is done at batch end.
- ``state_dict`` / ``load_state_dict``: the monitor state travels in Lightning checkpoints (as bytes, so
  checkpoints still load with ``weights_only=True``).
- checkpoint-and-stop: when the monitor asks to stop, ``trainer.save_checkpoint`` writes
  ``stabmon-stop-step=N.ckpt`` (in ``stop_checkpoint_dir``, default ``trainer.default_root_dir``) and
  ``trainer.should_stop`` ends the fit; :attr:`StabmonCallback.exit_code` is then the monitor's stop code.
- ``on_fit_end`` / ``on_exception``: close the monitor (status ``finished``/``stopped`` or ``failed``) and the
  store, and give ``trainer.gradient_clip_val`` back.

Clipping happens once, in the monitor: with ``gradient_clip_val`` set and the norm algorithm, the monitor
clips at that value (an explicit ``config.clip`` wins) and Lightning's clip is switched off during ``fit``.
With ``gradient_clip_algorithm="value"`` Lightning keeps clipping by value, after the monitor has measured.

>>> cb = StabmonCallback(store=None)
>>> cb.monitor is None, cb.exit_code
(True, 0)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from stabmon.integrations._shared import MonitorFactory, OutsideSteps, state_from_bytes, state_to_bytes
from stabmon.spec import MonitorSpec, spec_of

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the standalone package, or no extra at all
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]
    except ImportError:
        Callback = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

__all__ = ["StabmonCallback", "StepBatches", "training_step_loss"]


class StepBatches(list):  # type: ignore[type-arg]
    """One optimizer step's micro-batches as Lightning gave them: ``(batch_idx, batch)`` pairs."""


def training_step_loss(module: Any, batch: Any) -> torch.Tensor:
    """The loss of a step's :class:`StepBatches` as Lightning trained it: each micro-batch's ``training_step`` loss
    (its ``"loss"`` when it returns a mapping) divided by their number, summed (``diagnose``'s ``loss_fn``).
    ``self.log`` and ``self.log_dict`` are dropped meanwhile, so a diagnosis logs nothing of its own.

    >>> class M(torch.nn.Module):
    ...     def training_step(self, batch, idx):
    ...         self.log("loss", 0.0)
    ...         return {"loss": batch.sum()}
    ...     def log(self, *a, **k): raise AssertionError("logged")
    >>> float(training_step_loss(M(), StepBatches([(0, torch.ones(2)), (1, 3 * torch.ones(2))])))
    4.0
    """
    from stabmon.diagnose.experiments import call_model

    if not isinstance(batch, StepBatches):
        return call_model(module, batch)
    module.log = module.log_dict = _quiet
    try:
        losses = []
        for idx, micro in batch:
            out = module.training_step(micro, idx)
            loss = out["loss"] if isinstance(out, dict) else out
            losses.append(loss.reshape(()))
        return torch.stack(losses).sum() / len(losses)
    finally:
        del module.log, module.log_dict


def _quiet(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while a diagnosis runs the module's ``training_step``: nothing is logged."""


class StabmonCallback(Callback):
    """Monitor a Lightning ``Trainer.fit``; see the module docstring.

    Keyword arguments are the fields of :class:`~stabmon.spec.MonitorSpec` (or pass ``spec=``), checked here,
    before training; plus
    ``stop_checkpoint_dir`` for the checkpoint written on checkpoint-and-stop.

    >>> from stabmon.collect.config import MonitorConfig
    >>> cb = StabmonCallback(store=None, config=MonitorConfig(clip=1.0))
    >>> cb.spec.config.clip
    1.0
    """

    def __init__(
        self, *, stop_checkpoint_dir: str | None = None, spec: MonitorSpec | None = None, **options: Any
    ) -> None:
        self.spec = spec_of(spec, options)
        self.monitors = MonitorFactory(self.spec)
        self.stop_checkpoint_dir = stop_checkpoint_dir
        self.monitor: Any = None
        self.stop_requested = False
        self.stop_checkpoint: str | None = None
        self._pending: dict[str, Any] | None = None
        self._saved_clip: Any = None
        self._took_clip = False
        self._post_handle: Any = None
        self._losses: list[torch.Tensor] = []
        self._batches = StepBatches()  # this step's micro-batches, handed to the monitor
        self._attempted = False  # on_before_optimizer_step ran in this batch
        self._post_pending = False  # ... and the step post-hook has not run yet
        self._outside = OutsideSteps()  # validation between the steps, for the hang watchdog

    @property
    def exit_code(self) -> int:
        """0, or the monitor's stop code (86 by default) after checkpoint-and-stop / kill switch."""
        return self.monitor.exit_code if self.monitor is not None else 0

    # -- lifecycle ---------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise ValueError(
                f"StabmonCallback: watches exactly one optimizer; the module configures {len(optimizers)}"
            )
        optimizer = optimizers[0]
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        clip = self._take_over_clip(trainer)
        pending, self._pending = self._pending, None
        self.monitor = self.monitors.build(
            pl_module,
            optimizer,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            scheduler=configs[0].scheduler if configs else None,
            clip=clip,
            framework="lightning",
            defaults={"loss_fn": training_step_loss},
            changes={"resume_run_id": (pending or {}).get("run_id")},
        )
        if pending is not None:
            self.monitor.load_state_dict(pending)
        self.monitor.sync_step(trainer.global_step)
        # Lightning runs backward inside optimizer.step(closure): the pre-step work moves to
        # on_before_optimizer_step, the post-step work stays a real step post-hook.
        self.monitor.remove_optimizer_hooks()
        self._post_handle = optimizer.register_step_post_hook(self._after_step)
        self.stop_requested, self.stop_checkpoint = False, None

    def _take_over_clip(self, trainer: Any) -> float | None:
        value = trainer.gradient_clip_val
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm))
        if not value or algorithm not in ("None", "norm"):
            return None
        self._saved_clip, self._took_clip = value, True
        trainer.gradient_clip_val = None  # the monitor clips; Lightning must not clip a second time
        return float(value)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close(trainer, status=None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.buffer.discard()  # the step that crashed never finished: no record for it
        self._close(trainer, status="failed")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Validation is outside the steps: the hang watchdog gives it the cap, and does not learn its time."""
        self._outside.begin(self.monitor, "validation")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._outside.end("validation")

    def _close(self, trainer: Any, status: str | None) -> None:
        self._outside.end_all()
        if self._post_handle is not None:
            self._post_handle.remove()
            self._post_handle = None
        if self._took_clip:
            trainer.gradient_clip_val, self._took_clip = self._saved_clip, False
        if self.monitor is not None:
            self.monitor.close(status=status)
        self.monitors.close_store()

    # -- steps -------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None:
            return
        if not self.monitor.buffer.open:
            self.monitor.sync_step(trainer.global_step)
            self.monitor.begin_step(batch_index=batch_idx)
            self._losses, self._batches = [], StepBatches()
        self._batches.append((batch_idx, batch))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.monitor is None or not pl_module.training or loss.numel() != 1:
            return
        loss = loss.detach().reshape(())
        scaler = self.monitor.scaler
        scale = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
        if isinstance(scale, torch.Tensor):  # MixedPrecision hands this hook the scaled loss
            loss = loss.float() / scale.reshape(())
        self._losses.append(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is None:
            return
        loss = None
        if self._losses:
            loss = self._losses[0] if len(self._losses) == 1 else torch.stack(self._losses).sum()
        self.monitor.observe(loss=loss)
        if self._batches:
            self.monitor.hand_batch(self._batches)
        self._losses, self._batches = [], StepBatches()
        self.monitor.before_optimizer_step()
        self._attempted = self._post_pending = True

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._post_pending:
            self._post_pending = False
            self.monitor.after_optimizer_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None or not self._attempted:
            return  # still accumulating gradients: the optimizer step (and so the record) is not done
        self._attempted = False
        if self._post_pending:  # the GradScaler skipped an overflow step: undo the pre-step changes
            self._post_pending = False
            self.monitor.after_optimizer_step(skipped=True)
        self.monitor.end_step()
        self._log_lr_in_force(pl_module)
        if self.monitor.should_stop and not self.stop_requested:
            self._stop(trainer)

    def _log_lr_in_force(self, pl_module: Any) -> None:
        """Report the learning rate in force, the monitor's overrides applied, to Lightning's loggers as
        ``stabmon/lr``: ``LearningRateMonitor`` reads the optimizer's param groups, which hold the schedule's
        value between steps (the monitor applies an LR cap or scale around ``optimizer.step()``). A host float."""
        lr = self.monitor.hparams().get("lr")
        if lr is not None:
            pl_module.log("stabmon/lr", float(lr), on_step=True, on_epoch=False)

    def _stop(self, trainer: Any) -> None:
        self.stop_requested = True
        folder = self.stop_checkpoint_dir or trainer.default_root_dir
        path = os.path.join(folder, f"stabmon-stop-step={trainer.global_step}.ckpt")
        try:
            trainer.save_checkpoint(path)
            self.stop_checkpoint = path
        except Exception:  # noqa: BLE001 - the run stops either way; the failure is on the record
            self.monitor.errors["checkpoint"] += 1
            log.exception("stabmon: could not save the stop checkpoint %s", path)
        trainer.should_stop = True
        log.warning("stabmon: stopping Lightning at step %d: %s", trainer.global_step, self.monitor.stop_reason)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.monitor is None:
            return {}
        self.monitor.flush()  # the detector state then covers every step the checkpoint covers
        return {"monitor": state_to_bytes(self.monitor.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        data = state_dict.get("monitor")
        if not data:
            return
        state = state_from_bytes(data)
        if self.monitor is None:
            self._pending = state  # the usual order: callbacks are restored before on_fit_start
        else:  # strategies that restore after setup
            self.monitor.load_state_dict(state)
