"""The conformance matrix on the real frameworks: ``transformers.Trainer`` (its default scheduler, and a custom
``LambdaLR``) with the documented ``StabmonCallback``, and Lightning's ``Trainer`` with its callback. Every action
a shipped runbook uses, forced by an injected fault, then each event: the run goes on, a crash and a resume from
the framework's newest checkpoint, Ctrl-C and a resume. The framework counts the steps: a rollback restores the
training state in place while the count goes on. See tests/conformance_support.py for the invariants."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_support import ACTIONS, EVENTS, FAULT_SCALE, FAULT_STEPS, Invariants, forced_runbook, live_state

from stabmon.collect.config import AttentionConfig, MonitorConfig

STEPS = 100
STOP_AT = 63
SAVE_EVERY = 10
SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))


class Crash(RuntimeError):
    """The loop's own failure (a node lost): the run ends, and is resumed from the framework's checkpoint."""


def _config() -> MonitorConfig:
    return MonitorConfig(flush_every=5, checkpoint_every=10, attention=AttentionConfig(every=5))


def _newest(folder: Path, prefix: str) -> Path:
    found = sorted(folder.glob(f"{prefix}*"), key=lambda p: int("".join(c for c in p.name if c.isdigit()) or 0))
    assert found, f"no {prefix}* in {folder}"
    return found[-1]


def _files(folder: Path) -> list[str]:
    return [str(p) for p in sorted(folder.glob("*.pt"))]


# -- transformers.Trainer -----------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 32, 16


def _gpt(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _rows(n: int = 1024) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = (torch.arange(SEQ) * 3 + int(torch.randint(0, VOCAB, (1,), generator=g))) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class _Fault(transformers.TrainerCallback):
    """The matrix's fault in a Trainer: the model's loss x1,000 on three steps, the first time each comes (a forward
    hook registered before the callback's own, so the monitor records the loss that trained)."""

    def __init__(self, model: Any, done: set[int]) -> None:
        self.done, self.step = done, -1
        model.register_forward_hook(self._scale)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.step = int(state.global_step) + 1

    def _scale(self, module: Any, args: Any, output: Any) -> Any:
        if module.training and self.step in FAULT_STEPS and self.step not in self.done:
            self.done.add(self.step)
            output.loss = output.loss * FAULT_SCALE
        return output


class _Probe(transformers.TrainerCallback):
    """The live state the run goes on from at each Trainer checkpoint (after the callback wrote its state), and
    at the first step of a resumed run; the crash or Ctrl-C of the cell."""

    def __init__(self, callback: Any, event: str | None, sched: str) -> None:
        self.callback, self.event, self.sched = callback, event, sched
        self.saved: dict[int, dict[str, Any]] = {}
        self.first: dict[str, Any] | None = None

    def _state(self, kw: dict[str, Any]) -> dict[str, Any]:
        optimizer = kw["optimizer"]
        return live_state(model=kw["model"], optimizer=getattr(optimizer, "optimizer", optimizer),
                          scheduler=kw["lr_scheduler"], monitor=self.callback.monitor, counted=False)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saved[int(state.global_step)] = self._state(kw)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.first is None:
            self.first = self._state(kw)
        if self.event in ("interrupt", "resume") and int(state.global_step) == STOP_AT:
            if self.event == "interrupt":
                raise KeyboardInterrupt
            raise Crash("the node went away")


def _hf(tmp: Path, action: str, sched: str, *, event: str | None, resume: bool = False,
        done: set[int] | None = None) -> tuple[Any, _Probe]:
    from stabmon.integrations.hf import StabmonCallback

    model = _gpt(SEED + (1 if resume else 0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"), per_device_train_batch_size=8, learning_rate=3e-3, max_steps=STEPS,
        logging_steps=1000, save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=None, report_to=[],
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=SEED)
    optimizers: tuple[Any, Any] = (None, None)
    if sched == "lambda":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.1, 1 - s / STEPS)))
    fault = _Fault(model, done if done is not None else set())
    cb = StabmonCallback(store=f"sqlite:///{tmp / 'run.db'}", runbook=forced_runbook(action),
                         mode="apply", checkpoint_dir=str(tmp / "ckpt"), config=_config(), run_name=f"hf-{action}")
    probe = _Probe(cb, None if resume else event, sched)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows(), callbacks=[fault, cb, probe],
                                   optimizers=optimizers)
    try:
        trainer.train(resume_from_checkpoint=str(_newest(tmp / "out", "checkpoint-")) if resume else None)
    except (KeyboardInterrupt, Crash):
        cb.on_train_end(args, trainer.state, trainer.control)  # what a user's finally: / the next train() does
    return cb, probe


def _hf_params(action: str) -> dict[str, Any]:
    if action == "qk_clip":  # GPT-2 has one attention module per block: name the first
        return {**ACTIONS[action], "layer": "transformer.h.0.attn"}
    if action == "scale_layer_lr":  # the Trainer's two param groups (decay, no decay) each span the whole model
        return {**ACTIONS[action], "tensors": ["transformer.h.1"], "max_share": 1.0}
    return ACTIONS[action]


HF_CELLS = [(a, "default", e) for a in sorted(ACTIONS) for e in EVENTS] + [
    (a, "lambda", "resume") for a in sorted(ACTIONS)]
"""The Trainer's default scheduler on every event; a custom ``LambdaLR`` (its own state_dict) on the resume."""


@pytest.mark.slow
@pytest.mark.parametrize(("action", "sched", "event"), HF_CELLS)
def test_hf_trainer(action: str, sched: str, event: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    import conformance_support

    cell = Invariants(f"hf-{sched}/{action}/{event}")
    monkeypatch.setitem(conformance_support.ACTIONS, action, _hf_params(action))
    done: set[int] = set()
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        cb, probe = _hf(tmp_path, action, sched, event=event, done=done)
        first = cb.monitor
        stopped = first.should_stop
        if event != "continue" or stopped:
            newest = _newest(tmp_path / "out", "checkpoint-")
            step = int(newest.name.split("-")[1])
            again, after = _hf(tmp_path, action, sched, event=event, resume=True, done=done)
            assert after.first is not None or stopped
            if after.first is not None:
                cell.resumed(probe.saved[step], after.first)
            cb = again
    url = f"sqlite:///{tmp_path / 'run.db'}"
    assert cb.monitor.run_id == first.run_id  # one run in the store, every segment of it
    cell.checkpoints(_files(tmp_path / "ckpt"))
    cell.checkpoints(str(p) for p in (tmp_path / "out").glob("checkpoint-*/stabmon_monitor.pt"))
    cell.store(url, first.run_id, action=action, stopped=stopped)
    cell.quiet_log(caplog.records)


# -- Lightning --------------------------------------------------------------------------------------------
def _lightning() -> Any:
    return pytest.importorskip("lightning")


def _lit_module(seed: int, done: set[int]) -> Any:
    from conformance_support import Tiny, tiny_loss

    L = _lightning()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = Tiny()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = tiny_loss(self.net, batch)
            step = int(self.trainer.global_step) if self._trainer is not None else -1
            if step in FAULT_STEPS and step not in done and self.training:
                done.add(step)
                loss = loss * FAULT_SCALE
            return loss

        def configure_optimizers(self) -> Any:
            body = [*self.net.embed.parameters(), *self.net.attn.parameters()]
            opt = torch.optim.AdamW([{"params": body}, {"params": self.net.head.parameters()}], lr=3e-3,
                                    weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def _lit_params(action: str) -> dict[str, Any]:
    if action == "scale_layer_lr":
        return {**ACTIONS[action], "tensors": ["net.head"]}
    return ACTIONS[action]


def _fit(tmp: Path, action: str, *, event: str | None, resume: Path | None, done: set[int]) -> tuple[Any, Any]:
    from conformance_support import tiny_data
    from torch.utils.data import DataLoader

    from stabmon.integrations.lightning import StabmonCallback

    L = _lightning()
    module = _lit_module(SEED + (1 if resume is not None else 0), done)
    cb = StabmonCallback(store=f"sqlite:///{tmp / 'run.db'}", runbook=forced_runbook(action), mode="apply",
                         checkpoint_dir=str(tmp / "ckpt"), config=_config(), run_name=f"lightning-{action}")
    probes = _LitProbe(cb, None if resume is not None else event)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp / "out"), every_n_train_steps=SAVE_EVERY,
                                                save_top_k=-1, filename="{step}")
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb, probes, saver], default_root_dir=str(tmp),
                        num_sanity_val_steps=0)
    loader = DataLoader(tiny_data(n=STEPS + 8), batch_size=None, shuffle=False)
    try:
        trainer.fit(module, loader, ckpt_path=str(resume) if resume is not None else None)
    except (KeyboardInterrupt, Crash, SystemExit):  # Lightning ends a Ctrl-C'd fit with SystemExit(1)
        pass
    return cb, probes


class _LitProbe:
    """Lightning's side of the probe: the live state at each checkpoint Lightning saves and at the first step of
    a resumed fit; the crash or Ctrl-C of the cell."""

    def __new__(cls, callback: Any, event: str | None) -> Any:
        L = _lightning()

        class Probe(L.pytorch.callbacks.Callback):
            def __init__(self) -> None:
                self.callback, self.event = callback, event
                self.saved: dict[int, dict[str, Any]] = {}
                self.first: dict[str, Any] | None = None

            def _state(self, trainer: Any, module: Any) -> dict[str, Any]:
                config = trainer.lr_scheduler_configs[0]
                return live_state(model=module, optimizer=trainer.optimizers[0], scheduler=config.scheduler,
                                  monitor=self.callback.monitor, counted=False)

            def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
                self.saved[int(trainer.global_step)] = self._state(trainer, module)

            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                if self.first is None:
                    self.first = self._state(trainer, module)
                if self.event in ("interrupt", "resume") and int(trainer.global_step) == STOP_AT:
                    if self.event == "interrupt":
                        raise KeyboardInterrupt
                    raise Crash("the node went away")

        return Probe()


@pytest.mark.slow
@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_lightning(action: str, event: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    import conformance_support

    monkeypatch.setitem(conformance_support.ACTIONS, action, _lit_params(action))
    cell = Invariants(f"lightning/{action}/{event}")
    done: set[int] = set()
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        cb, probe = _fit(tmp_path, action, event=event, resume=None, done=done)
        first = cb.monitor
        stopped = first.should_stop
        if event != "continue" or stopped:
            newest = _newest(tmp_path / "out", "step=")
            step = int(newest.stem.split("=")[1])
            again, after = _fit(tmp_path, action, event=event, resume=newest, done=done)
            if after.first is not None:
                cell.resumed(probe.saved[step], after.first)
            cb = again
    assert cb.monitor.run_id == first.run_id
    cell.checkpoints(_files(tmp_path / "ckpt"))
    cell.store(f"sqlite:///{tmp_path / 'run.db'}", first.run_id, action=action, stopped=stopped)
    cell.quiet_log(caplog.records)
