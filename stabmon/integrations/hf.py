"""Hugging Face ``transformers.Trainer`` integration: one callback (needs the ``hf`` extra).

``StabmonCallback(**monitor_kwargs)`` builds a :class:`~stabmon.monitor.Monitor` on the Trainer's model, optimizer
(unwrapped from accelerate's ``AcceleratedOptimizer``) and scheduler when training begins, and drives it:

- the loss comes from a forward hook on the model (``output.loss`` of each training forward pass; under gradient
  accumulation the mean over the micro-batches), so it stays a device tensor;
- each optimizer step is one monitor step (``on_step_begin`` .. ``on_step_end``); the monitor's optimizer hooks
  measure, clip and apply overrides as in a plain loop;
- clipping moves to the monitor: when ``args.max_grad_norm > 0`` and the monitor config has no ``clip``, the
  callback sets ``clip = args.max_grad_norm`` and ``args.max_grad_norm = 0`` so the gradients are clipped once and
  ``grad_norm`` is the pre-clip norm (the Trainer still computes its own norm for its logs);
- a checkpoint-and-stop decision sets ``control.should_training_stop``; ``callback.monitor.exit_code`` tells the
  script what to exit with.

The Trainer itself reads tensors back (its NaN filter on the loss, its logged grad norm), so the monitor's
no-sync property covers only the monitor's own work here.

>>> cb = StabmonCallback(store=None)
>>> cb.monitor is None
True
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from transformers import TrainerCallback

from stabmon.collect.config import MonitorConfig

log = logging.getLogger(__name__)


class StabmonCallback(TrainerCallback):
    """Monitor a ``transformers.Trainer`` run; see the module docstring. Keyword arguments go to Monitor."""

    def __init__(self, **monitor_kwargs: Any) -> None:
        self.kwargs = monitor_kwargs
        self.monitor: Any = None
        self._losses: list[torch.Tensor] = []
        self._handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        from stabmon.monitor import Monitor

        if self.monitor is not None:
            return
        config = self.kwargs.pop("config", None) or MonitorConfig()
        if config.clip is None and getattr(args, "max_grad_norm", 0) and args.max_grad_norm > 0:
            config = dataclasses.replace(config, clip=float(args.max_grad_norm))
            args.max_grad_norm = 0.0  # the monitor clips, once, reusing its norm
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the real one
        self.kwargs.setdefault("run_name", getattr(args, "run_name", None))
        self.monitor = Monitor(model, opt, scheduler=lr_scheduler, config=config, **self.kwargs)
        self._handle = model.register_forward_hook(self._capture_loss)

    def _capture_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self._losses = []
            self.monitor.begin_step()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self._losses:
            loss = self._losses[0] if len(self._losses) == 1 else torch.stack(self._losses).mean()
            self.monitor.observe(loss=loss)
            self._losses = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        self.monitor.end_step()
        if self.monitor.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.monitor is not None:
            self.monitor.close()
