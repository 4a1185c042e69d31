"""The signals with lead: second-moment ratio, attention logits, output-logit scale
(stabmon.collect.signals.moment_ratio, attention, logits; built in stabmon.collect.build)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from stabmon.collect.config import AttentionConfig, LogitConfig, MomentConfig, MonitorConfig
from stabmon.collect.signals.attention import QK, AttentionLogits, max_logits, register_attention
from stabmon.collect.signals.logits import OutputLogits
from stabmon.collect.signals.moment_ratio import MomentRatios
from stabmon.monitor import Monitor


class TinyLM(nn.Module):
    """Embedding, one SDPA attention block, a vocabulary head."""

    def __init__(self, vocab: int = 11, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(vocab, d), nn.Linear(d, 3 * d), nn.Linear(d, vocab)
        self.n_head = heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.qkv(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(b, t, d))


ON = MonitorConfig(moments=MomentConfig(every=1), attention=AttentionConfig(every=1), logits=LogitConfig(every=1))
"""Every signal with lead sampled on every step (they are off by default)."""


def test_signals_with_lead_are_off_by_default():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, store=None, runbook=None, mode="observe")
    assert (mon.signals.moments, mon.signals.attention, mon.signals.logits) == (None, None, None)
    for _ in mon.steps(range(3)):
        idx = torch.randint(11, (2, 5))
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        mon.observe(loss=torch.tensor(1.0))
        opt.step()
        opt.zero_grad()
    mon.close()
    prefixes = ("moment_ratio", "attn_logit", "logit_max", "logit_logz")
    assert len(mon.records) == 3
    assert not any(n.startswith(prefixes) for r in mon.records for n in r.metrics)


def _train(fused: bool, scaler: bool, steps: int = 12) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), fused=fused)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    mon = Monitor(model, opt, scaler=sc, store=None, runbook=None, mode="observe",
                  config=MonitorConfig(moments=MomentConfig(every=2)))
    gen = torch.Generator().manual_seed(1)
    for _ in mon.steps(range(steps)):
        idx = torch.randint(11, (4, 6), generator=gen)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten())
        (sc.scale(loss) if sc is not None else loss).backward()
        mon.observe(loss=loss)
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        opt.zero_grad()
    mon.close()
    return [dict(r.metrics) for r in mon.records]


def test_moment_ratio_same_for_foreach_and_fused_under_grad_scaler():
    plain, fused = _train(False, False), _train(True, True)
    sampled = [i for i, m in enumerate(plain) if "moment_ratio" in m]
    assert sampled == [2, 4, 6, 8, 10]  # the sampling cadence: nothing on other steps (step 0: no state yet)
    for i in sampled:
        for name, value in plain[i].items():
            if name.startswith("moment_ratio"):
                assert fused[i][name] == pytest.approx(value, rel=1e-2), name  # fused and foreach round differently
    assert "moment_ratio/qkv.weight" in plain[2]


def test_moment_ratio_flags_the_tensor_with_a_sudden_gradient():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.999))
    ratios = MomentRatios(opt, list(model.named_parameters()))
    for _ in range(30):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    names, quiet = ratios.measure()
    model[1].bias.grad.mul_(1000.0)
    _, loud = ratios.measure()
    flagged = names[int(loud[1:].argmax()) + 1]
    assert flagged == "moment_ratio/1.bias" and loud[0] > 100 * quiet[0]


def test_optimizer_without_second_moment_is_not_applicable(caplog):
    model = TinyLM()
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, runbook=None,
                      mode="observe", config=MonitorConfig(moments=MomentConfig(every=1)))
    assert "config.moments: SGD keeps no exp_avg_sq (not applicable)" in caplog.text
    for _ in mon.steps(range(3)):
        model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
        mon.observe(loss=torch.tensor(1.0))
        mon.optimizer.step()
    mon.close()
    assert not any(n.startswith("moment_ratio") for r in mon.records for n in r.metrics)


def _manual_max(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if causal:
        t = q.size(-2)
        logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return logits.transpose(0, 1).reshape(q.size(1), -1).amax(1)


def test_max_logits_matches_the_definition_in_blocks():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 4)
    import stabmon.collect.signals.attention as attention

    old, attention.BLOCK = attention.BLOCK, 20  # several blocks of query rows
    try:
        got = max_logits(QK(q, k, causal=True), sub_batch=2)
    finally:
        attention.BLOCK = old
    assert torch.allclose(got, _manual_max(q, k, causal=True))


def test_sdpa_module_and_multihead_attention_are_recognised():
    torch.manual_seed(0)
    model = TinyLM()
    acts = AttentionLogits(model, sub_batch=1)
    assert acts.names == ["attn_logit", "attn_logit/", "attn_logit//0", "attn_logit//1"]  # the root module: name ""
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    watch = AttentionLogits(nn.ModuleDict({"mha": mha}), sub_batch=2)
    watch.arm()
    mha(x, x, x)
    names, values = watch.collect()
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q = F.linear(x, w[:8], b[:8]).view(2, 5, 2, 4).transpose(1, 2)
    k = F.linear(x, w[8:16], b[8:16]).view(2, 5, 2, 4).transpose(1, 2)
    assert names == ["attn_logit", "attn_logit/mha", "attn_logit/mha/0", "attn_logit/mha/1"]
    assert torch.allclose(values[2:], _manual_max(q, k, causal=False), atol=1e-5)


def test_tiny_gpt_blocks_captured_through_sdpa_and_unsampled_steps_pay_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(TinyLM())
    opt = torch.optim.AdamW(model.parameters())
    cfg = MonitorConfig(attention=AttentionConfig(every=3, sub_batch=2), logits=LogitConfig(every=3))
    mon = Monitor(model, opt, store=None, runbook=None, mode="observe", config=cfg)
    for _ in mon.steps(range(7)):
        idx = torch.randint(11, (4, 6))
        model(idx).logsumexp(-1).mean().backward()
        mon.observe(loss=torch.tensor(1.0))
        opt.step()
        opt.zero_grad()
    mon.close()
    got = {r.step: r.metrics for r in mon.records}
    assert [s for s, m in got.items() if "attn_logit" in m] == [0, 3, 6]
    assert [s for s, m in got.items() if "logit_max" in m] == [0, 3, 6]
    assert {"attn_logit/0", "attn_logit/0/0", "attn_logit/0/1"} <= set(got[3])
    assert got[3]["attn_logit"] == max(got[3]["attn_logit/0/0"], got[3]["attn_logit/0/1"])


def test_registered_attention_module_with_its_own_qk():
    class Mine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1) @ x

    def qk(module: nn.Module, args: tuple, kwargs: dict) -> QK:
        x = args[0]
        return QK(module.q(x).unsqueeze(1), module.k(x).unsqueeze(1), scale=1.0)

    register_attention(Mine, qk)
    m = nn.ModuleDict({"mine": Mine()})
    watch = AttentionLogits(m)
    watch.arm()
    x = torch.randn(1, 3, 4)
    m["mine"](x)
    names, values = watch.collect()
    want = (m["mine"].q(x) @ m["mine"].k(x).transpose(-1, -2)).max()
    assert names[:2] == ["attn_logit", "attn_logit/mine"] and torch.allclose(values[0], want)


def test_model_without_attention_or_head_is_not_applicable(caplog):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        Monitor(model, torch.optim.AdamW(model.parameters()), store=None, runbook=None, mode="observe",
                config=ON).close()
    assert "config.attention: the model has no recognised attention module (not applicable" in caplog.text
    assert "config.logits.module: the model has no output layer over its vocabulary (not applicable" in caplog.text


def test_output_logits_values():
    model = TinyLM()
    out = OutputLogits(model, sub_batch=1)
    out.arm()
    idx = torch.randint(11, (3, 5))
    y = model(idx)
    names, values = out.collect()
    assert names == ["logit_max", "logit_logz"]
    assert torch.allclose(values, torch.stack([y[:1].abs().max(), y[:1].logsumexp(-1).abs().max()]))


@pytest.mark.parametrize("config, message", [
    (lambda: MonitorConfig(attention=AttentionConfig(sub_batch=0)), "config.attention.sub_batch must be >= 1, got 0"),
    (lambda: MonitorConfig(moments=MomentConfig(every=-1)), "config.moments.every must be >= 0, got -1"),
    (lambda: MonitorConfig(logits=LogitConfig(sub_batch=0)), "config.logits.sub_batch must be >= 1, got 0"),
])
def test_config_errors_name_the_dotted_path(config, message):
    with pytest.raises(ValueError, match=message):
        config()


def test_unknown_output_module_is_an_error_at_start():
    model = TinyLM()
    with pytest.raises(ValueError, match="config.logits.module: 'nope' is not a module of the model"):
        Monitor(model, torch.optim.AdamW(model.parameters()), store=None, runbook=None, mode="observe",
                config=MonitorConfig(logits=LogitConfig(every=1, module="nope")))
