"""QK-clip (Kimi K2's MuonClip, arXiv 2507.20534): shrink the query/key weights of attention heads whose
logits grew too large, in place (the ``qk_clip`` intervention's live work).

A head whose max attention logit ``S`` exceeds ``tau`` gets its query and key projections (weights and biases)
scaled by ``sqrt(tau / S)`` each, so its logits scale by ``tau / S``; other heads are untouched. Recognised
attention modules: ``nn.MultiheadAttention`` (the packed ``in_proj_weight``, or its separate ``q/k_proj_weight``)
any module with separate query/key ``nn.Linear`` children (``q_proj``/``k_proj`` as in HF Llama, ``query``/
``key``, ``q``/``k``, ``wq``/``wk``), and nanoGPT's packed ``nn.Linear`` child (``c_attn``, ``qkv``, ``attn``,
``in_proj``: query, key and value rows stacked; Hugging Face GPT-2's ``Conv1D`` ``c_attn``, its columns stacked),
each with a head count attribute (``num_heads``, ``n_heads``,
``n_head``, ``num_attention_heads``, or the same on its ``config``). Where keys have fewer heads than queries
(grouped-query attention), the query head alone takes the whole factor. Register another layout with
:func:`register_qk`.

>>> import torch
>>> torch.manual_seed(0) and None
>>> attn = torch.nn.MultiheadAttention(8, num_heads=2)
>>> w = attn.in_proj_weight.detach().clone()
>>> qk_clip(torch.nn.ModuleDict({"attn": attn}), layer="attn", heads=(1,), factor=0.25)
{'layer': 'attn', 'heads': [1], 'factor': 0.25}
>>> bool(torch.equal(attn.in_proj_weight[:4], w[:4])), bool(torch.allclose(attn.in_proj_weight[4:8], w[4:8] * 0.5))
(True, True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stabmon.collect.cluster.sharding import clean_name, is_sharded
from stabmon.collect.signals.attention import AttentionLogits, head_count

log = logging.getLogger(__name__)

_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"), ("wq", "wk"))
_PACKED = ("c_attn", "qkv", "attn", "in_proj")


@dataclass(frozen=True)
class QK:
    """Where one attention module keeps its query and key rows: ``(tensor, first row of the block)`` pairs
    (bias tensors included), the head count of each block, and the head dimension."""

    queries: tuple[tuple[torch.Tensor, int], ...]
    keys: tuple[tuple[torch.Tensor, int], ...]
    q_heads: int
    k_heads: int
    head_dim: int


Finder = Callable[[nn.Module], QK | None]
_FINDERS: list[Finder] = []


def register_qk(finder: Finder) -> Finder:
    """Add a function that returns the :class:`QK` layout of a user's attention module (or None)."""
    _FINDERS.insert(0, finder)
    return finder


def _mha(module: nn.Module) -> QK | None:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    e, h = module.embed_dim, module.num_heads
    bias = module.in_proj_bias
    if module.in_proj_weight is not None:
        qs = [(module.in_proj_weight, 0)] + ([(bias, 0)] if bias is not None else [])
        ks = [(module.in_proj_weight, e)] + ([(bias, e)] if bias is not None else [])
    else:
        qs = [(module.q_proj_weight, 0)] + ([(bias, 0)] if bias is not None else [])
        ks = [(module.k_proj_weight, 0)] + ([(bias, e)] if bias is not None else [])
    return QK(tuple(qs), tuple(ks), h, h, e // h)


def _linear_pair(module: nn.Module) -> QK | None:
    children = dict(module.named_children())
    pairs = [(children[q], children[k]) for q, k in _PAIRS if q in children and k in children]
    linear = [(q, k) for q, k in pairs if isinstance(q, nn.Linear) and isinstance(k, nn.Linear)]
    heads = head_count(module)
    if not linear or heads is None:
        return None
    q, k = linear[0]
    head_dim = q.out_features // heads
    k_heads = k.out_features // head_dim if head_dim else heads

    def rows(lin: nn.Linear) -> tuple[tuple[torch.Tensor, int], ...]:
        return ((lin.weight, 0),) + (((lin.bias, 0),) if lin.bias is not None else ())

    return QK(rows(q), rows(k), heads, k_heads, head_dim)


def _packed_linear(module: nn.Module) -> QK | None:
    """nanoGPT's layout: one ``nn.Linear`` child (``c_attn``, ``qkv``, ``attn``, ``in_proj``) with the query,
    key and value rows stacked (``3 x`` its input width), and the head count on the module."""
    children = dict(module.named_children())
    packed = next((children[n] for n in _PACKED if isinstance(children.get(n), nn.Linear)), None)
    heads = head_count(module)
    if not isinstance(packed, nn.Linear) or heads is None or packed.out_features != 3 * packed.in_features:
        return None
    e = packed.in_features
    bias = packed.bias
    qs = ((packed.weight, 0),) + (((bias, 0),) if bias is not None else ())
    ks = ((packed.weight, e),) + (((bias, e),) if bias is not None else ())
    return QK(qs, ks, heads, heads, e // heads)


def _packed_conv1d(module: nn.Module) -> QK | None:
    """Hugging Face GPT-2's layout: the same packed child (``c_attn``) as a ``Conv1D``, whose weight is
    ``(input width, 3 x input width)``: the query, key and value blocks are its columns, scaled through its
    transpose (a view: the weight itself changes). Not on a sharded (DTensor) weight."""
    children = dict(module.named_children())
    packed = next((children[n] for n in _PACKED if type(children.get(n)).__name__ == "Conv1D"), None)
    heads = head_count(module)
    if packed is None or heads is None:
        return None
    params = dict(packed.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or weight.dim() != 2 or is_sharded(weight) or weight.shape[1] != 3 * weight.shape[0]:
        return None
    e = weight.shape[0]
    columns = weight.t()
    qs = ((columns, 0),) + (((bias, 0),) if bias is not None else ())
    ks = ((columns, e),) + (((bias, e),) if bias is not None else ())
    return QK(qs, ks, heads, heads, e // heads)


def find_qk(module: nn.Module) -> QK | None:
    """The query/key layout of ``module``, or None when it is no attention module stabmon recognises."""
    for finder in (*_FINDERS, _mha, _linear_pair, _packed_linear, _packed_conv1d):
        found = finder(module)
        if found is not None:
            return found
    return None


def attention_layers(model: nn.Module) -> list[str]:
    """Names (without wrapper prefixes) of the model's recognised attention modules."""
    return [clean_name(n) for n, m in model.named_modules() if find_qk(m) is not None]


def qk_clip(model: nn.Module, *, layer: str | None, heads: Sequence[int] | None, factor: float) -> dict:
    """Scale the query/key rows of ``heads`` (all when None) in ``layer`` (the only recognised attention module
    when None) so their logits scale by ``factor`` (< 1). Raises ``ValueError`` naming what is not there."""
    name, qk = _layer(model, layer)
    chosen = sorted(set(heads)) if heads else list(range(qk.q_heads))
    bad = [h for h in chosen if not 0 <= h < qk.q_heads]
    if bad:
        raise ValueError(f"heads: {bad} out of range for {name} ({qk.q_heads} heads)")
    per_head = torch.ones(qk.q_heads)
    per_head[chosen] = factor
    _scale_heads(qk, per_head)
    return {"layer": name, "heads": chosen, "factor": factor}


def _scale_heads(qk: QK, factors: torch.Tensor) -> None:
    """Scale each query head's logits by its entry of ``factors``: its query and key rows by the square root each,
    or, where keys have fewer heads than queries (grouped-query attention), its query rows by the whole factor."""
    grouped = qk.k_heads != qk.q_heads
    rows = (factors if grouped else factors.sqrt()).repeat_interleave(qk.head_dim)
    with torch.no_grad():
        for tensor, first in qk.queries:
            _scale_rows_by(tensor, first, rows)
        if not grouped:
            for tensor, first in qk.keys:
                _scale_rows_by(tensor, first, rows)


class StandingQkClip:
    """QK-clip as Kimi K2 runs it: on every step while ``overrides.qk_tau`` is set, each head whose max attention
    logit ``S`` (measured on the sampled sub-batch by :class:`~stabmon.collect.signals.attention.AttentionLogits`,
    armed on
    every step while it is on) exceeded ``tau`` has its query and key rows scaled by ``sqrt(tau / S)`` after the
    optimizer step; other heads are untouched (their factor is 1). Device arithmetic only, nothing read back:
    the per-head factors are ``tau / max(S, tau)``, a non-finite ``S`` leaves its head alone (that is
    :class:`~stabmon.detect.rules.NonFinite`'s to judge). Under torch.distributed the maxima are reduced (max)
    over ranks first, so every replica or shard scales by the same factors. A module whose query/key layout is not
    recognised (:func:`find_qk`) is measured but not clipped.

    >>> import torch
    >>> from stabmon.collect.signals.attention import AttentionLogits
    >>> torch.manual_seed(0) and None
    >>> attn = torch.nn.MultiheadAttention(4, num_heads=2, batch_first=True)
    >>> with torch.no_grad(): _ = attn.in_proj_weight[:4].mul_(40.0)   # queries far too large
    >>> logits = AttentionLogits(torch.nn.ModuleDict({"attn": attn}))
    >>> clip = StandingQkClip(logits)
    >>> x = torch.randn(1, 6, 4)
    >>> logits.arm(); _ = attn(x, x, x); _ = logits.collect()
    >>> before = logits.last[0].clone(); clip.apply(tau=5.0)
    >>> logits.arm(); _ = attn(x, x, x); _ = logits.collect()
    >>> bool(before.max() > 5.0), bool(torch.all(logits.last[0] <= 5.0 + 1e-3))
    (True, True)
    """

    def __init__(self, attention: AttentionLogits | Callable[[], AttentionLogits]) -> None:
        self._attention = attention if not callable(attention) else None
        self._make = attention if callable(attention) else None
        self._layouts: list[QK | None] | None = None

    @property
    def attention(self) -> AttentionLogits:
        """The collector it reads (made on first use when given as a factory: finding the attention modules may
        import ``transformers``, which a run that never turns the clip on should not pay for)."""
        if self._attention is None:
            assert self._make is not None
            self._attention = self._make()
            if not self._attention.names:
                log.warning("stabmon: qk_clip: the monitor cannot measure this model's attention logits (see "
                            "stabmon.collect.signals.attention.register_attention): the standing clip does nothing")
        return self._attention

    @property
    def built(self) -> bool:
        return self._attention is not None

    def apply(self, *, tau: float) -> None:
        """Clip the heads the last collected step measured above ``tau`` (nothing when none was measured)."""
        last, self.attention.last = self.attention.last, {}
        if self._layouts is None:
            self._layouts = [find_qk(m) for m in self.attention.watched]
        for i, maxima in last.items():
            qk = self._layouts[i]
            if qk is None or maxima.numel() != qk.q_heads:
                continue
            s = maxima.detach().float()
            if _distributed():
                s = s.clone()
                torch.distributed.all_reduce(s, op=torch.distributed.ReduceOp.MAX)
            s = torch.where(torch.isfinite(s), s, torch.full_like(s, tau)).clamp(min=tau)
            _scale_heads(qk, tau / s)  # <= 1 per head; 1 where the head stayed under tau


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _scale_rows_by(tensor: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Rows ``[start, start + len(rows))`` of ``tensor`` times the per-row factors ``rows`` (a device vector); on
    a DTensor sharded along rows, through a factor vector laid out like it."""
    count = rows.numel()
    if hasattr(tensor, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local_device = tensor.to_local().device  # type: ignore[attr-defined]
        full = torch.ones(tensor.shape[0], dtype=tensor.dtype, device=local_device)
        full[start:start + count] = rows.to(device=local_device, dtype=tensor.dtype)
        full = full.reshape(-1, *([1] * (tensor.dim() - 1)))
        tensor.mul_(distribute_tensor(full, tensor.device_mesh, tensor.placements))  # type: ignore[attr-defined]
        return
    shape = (-1, *([1] * (tensor.dim() - 1)))
    tensor[start:start + count].mul_(rows.to(device=tensor.device, dtype=tensor.dtype).reshape(shape))


def _layer(model: nn.Module, layer: str | None) -> tuple[str, QK]:
    found = [(clean_name(n), m) for n, m in model.named_modules()]
    if layer is not None:
        hits = [(n, m) for n, m in found if n == layer]
        if not hits:
            raise ValueError(f"layer: {layer!r} names no module of the model")
        qk = find_qk(hits[0][1])
        if qk is None:
            raise ValueError(f"layer: {layer!r} is no recognised attention module (see stabmon.collect.step.qk)")
        return layer, qk
    recognised = [(n, q) for n, m in found if (q := find_qk(m)) is not None]
    if len(recognised) != 1:
        raise ValueError(f"layer: the model has {len(recognised)} recognised attention modules; name one")
    return recognised[0]
