"""The update ratios ``||Δθ|| / ||θ_before||`` recomputed from Adam/AdamW's state (no copy of the parameters: on by
default there) against the step actually taken, measured from a copy: every kernel, decoupled and coupled weight
decay, an LR override in force, a skipped update."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stabmon.collect.config import MonitorConfig, UpdateConfig
from stabmon.collect.signals.grads import GradNorms
from stabmon.collect.signals.updates import AdamUpdateNorms, UpdateNorms
from stabmon.monitor import Monitor

LAYERS = ("0", "2")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _measured(opt_cls: type[torch.optim.Optimizer], kind: dict[str, bool], *, wd: float, steps: int = 6,
              lr_scale: float = 1.0, spike_at: int | None = None, skip_factor: float | None = None,
              **cfg: Any) -> tuple[list[tuple[dict[str, float], dict[str, float]]], Monitor]:
    """(each step's monitor ratios and the ratios of the step taken, measured from a copy), and the monitor."""
    model = _model()
    opt = opt_cls(model.parameters(), lr=0.05, weight_decay=wd, **kind)
    mon = Monitor(model, opt, store=None, detectors=False,
                  config=MonitorConfig(hang_timeout=None, flush_every=1, updates=UpdateConfig(every=1), **cfg))
    mon.overrides.lr_scale, mon.overrides.skip_factor = lr_scale, skip_factor
    gen = torch.Generator().manual_seed(3)
    truth = []
    for step in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        mon.begin_step()
        x = torch.randn(16, 6, generator=gen)
        (model(x).pow(2).mean() * (1e4 if step == spike_at else 1.0)).backward()  # a gradient 10^4x its norm
        opt.step()
        opt.zero_grad()
        mon.end_step()
        after = [p.detach() for p in model.parameters()]
        row = {}
        for layer, (i, j) in zip(LAYERS, ((0, 1), (2, 3)), strict=True):
            d = sum(float((after[k] - before[k]).pow(2).sum()) for k in (i, j))
            t = sum(float(before[k].pow(2).sum()) for k in (i, j))
            row[layer] = (d / t) ** 0.5
        truth.append(row)
    mon.flush()
    got = [{layer: r.metrics[f"update_ratio/{layer}"] for layer in LAYERS} for r in mon.records]
    mon.close()
    return list(zip(got, truth, strict=True)), mon


KINDS = [{"foreach": False}, {"foreach": True}, {"fused": True}]


@pytest.mark.parametrize("kind", KINDS, ids=["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_the_ratios_from_adam_state_are_the_step_taken(opt_cls: type[torch.optim.Optimizer],
                                                       kind: dict[str, bool]) -> None:
    pairs, mon = _measured(opt_cls, kind, wd=0.1, lr_scale=0.5)  # an LR override in force: the LR used counts
    assert [type(s) for _, s in mon.signals.hooks.signals if isinstance(s, UpdateNorms)] == [AdamUpdateNorms]
    for got, truth in pairs:
        for layer in LAYERS:
            assert got[layer] == pytest.approx(truth[layer], rel=1e-3), (layer, got, truth)


def test_a_skipped_update_reads_zero() -> None:
    # the skip guard discards the step of a gradient 10^4 times its running mean (fused kernel: zero-copy)
    pairs, _ = _measured(torch.optim.AdamW, {"fused": True}, wd=0.1, steps=8, spike_at=6, skip_factor=5.0)
    mon_skipped, truth = pairs[6]
    assert truth == {"0": 0.0, "2": 0.0} and mon_skipped == {"0": 0.0, "2": 0.0}


def test_on_by_default_only_where_it_costs_no_copy() -> None:
    def collectors(opt: torch.optim.Optimizer, **cfg: Any) -> list[type]:
        mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None, **cfg))
        mon.close()
        return [type(s) for _, s in mon.signals.hooks.signals if isinstance(s, UpdateNorms)]

    model = _model()
    assert collectors(torch.optim.AdamW(model.parameters())) == [AdamUpdateNorms]
    assert collectors(torch.optim.SGD(model.parameters(), lr=0.1)) == []  # it would hold a copy: asked for only
    assert collectors(torch.optim.SGD(model.parameters(), lr=0.1), updates=UpdateConfig(every=5)) == [UpdateNorms]
    assert collectors(torch.optim.Adam(model.parameters(), amsgrad=True)) == []
    assert collectors(torch.optim.AdamW(model.parameters()), updates=UpdateConfig(every=0)) == []


@pytest.mark.parametrize("bad", [-1, 2.5, "10", True])
def test_a_bad_period_is_a_one_line_error(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"updates.every must be None or an int >= 0"):
        Monitor(_model(), torch.optim.AdamW(_model().parameters()), store=None,
                config=MonitorConfig(hang_timeout=None, updates=UpdateConfig(every=bad)))


@pytest.mark.parametrize("opt_kind", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_a_zero_initialised_layer_has_no_ratio_on_its_first_step_and_is_not_out_of_line(
        opt_kind: dict[str, bool]) -> None:
    # A Hugging Face GPT-2 whose untied output head starts at zero (as modded-nanogpt's lm_head, a zero-init
    # classifier head, LoRA's B): its first step is the whole of its weights. Against the weights after the step
    # that read exactly 1, ~1000x the other layers, and the default suite warned on every such run's first sample.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **opt_kind)
    mon = Monitor(model, opt, store=None, config=MonitorConfig(hang_timeout=None))  # the defaults: every 20 steps
    gen = torch.Generator().manual_seed(1)
    for _ in range(41):
        mon.begin_step()
        ids = torch.randint(0, 40, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        mon.observe(loss=loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.end_step()
    mon.flush()
    sampled = {r.step: r.metrics for r in mon.records if "update_ratio/lm_head" in r.metrics}
    mon.close()
    assert sorted(sampled) == [0, 20, 40]
    assert sampled[0]["update_ratio/lm_head"] == float("inf")  # moved from zero: no ratio
    assert 0 < sampled[0]["update_ratio/transformer.h.0"] < 0.1 and 0 < sampled[0]["update_ratio"] < 0.1
    assert all(0 < m["update_ratio/lm_head"] < 1 for s, m in sampled.items() if s)  # from then on, a ratio
    assert [a for a in mon.anomalies if a.kind == "out_of_line"] == []


def test_the_copy_gives_a_zero_initialised_layer_no_ratio_either() -> None:
    model = _model()
    with torch.no_grad():
        model[0].weight.zero_(), model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    upd = UpdateNorms(GradNorms(model))
    model(torch.ones(3, 6)).sum().backward()
    upd.before_update()
    opt.step()
    _, values = upd.after_update()
    assert values[1].item() == float("inf")  # the zero layer moved: no ratio; the others (and all) have one
    assert all(0 < v < float("inf") for v in (values[0].item(), values[2].item()))
    upd.before_update()  # nothing moves (no gradient): 0 over weights that are not zero
    model.zero_grad(set_to_none=False)
    opt.step()
    assert upd.after_update()[1].tolist() == [0.0, 0.0, 0.0]
