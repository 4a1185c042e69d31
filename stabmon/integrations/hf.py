"""Hugging Face ``transformers.Trainer`` integration: one callback (needs the ``hf`` extra).

``Trainer(model, args, train_dataset=ds, callbacks=[StabmonCallback(store=..., runbook=...)])``

What the callback does at each Trainer event:

- ``__init__``: checks its arguments (store URL, runbook, mode, config, alerts) and opens the store, so a
  mistake is one ``ValueError`` before the Trainer even exists.
- ``on_train_begin``: builds a :class:`~stabmon.monitor.Monitor` on the Trainer's model, its optimizer
  (unwrapped from accelerate's ``AcceleratedOptimizer``), scheduler and GradScaler; takes over gradient
  clipping (below); on a resume, reloads the monitor state saved in the checkpoint and continues the same run
  in the store.
- each optimizer step is one monitor step (``on_step_begin`` .. ``on_step_end``; with gradient accumulation,
  one record per optimizer step), numbered as the Trainer numbers it: the step that takes ``state.global_step``
  from N-1 to N is recorded at step N, the step at which the Trainer logs its ``loss`` and ``grad_norm``
  (so the first step is 1). The monitor's optimizer hooks measure, clip and apply overrides as in a plain loop.
- the loss: a forward hook on the model keeps ``output.loss`` of each training forward as a detached device
  tensor (no ``.item()``); ``on_pre_optimizer_step`` hands their mean to the monitor (their sum when the Trainer
  passed ``num_items_in_batch``, because the model then normalised by the whole accumulated batch). A custom
  ``compute_loss`` whose model returns no loss can call :meth:`StabmonCallback.observe_loss`.
- the batch: the same forward hook keeps each training forward's keyword arguments (the Trainer's prepared inputs,
  references: nothing is copied) and ``on_pre_optimizer_step`` hands the step's micro-batches to the monitor
  (:class:`MicroBatches`), so a runbook's ``diagnose`` rung can replay and re-run them (their loss: the micro-batch
  losses summed or averaged as the Trainer did, :func:`micro_batches_loss`).
- fp16 overflow: a step the loss scaler skipped (accelerate's ``optimizer.step_was_skipped``: a GradScaler's,
  or a DeepSpeed engine's own loss scaling) is recorded with ``overflow = 1``, so the ``inf``/``nan`` grad norm
  of a routine backoff is not an anomaly; a collapsing scale is still one (the loss-scale detector).
- ``on_save``: flushes the monitor and writes its state (:data:`STATE_FILE`, plain values and tensors: it loads
  with ``torch.load(weights_only=True)``) into the Trainer's ``checkpoint-N`` folder; a resume with
  ``Trainer.train(resume_from_checkpoint=...)`` loads it back (overrides, detectors, engine, executor).
- a rollback (``checkpoint_dir=``): the monitor restores model, optimizer, scheduler and its own state from its
  last-known-good checkpoint in place; the Trainer's ``global_step``, data position and logs go on counting
  (:class:`~stabmon.spec.Loop`), and the record names the step the weights came from (``checkpoint_step``).
- checkpoint-and-stop (a runbook decision or the kill switch): ``control.should_save`` and
  ``control.should_training_stop`` are set, so the Trainer writes a checkpoint (monitor state included) and
  ends; :attr:`StabmonCallback.exit_code` is then the monitor's stop code.
- the Trainer's logged ``learning_rate`` is the LR in force: the scheduler's ``get_last_lr()`` reports the
  monitor's overrides applied from ``on_optimizer_step`` (right after it the Trainer reads the LR it logs) to
  ``on_step_end`` (:class:`~stabmon.integrations._shared.EffectiveLR`: a plain list of numbers, never a patched
  method, so the scheduler's ``state_dict`` stays savable), and an LR cut or cap shows in the Trainer's logs,
  TensorBoard and W&B, not only in stabmon's store.
- ``on_train_end``: closes the monitor and the store and gives ``args.max_grad_norm`` back (and the
  scheduler's own ``get_last_lr``).

Clipping happens once, in the monitor. The Trainer clips in ``_clip_grad_norm`` between backward and
``on_pre_optimizer_step``, before any callback could see the pre-clip gradients, so letting it clip would leave
the monitor measuring already-clipped norms (spikes hidden under ``max_grad_norm``). The callback therefore sets
``args.max_grad_norm = 0`` for the duration of ``train()`` and clips in the monitor's optimizer pre-step hook at
the Trainer's value (an explicit ``config.clip`` wins), reusing the one fused norm the monitor computes anyway.
The Trainer (transformers 5.x) still computes a norm of its own for its logs (``clip_grad_norm_`` with an
infinite max_norm), and reads tensors back itself (the NaN filter on the loss, logged values), so the
monitor's no-sync property covers only the monitor's own work here.

>>> cb = StabmonCallback(store=None)
>>> cb.monitor is None, cb.exit_code
(True, 0)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from stabmon.integrations._shared import EffectiveLR, MonitorFactory, OutsideSteps
from stabmon.replay.importers.hf_trainer import eval_names
from stabmon.spec import MonitorSpec, spec_of

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - without the ``hf`` extra the class still imports (docs, doctests)
    TrainerCallback = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

STATE_FILE = "stabmon_monitor.pt"
"""File name of the monitor state inside a Trainer ``checkpoint-N`` folder."""

__all__ = ["STATE_FILE", "MicroBatches", "StabmonCallback", "micro_batches_loss"]


class MicroBatches(list):  # type: ignore[type-arg]
    """One optimizer step's micro-batches: the keyword arguments of each training forward, as the Trainer called
    the model. ``summed``: the Trainer passed ``num_items_in_batch`` (each micro-batch's loss is already a share
    of the step's, and they add up); else the step's loss is their mean."""

    def __init__(self, inputs: list[dict[str, Any]], *, summed: bool) -> None:
        super().__init__(inputs)
        self.summed = summed


def micro_batches_loss(model: Any, batch: Any) -> torch.Tensor:
    """The loss of a step's :class:`MicroBatches` as the Trainer trained it (``diagnose``'s ``loss_fn``; any
    other batch: the model's own output, :func:`~stabmon.diagnose.experiments.call_model`).

    >>> lin = torch.nn.Linear(1, 1, bias=False); _ = lin.weight.data.fill_(2.0)
    >>> model = lambda x, **kw: lin(x).sum()
    >>> batch = MicroBatches([{"x": torch.ones(1, 1)}, {"x": 3 * torch.ones(1, 1)}], summed=False)
    >>> float(micro_batches_loss(model, batch).detach())
    4.0
    """
    from stabmon.diagnose.experiments import call_model

    if not isinstance(batch, MicroBatches):
        return call_model(model, batch)
    losses = torch.stack([call_model(model, inputs).reshape(()) for inputs in batch])
    return losses.sum() if batch.summed else losses.mean()


def trainer_step(state: Any) -> int:
    """The number the Trainer gives the optimizer step about to run: ``global_step`` counts the steps done,
    and the Trainer logs a step's values under the count after it (``state.global_step + 1``).

    >>> from types import SimpleNamespace
    >>> trainer_step(SimpleNamespace(global_step=0))
    1
    """
    return int(state.global_step) + 1


class StabmonCallback(TrainerCallback):
    """Monitor a ``transformers.Trainer`` run; see the module docstring.

    Keyword arguments are the fields of :class:`~stabmon.spec.MonitorSpec` (or pass ``spec=``), checked here,
    before training; plus
    ``resume_from``: a checkpoint folder to take monitor state from when it is not
    ``<output_dir>/checkpoint-<global_step>`` (the folder ``Trainer.train(resume_from_checkpoint=...)`` uses
    for checkpoints it wrote itself).

    >>> from stabmon.collect.config import MonitorConfig
    >>> cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=5))
    >>> cb.spec.config.flush_every
    5
    """

    def __init__(
        self, *, resume_from: str | None = None, spec: MonitorSpec | None = None, **options: Any
    ) -> None:
        self.spec = spec_of(spec, options)
        self.monitors = MonitorFactory(self.spec)
        self.resume_from = resume_from
        self.monitor: Any = None
        self.stop_requested = False
        self._saved_max_grad_norm: float | None = None
        self._hook: Any = None
        self._losses: list[torch.Tensor] = []
        self._inputs: list[dict[str, Any]] = []  # this step's training forwards' keyword arguments
        self._loss_sum = False
        self._warned_no_loss = False
        self._pending_eval: dict[str, float] = {}  # the last evaluation's metrics, recorded with the next step
        self._effective_lr: EffectiveLR | None = None
        self._outside = OutsideSteps()  # the Trainer's evaluation and checkpoint after a step, for the hang watchdog

    @property
    def exit_code(self) -> int:
        """0, or the monitor's stop code (86 by default) after checkpoint-and-stop / kill switch."""
        return self.monitor.exit_code if self.monitor is not None else 0

    # -- lifecycle ---------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise ValueError("StabmonCallback: the Trainer passed no model/optimizer to on_train_begin")
        if self.monitor is not None:  # a previous train() raised: the Trainer has no exception event
            self._finish(args, status="failed")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        clip = None
        if args.max_grad_norm and args.max_grad_norm > 0:
            clip, self._saved_max_grad_norm = float(args.max_grad_norm), float(args.max_grad_norm)
            args.max_grad_norm = 0.0  # the monitor clips; the Trainer must not clip a second time
        saved = self._load_saved_state(args, state)
        self.monitor = self.monitors.build(
            model,
            inner,
            scaler=getattr(optimizer, "scaler", None),
            scheduler=kwargs.get("lr_scheduler"),
            clip=clip,
            framework="hf",
            defaults={"run_name": getattr(args, "run_name", None), "loss_fn": micro_batches_loss},
            # the TrainingArguments as the recipe: stabmon diff names the ones two runs differ in
            changes={"resume_run_id": (saved or {}).get("run_id"), "recipe": args.to_dict()},
        )
        if saved is not None:
            self.monitor.load_state_dict(saved)
        self._effective_lr = self._report_effective_lr(kwargs.get("lr_scheduler"))
        self.monitor.sync_step(trainer_step(state))
        self.stop_requested = False
        self._hook = model.register_forward_hook(self._capture_loss, with_kwargs=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish(args, status=None)

    def _report_effective_lr(self, scheduler: Any) -> EffectiveLR | None:
        """The Trainer logs ``learning_rate`` from ``lr_scheduler.get_last_lr()``, read right after the optimizer
        step: make it the LR in force from :meth:`on_optimizer_step` to :meth:`on_step_end`."""
        if scheduler is None:
            return None
        monitor = self.monitor
        return EffectiveLR(scheduler, lambda: monitor.overrides)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._effective_lr is not None:
            self._effective_lr.install()

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._effective_lr is not None:
            self._effective_lr.remove()

    def _finish(self, args: Any, status: str | None) -> None:
        self._outside.end_all()
        if self._effective_lr is not None:
            self._effective_lr.remove()
            self._effective_lr = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._saved_max_grad_norm is not None:
            args.max_grad_norm, self._saved_max_grad_norm = self._saved_max_grad_norm, None
        if self.monitor is not None:
            if status == "failed":
                self.monitor.buffer.discard()  # the step that crashed never finished: no record for it
            self.monitor.close(status=status)  # idempotent: a closed monitor stays as it ended
        self.monitors.close_store()

    # -- steps -------------------------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        self._outside.end_all()  # whatever the Trainer did between the steps is over
        self.monitor.sync_step(trainer_step(state))
        self.monitor.begin_step(batch_index=state.global_step * args.gradient_accumulation_steps)
        self._losses, self._inputs = [], []

    def _capture_loss(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not module.training:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()))
            self._loss_sum = kwargs.get("num_items_in_batch") is not None
            if not args:  # the Trainer calls model(**inputs): these are the micro-batch, as the model saw it
                self._inputs.append(dict(kwargs))

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Hand one micro-batch's loss in yourself (a custom ``compute_loss`` whose model returns no loss)."""
        self._losses.append(loss.detach().reshape(()))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        loss = None
        if len(self._losses) == 1:
            loss = self._losses[0]
        elif self._losses:
            stacked = torch.stack(self._losses)
            loss = stacked.sum() if self._loss_sum else stacked.mean()
        elif not self._warned_no_loss:
            self._warned_no_loss = True
            log.warning(
                "stabmon: the model returned no 'loss' in training forwards; call "
                "StabmonCallback.observe_loss(loss) from your compute_loss to record it"
            )
        # before optimizer.step(): the GradScaler's scale is this step's. The epoch and the last evaluation are
        # host floats the Trainer already has (no read-back); named as the trainer_state.json importer names them
        extra = {"epoch": float(state.epoch)} if state.epoch is not None else {}
        self.monitor.observe(loss=loss, **extra, **self._pending_eval)
        if self._inputs:
            self.monitor.hand_batch(MicroBatches(self._inputs, summed=self._loss_sum))
        self._losses, self._inputs, self._pending_eval = [], [], {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        if getattr(kwargs.get("optimizer"), "step_was_skipped", False) is True:
            self.monitor.after_optimizer_step(skipped=True)  # the loss scaler skipped it: an overflow step
        if self._effective_lr is not None:
            self._effective_lr.remove()  # before any checkpoint of this step is written
        self.monitor.end_step()
        if self.monitor.should_stop and not self.stop_requested:
            self.stop_requested = True
            control.should_save = True  # checkpoint (with monitor state, through on_save) ...
            control.should_training_stop = True  # ... then stop
            log.warning(
                "stabmon: stopping the Trainer at step %d: %s", state.global_step, self.monitor.stop_reason
            )
        # what the Trainer does next is outside the steps (its flow callback decided it before this one ran)
        if control.should_evaluate:
            self._outside.begin(self.monitor, "evaluation")
        if control.should_save:
            self._outside.begin(self.monitor, "checkpoint")

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                    **kwargs: Any) -> None:
        """Keep the evaluation's numbers (``eval_loss`` as ``val_loss``, the other ``eval_*`` under their own
        names, as in an imported ``trainer_state.json``); the Trainer evaluates after a step has ended, so they
        are recorded with the next step (an evaluation after the last step is not recorded)."""
        self._outside.end("evaluation")
        if self.monitor is None or not metrics:
            return
        for key, name in eval_names(metrics).items():
            value = metrics[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._pending_eval[name] = float(value)

    # -- checkpoints -------------------------------------------------------------------------------------
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._outside.end("checkpoint")
        if self.monitor is None or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        try:
            self.monitor.flush()  # the detector state then covers every step the checkpoint covers
            torch.save(self.monitor.state_dict(), os.path.join(folder, STATE_FILE))
        except Exception:  # noqa: BLE001 - a failed save must not end training
            self.monitor.errors["checkpoint"] += 1
            log.exception("stabmon: could not save monitor state into %s", folder)

    def _load_saved_state(self, args: Any, state: Any) -> dict[str, Any] | None:
        folder = self.resume_from
        if folder is None:
            if state.global_step <= 0:
                return None
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            log.warning(
                "stabmon: resuming at step %d without monitor state (%s not found); detectors start fresh",
                state.global_step,
                path,
            )
            return None
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception:  # noqa: BLE001 - a damaged state file costs the detector history, not the run
            log.exception("stabmon: could not load monitor state from %s; detectors start fresh", path)
            return None
