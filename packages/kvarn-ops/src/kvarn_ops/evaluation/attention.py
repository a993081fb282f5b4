"""Attention over a cache that evolves as in serving, plugged into transformers as an
attention implementation.

The model's own cache (``DynamicCache``) keeps exact K/V; this attention function substitutes
the cached view. A query at absolute position ``p`` sees key ``j`` quantized when ``j``'s tile
(``j // G``) is full and older than ``p``'s own tile (packed tiles; the tile still filling is
exact), except the first tile when the variant keeps it exact (``sink``). Per-token variants
(fp8) quantize every key, the query's own tile included. Because the cache is causal, one
teacher-forced pass with this mask equals feeding the text in chunks of G tokens: the K/V of
tile ``t`` are computed from hidden states that saw exactly what they would have seen then.

Cost: that of one causal attention (one SDPA call per tile of queries), plus the
quantization of each full tile once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvarn_ops.evaluation.variants import CacheVariant

__all__ = ["ATTN_NAME", "EvalState", "mixed_attention", "register", "use_state"]

ATTN_NAME = "kvarn_eval"
_QUERY_BLOCK = 256
_STATE: EvalState | None = None


@dataclass
class EvalState:
    """What the attention function does during one model call sequence.

    variant : the cache variant (``None`` or exact: plain SDPA).
    record : keep per-layer q, k, v and outputs (``[Hq, L, D]`` etc., float32, batch 1).
    reference_out : per-layer attention outputs of an exact run to compare with (accumulated
        error); squared error and squared norm are summed into ``err2``/``ref2``.
    """

    variant: CacheVariant | None = None
    record: bool = False
    reference_out: dict | None = None
    recorded: dict = field(default_factory=dict)
    err2: dict = field(default_factory=dict)
    ref2: dict = field(default_factory=dict)
    _deq: dict = field(default_factory=dict)

    def dequantized(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, n_tiles: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V ``[Hkv, n_tiles*G, D]`` of the first ``n_tiles`` tiles of
        ``key/value [Hkv, L, D]``, quantizing only tiles not seen before (as a flush does)."""
        v = self.variant
        assert v is not None
        g = v.group
        have_k, have_v = self._deq.get(layer, (key[:, :0], value[:, :0]))
        n_have = have_k.shape[1] // g
        if n_tiles > n_have:
            h, _, d = key.shape
            kt = key[:, n_have * g : n_tiles * g].reshape(h * (n_tiles - n_have), g, d)
            vt = value[:, n_have * g : n_tiles * g].reshape(h * (n_tiles - n_have), g, d)
            # The sequence's first token (row 0 of its first tile) is the attention sink.
            sink = torch.full((h, n_tiles - n_have), -1, dtype=torch.int32)
            if n_have == 0:
                sink[:, 0] = 0
            kq, vq = v.roundtrip(kt.float(), vt.float(), sink.flatten())
            have_k = torch.cat((have_k, kq.reshape(h, -1, d).to(key.dtype)), dim=1)
            have_v = torch.cat((have_v, vq.reshape(h, -1, d).to(value.dtype)), dim=1)
            self._deq[layer] = (have_k, have_v)
        return have_k[:, : n_tiles * g], have_v[:, : n_tiles * g]


def use_state(state: EvalState | None) -> None:
    """Install the state the attention function reads (``None`` to clear)."""
    global _STATE
    _STATE = state


def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kq: torch.Tensor,
    vq: torch.Tensor,
    qpos0: int,
    variant: CacheVariant,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of queries ``q [Hq, T, D]`` at positions ``qpos0 ..`` over keys
    ``k, v [Hkv, L, D]`` (exact) and ``kq, vq [Hkv, Lq, D]`` (dequantized, ``Lq <= L``; keys
    from ``Lq`` on have no quantized version and are read exact). Returns ``[Hq, T, D]``.

    Queries are processed one tile at a time: the keys of tile c are the quantized prefix
    (tiles before c, the first one exact with ``sink``) followed by the exact own tile, so the
    work is that of one causal attention.
    """
    import torch.nn.functional as F  # noqa: N812

    t = q.shape[1]
    g = variant.group
    lq = kq.shape[1]
    if variant.per_token:
        # Every key quantized (the sink tile exact when asked); keys past Lq read exact.
        pk, pv = torch.cat((kq, k[:, lq:]), 1), torch.cat((vq, v[:, lq:]), 1)
        if variant.sink:
            pk, pv = torch.cat((k[:, :g], pk[:, g:]), 1), torch.cat((v[:, :g], pv[:, g:]), 1)
        k, v, kq, vq, lq = pk, pv, pk, pv, pk.shape[1]
    out = torch.empty_like(q)
    pos = qpos0
    while pos < qpos0 + t:
        c = pos // g
        end = min((c + 1) * g, qpos0 + t)
        qb = q[:, pos - qpos0 : end - qpos0]
        n_pre = min(c * g, lq)
        if variant.sink and n_pre:
            keys_pre = torch.cat((k[:, : min(g, n_pre)], kq[:, g:n_pre]), 1)
            vals_pre = torch.cat((v[:, : min(g, n_pre)], vq[:, g:n_pre]), 1)
        else:
            keys_pre, vals_pre = kq[:, :n_pre], vq[:, :n_pre]
        keys = torch.cat((keys_pre, k[:, n_pre:end]), 1)
        vals = torch.cat((vals_pre, v[:, n_pre:end]), 1)
        p = torch.arange(pos, end)
        j = torch.arange(keys.shape[1])
        mask = j[None, :] <= p[:, None]
        out[:, pos - qpos0 : end - qpos0] = F.scaled_dot_product_attention(
            qb[None], keys[None], vals[None], attn_mask=mask, scale=scaling, enable_gqa=True
        )[0]
        pos = end
    return out


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st = _STATE
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if query.shape[0] != 1:
        raise ValueError(f"the evaluation attention runs batch 1, got {query.shape[0]}")
    layer = module.layer_idx
    t, length = query.shape[2], key.shape[2]
    if st is None or st.variant is None or st.variant.exact:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        o = out[0].transpose(0, 1)  # [Hq, T, D]
    else:
        var = st.variant
        qpos0 = length - t
        if var.per_token:
            kq, vq = var.roundtrip(key[0].float(), value[0].float())
            kq, vq = kq.to(key.dtype), vq.to(value.dtype)
        else:
            n_tiles = max((length - 1) // var.group, 0)
            kq, vq = st.dequantized(layer, key[0], value[0], n_tiles)
        o = mixed_attention(query[0], key[0], value[0], kq, vq, qpos0, var, scaling)
        out = o.transpose(0, 1)[None].contiguous()
    if st is not None:
        if st.record:
            st.recorded[layer] = (
                query[0].detach().clone(),
                key[0].detach().clone(),
                value[0].detach().clone(),
                o.detach().clone(),
                scaling,
            )
        if st.reference_out is not None:
            ref = st.reference_out[layer][:, length - t : length]
            st.err2[layer] = st.err2.get(layer, 0.0) + float(((o - ref) ** 2).sum())
            st.ref2[layer] = st.ref2.get(layer, 0.0) + float((ref**2).sum())
    return out, None


def register() -> str:
    """Register the attention function with transformers; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    return ATTN_NAME
