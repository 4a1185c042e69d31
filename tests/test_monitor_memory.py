"""What the monitor keeps on the device is bounded and reported per signal: embedding rows tracked (a subset of
a large vocabulary, the reference optionally in host memory), the guard's snapshot, the queued metrics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stabmon.collect.config import EmbeddingConfig, MonitorConfig
from stabmon.collect.signals.embeddings import EmbeddingDrift
from stabmon.monitor import Monitor


class Lm(nn.Module):
    def __init__(self, vocab: int = 5000, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(idx))


def _train(mon: Monitor, model: Lm, opt: torch.optim.Optimizer, steps: int) -> None:
    for _, idx in mon.steps([torch.randint(0, 5000, (8, 16), generator=torch.Generator().manual_seed(i))
                             for i in range(steps)]):
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()


def _expected(w0: torch.Tensor, prev: torch.Tensor, now: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    w0, prev, now = w0[rows], prev[rows], now[rows]
    return float((now - w0).norm() / w0.norm()), float((now - prev).norm() / now.norm())


@pytest.mark.parametrize("reference", ["device", "cpu"])
def test_tracked_rows_give_drift_and_update_of_those_rows(reference: str) -> None:
    torch.manual_seed(0)
    model = Lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = MonitorConfig(flush_every=50, embeddings=EmbeddingConfig(every=3, rows=100, reference=reference))
    mon = Monitor(model, opt, store=None, detectors=False, config=cfg)
    w0 = model.wte.weight.detach().clone()
    tracked = mon.signals.embeddings._tracked[0].index  # type: ignore[union-attr]
    assert tracked is not None and len(tracked) == 100 and tracked[0] == 0 and tracked[-1] == 4999
    _train(mon, model, opt, 6)  # sampled at steps 0 and 3
    prev = model.wte.weight.detach().clone()
    _train(mon, model, opt, 1)  # step 6, sampled
    mon.close()
    drift, update = _expected(w0, prev, model.wte.weight.detach(), tracked)
    rec = mon.records[6]
    assert rec.metrics["emb_drift/wte"] == pytest.approx(drift, rel=1e-4)
    assert rec.metrics["emb_update/wte"] == pytest.approx(update, rel=1e-4)
    assert "emb_drift/wte" not in mon.records[5].metrics


def test_device_memory_is_bounded_and_the_host_reference_keeps_none() -> None:
    d, rows = 16, 100
    on_device = EmbeddingDrift(Lm(d=d), rows=rows).device_bytes()
    index_bytes = rows * 8
    assert on_device == 2 * rows * d * 4 + index_bytes  # W0 rows + scratch rows + the row index
    assert EmbeddingDrift(Lm(d=d), rows=rows, reference="cpu").device_bytes() == index_bytes
    assert EmbeddingDrift(Lm(d=d), rows=None).device_bytes() == 2 * 5000 * d * 4


def test_monitor_reports_device_memory_per_signal() -> None:
    torch.manual_seed(0)
    model = Lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(flush_every=4))
    mon.overrides.skip_factor = 10.0
    _train(mon, model, opt, 3)
    mem = mon.device_memory()
    params = sum(p.numel() * 4 for p in model.parameters())
    assert mem.embeddings == 2 * 1024 * 16 * 4 + 1024 * 8  # the default rows=1024 of a 5000-row vocabulary
    assert mem.skip_guard == 2 * params  # the fallback (SGD): parameters and momentum buffers
    assert 0 < mem.pending < 1024  # three steps of queued scalars
    assert mem.total == mem.embeddings + mem.skip_guard + mem.pending
    mon.close()


def test_a_resumed_reference_of_another_shape_is_kept_out() -> None:
    model = Lm()
    full = EmbeddingDrift(model, rows=None)
    subset = EmbeddingDrift(model, rows=10)
    before = subset._tracked[0].w0.clone()
    subset.load_state_dict(full.state_dict())
    assert torch.equal(subset._tracked[0].w0, before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rows=0), "config.embeddings.rows must be >= 1 or None, got 0"),
        (dict(reference="gpu"), "config.embeddings.reference must be 'device' or 'cpu', got 'gpu'"),
    ],
)
def test_embedding_config_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        MonitorConfig(embeddings=EmbeddingConfig(**kwargs))
    assert str(err.value) == message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_rms_of_low_precision_cpu_tensors_goes_by_chunks(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stabmon.collect.signals import activations

    monkeypatch.setattr(activations, "CHUNK", 1000)
    y = (torch.randn(7, 1001, generator=torch.Generator().manual_seed(3)) * 300).to(dtype)
    expected = float(torch.linalg.vector_norm(y.double()) / (y.numel() ** 0.5))
    got = activations.rms(y)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(expected, rel=1e-5)
