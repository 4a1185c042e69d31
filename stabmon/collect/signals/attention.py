"""Max attention logit per layer and head, on a sub-batch of sampled steps.

The logit of a query-key pair is ``q·k x scale`` (``scale = 1/sqrt(head dim)`` unless the call says
otherwise), before the softmax. When it grows without bound the softmax saturates to one key (attention
entropy collapse) and a high-LR transformer without QK-layernorm diverges (Wortsman et al. 2023, arXiv
2309.14322); Kimi K2's QK-clip rescales the query/key weights of the heads whose max logit passes τ = 100.

Recognised attention modules:

- ``nn.MultiheadAttention``: ``q`` and ``k`` are recomputed from its inputs (a forward pre-hook) and its
  in-projection weights;
- a module whose class calls ``F.scaled_dot_product_attention`` (found in the class's source), and
  Hugging Face ``GPT2Attention`` / ``LlamaAttention`` (when ``transformers`` is importable; their default
  ``sdpa`` attention): the first ``scaled_dot_product_attention`` call inside the module's forward is seen
  through a ``TorchFunctionMode`` that exists only inside the hooked forward of a sampled step;
- your own class: ``register_attention(MyAttention)`` if its forward reaches ``scaled_dot_product_attention``
  (however it imports it), or ``register_attention(MyAttention, qk=fn)`` with
  ``fn(module, args, kwargs) -> QK`` returning the query and key tensors ``(batch, heads, tokens, head dim)``
  of the call.

For each, ``q @ kᵀ x scale`` of the first ``sub_batch`` sequences is formed by blocks of query rows (at most
:data:`BLOCK` logits at a time), causal and boolean/additive masks applied, and reduced to the max per head:
a device tensor, never read back before the flush. Cost: on a sampled step only, ``sub_batch / batch`` of the
attention's own query-key product; unsampled steps run no hook at all.

>>> import torch
>>> torch.manual_seed(0) and None
>>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
>>> model = torch.nn.ModuleDict({"attn": mha})
>>> logits = AttentionLogits(model)
>>> logits.names
['attn_logit', 'attn_logit/attn', 'attn_logit/attn/0', 'attn_logit/attn/1']
>>> logits.arm(); x = torch.randn(3, 5, 8); _ = mha(x, x, x)
>>> names, values = logits.collect()
>>> values.shape, bool(values[0] == values[1:].max())
(torch.Size([4]), True)
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from stabmon.collect.cluster.sharding import clean_name
from stabmon.events import Metric

log = logging.getLogger(__name__)

BLOCK = 1 << 22
"""Most logits formed at once (16 MiB of fp32): longer sequences go by blocks of query rows."""


@dataclass(frozen=True)
class QK:
    """The query and key of one attention call, ``(batch, heads, tokens, head dim)``, and how it masks."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float | None = None
    causal: bool = False
    mask: torch.Tensor | None = None


QKFn = Callable[[nn.Module, tuple, dict], QK]
"""``(module, args, kwargs) -> QK``: a registered module's query and key from its forward's inputs."""

_REGISTERED: dict[type, QKFn | None] = {}


_HEADS = ("num_heads", "n_heads", "n_head", "num_attention_heads")


def head_count(module: nn.Module) -> int | None:
    """The head count an attention module (or its HF ``config``) declares, else None."""
    for owner in (module, getattr(module, "config", None)):
        for attr in _HEADS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def register_attention(cls: type[nn.Module], qk: QKFn | None = None) -> None:
    """Declare ``cls`` an attention module: ``qk=None`` when its forward calls ``scaled_dot_product_attention``
    (seen through a TorchFunctionMode), else ``qk(module, args, kwargs)`` returning its :class:`QK`."""
    _REGISTERED[cls] = qk


def _hf_classes() -> tuple[type, ...]:
    """Hugging Face's attention classes, when ``transformers`` is imported already (a model built from it has
    imported it; importing its modelling code here would cost every monitor seconds for nothing)."""
    if "transformers" not in sys.modules:
        return ()
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
        from transformers.models.llama.modeling_llama import LlamaAttention
    except Exception:  # noqa: BLE001 - transformers absent or broken: its classes are not recognised
        return ()
    return (GPT2Attention, LlamaAttention)


def _calls_sdpa(cls: type) -> bool:
    """Whether the class's source (its forward or a helper it calls) names ``scaled_dot_product_attention``;
    torch's own modules are recognised by class, not by source."""
    if cls.__module__.startswith("torch."):
        return False
    try:
        return "scaled_dot_product_attention" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def _qk_mha(module: nn.Module, args: tuple, kwargs: dict) -> QK:
    """``nn.MultiheadAttention``'s projected query and key, from its inputs and in-projection weights."""
    assert isinstance(module, nn.MultiheadAttention)
    query = kwargs.get("query", args[0] if args else None)
    key = kwargs.get("key", args[1] if len(args) > 1 else None)
    assert query is not None and key is not None
    if not module.batch_first and query.dim() == 3:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    e, h = module.embed_dim, module.num_heads
    if module.in_proj_weight is not None:
        wq, wk = module.in_proj_weight[:e], module.in_proj_weight[e : 2 * e]
    else:
        wq, wk = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    q = F.linear(query, wq, bias[:e] if bias is not None else None)
    k = F.linear(key, wk, bias[e : 2 * e] if bias is not None else None)
    q, k = (t.reshape(*t.shape[:-1], h, e // h).transpose(-3, -2) for t in (q, k))
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = ~mask  # nn.MultiheadAttention: True = not allowed; QK.mask: True = allowed
    return QK(q, k, causal=bool(kwargs.get("is_causal", False)), mask=mask)


def _qk_sdpa(args: tuple, kwargs: dict) -> QK:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False)) | kwargs
    return QK(bound["query"], bound["key"], scale=bound.get("scale"), causal=bool(bound.get("is_causal")),
              mask=bound.get("attn_mask"))


def max_logits(qk: QK, sub_batch: int) -> torch.Tensor:
    """Max of ``q·kᵀ x scale`` per head over the first ``sub_batch`` sequences, masks applied (fp32)."""
    q, k = qk.q.detach()[:sub_batch].float(), qk.k.detach()[:sub_batch].float()
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if k.size(-3) != q.size(-3):  # grouped-query attention: each key head serves several query heads
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = qk.scale if qk.scale is not None else 1.0 / math.sqrt(q.size(-1))
    mask = qk.mask.detach() if qk.mask is not None else None
    if mask is not None and mask.dim() == 4 and mask.size(0) > 1:
        mask = mask[:sub_batch]
    t, s = q.size(-2), k.size(-2)
    rows = max(1, BLOCK // max(1, q.size(0) * q.size(1) * s))
    best = torch.full((q.size(1),), -math.inf, device=q.device)
    for r0 in range(0, t, rows):
        logits = (q[..., r0 : r0 + rows, :] @ k.transpose(-1, -2)) * scale
        if qk.causal:
            r = torch.arange(r0, r0 + logits.size(-2), device=q.device)
            logits = logits.masked_fill(torch.arange(s, device=q.device) > r[:, None], -math.inf)
        if mask is not None:
            m = mask[..., r0 : r0 + logits.size(-2), :] if mask.dim() >= 2 and mask.size(-2) == t else mask
            logits = logits.masked_fill(~m, -math.inf) if m.dtype == torch.bool else logits + m.float()
        best = torch.maximum(best, logits.transpose(0, 1).reshape(q.size(1), -1).amax(dim=1))
    return best


class _Capture(TorchFunctionMode):
    """Sees the first ``scaled_dot_product_attention`` call while it is entered (one module's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk: QK | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.qk is None:
            self.qk = _qk_sdpa(args, kwargs)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _Watched:
    name: str
    module: nn.Module
    qk: QKFn | None  # None: captured from its scaled_dot_product_attention call


def find_attention(model: nn.Module, patterns: Sequence[str] | None = None) -> list[_Watched]:
    """The recognised attention modules of ``model`` (see the module docstring), outermost first; nested
    recognised modules inside a recognised one are left to it."""
    hf = _hf_classes()
    rx = [re.compile(p) for p in patterns] if patterns is not None else None
    out: list[_Watched] = []
    for raw, m in model.named_modules():
        name = clean_name(raw)
        if rx is not None and not any(r.fullmatch(name) for r in rx):
            continue
        if any(name.startswith(w.name + ".") for w in out):
            continue
        cls = type(m)
        registered = next((c for c in _REGISTERED if isinstance(m, c)), None)
        if registered is not None:
            out.append(_Watched(name, m, _REGISTERED[registered]))
        elif isinstance(m, nn.MultiheadAttention):
            out.append(_Watched(name, m, _qk_mha))
        elif isinstance(m, hf) or _calls_sdpa(cls):
            out.append(_Watched(name, m, None))
    return out


class AttentionLogits:
    """Max attention logit per recognised module (and head) on armed steps; see the module docstring."""

    def __init__(self, model: nn.Module, patterns: Sequence[str] | None = None, *, sub_batch: int = 1,
                 heads: bool = True) -> None:
        self._watched = find_attention(model, patterns)
        self._sub_batch, self._heads = sub_batch, heads
        self._n_heads = [head_count(w.module) or 0 for w in self._watched]  # 0: per-head names come with values
        self.names = [Metric.ATTN_LOGIT] if self._watched else []
        for w, h in zip(self._watched, self._n_heads, strict=True):
            self.names.append(Metric.ATTN_LOGIT_PREFIX + w.name)
            if heads and h:
                self.names += [f"{Metric.ATTN_LOGIT_PREFIX}{w.name}/{i}" for i in range(h)]
        self._handles: list[Any] = []
        self._values: dict[int, torch.Tensor] = {}
        #: the per-head maxima of the last collected step, by index into :attr:`watched` (device tensors, never
        #: read back here): what a standing QK-clip acts on (:class:`stabmon.collect.step.qk.StandingQkClip`)
        self.last: dict[int, torch.Tensor] = {}
        self._modes: dict[int, _Capture] = {}
        self._failed: set[int] = set()

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    @property
    def watched(self) -> list[nn.Module]:
        """The recognised attention modules, in the order of :attr:`last`'s indices."""
        return [w.module for w in self._watched]

    def arm(self) -> None:
        """Hook the recognised modules for the coming forward pass."""
        self.disarm()
        self._values = {}
        for i, w in enumerate(self._watched):
            if i in self._failed:
                continue
            self._handles.append(w.module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(w.module.register_forward_hook(self._post(i)))

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for mode in self._modes.values():
            mode.__exit__(None, None, None)
        self._modes = {}

    def _pre(self, i: int):  # noqa: ANN202 - torch hook signature
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if i in self._values or i in self._modes:
                return
            qk = self._watched[i].qk
            if qk is not None:
                self._measure(i, lambda: qk(module, args, kwargs))
            else:
                mode = self._modes[i] = _Capture()
                mode.__enter__()

        return hook

    def _post(self, i: int):  # noqa: ANN202 - torch hook signature
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            mode = self._modes.pop(i, None)
            if mode is None:
                return
            mode.__exit__(None, None, None)
            if mode.qk is not None:
                captured = mode.qk
                self._measure(i, lambda: captured)

        return hook

    def _measure(self, i: int, get: Callable[[], QK]) -> None:
        """Store module ``i``'s per-head max; a failure turns that module off, logged once, never raised."""
        try:
            with torch.no_grad():
                self._values[i] = max_logits(get(), self._sub_batch)
        except Exception:  # noqa: BLE001 - a signal must never break the training step
            self._failed.add(i)
            log.warning("stabmon: config.attention: cannot measure %s's attention logits (not applicable): it is "
                        "no longer sampled", self._watched[i].name, exc_info=True)

    def collect(self) -> tuple[list[str], torch.Tensor | None]:
        """Disarm and return (names, values): the max over everything, then per module its max and heads."""
        self.disarm()
        values, self._values = self._values, {}
        self.last = values
        if not values:
            return [], None
        device = next(iter(values.values())).device
        names: list[str] = []
        parts: list[torch.Tensor] = []
        layer_max: list[torch.Tensor] = []
        for i, w in enumerate(self._watched):
            if i not in values:
                continue
            per_head = values[i].to(device)
            names.append(Metric.ATTN_LOGIT_PREFIX + w.name)
            layer_max.append(per_head.max().reshape(1))
            parts.append(layer_max[-1])
            if self._heads and self._n_heads[i] == per_head.numel():
                names += [f"{Metric.ATTN_LOGIT_PREFIX}{w.name}/{h}" for h in range(per_head.numel())]
                parts.append(per_head)
        top = torch.cat(layer_max).max().reshape(1)
        return [Metric.ATTN_LOGIT] + names, torch.cat([top, *parts])
