"""The HF Trainer callback and the Lightning callback drive the monitor like a plain loop does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.collect.config import MonitorConfig
from stabmon.events import Metric


@pytest.mark.slow
def test_hf_trainer_callback(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from stabmon.integrations.hf import StabmonCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                 n_layer=2, n_head=2))
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (64, 16), generator=gen)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=0.5,
                                          report_to="none", use_cpu=True, logging_steps=100, save_strategy="no",
                                          disable_tqdm=True)
    callback = StabmonCallback(store=None, detectors=False, config=MonitorConfig(flush_every=5,
                                                                                  hang_timeout=None))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    mon = callback.monitor
    assert mon is not None and mon.step == 12 and len(mon.records) == 12
    assert args.max_grad_norm == 0.0 and mon.config.clip == 0.5
    rec = mon.records[3].metrics
    assert rec[Metric.CLIP] == 0.5 and rec[Metric.GRAD_NORM] > 0 and 0 < rec["loss"] < 10
    assert any(k.startswith("grad_norm/transformer.h.") for k in rec)
    assert any(k.startswith("act_rms/transformer.h.") for k in mon.records[0].metrics)


@pytest.mark.slow
def test_lightning_callback(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from stabmon.integrations.lightning import StabmonCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5)}

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    callback = StabmonCallback(store=None, detectors=False, config=MonitorConfig(clip=1.0, flush_every=4,
                                                                                  hang_timeout=None))
    trainer = L.Trainer(max_steps=10, callbacks=[callback], accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(Module(), loader)
    mon = callback.monitor
    assert mon is not None and mon.step == 10 and len(mon.records) == 10
    rec = mon.records[2].metrics
    assert rec[Metric.CLIP] == 1.0 and rec[Metric.GRAD_NORM] > 0 and rec["loss"] > 0
    assert [r.batch_index for r in mon.records] == list(range(8)) + [0, 1]
