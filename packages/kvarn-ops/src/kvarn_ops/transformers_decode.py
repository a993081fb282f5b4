"""Decode steps of a transformers model read straight from ``KvarnCache``'s records.

``kvarn_ops.transformers_cache`` registers the attention implementation ``"kvarn"`` (on
import): SDPA for every call (prefill, chunks, padded batches) except a one-token step of a
layer whose cache is a ``KvarnCache`` built for it, which runs ``kvarn_ops.decode`` (the
serving path's split-K kernel) over the layer's packed tiles and the filling tile held rotated
in a one-block-per-row exact pool, without dequantizing the context::

    model.set_attn_implementation("kvarn")   # after importing kvarn_ops.transformers_cache
    cache = KvarnCache("kvarn_k4v2_g64", model.config)   # reads the model's implementation

Such a step follows the serving order: the token is stored, a tile it fills is packed, then the
query reads the cache, so a query that completes a tile sees that tile quantized, as in the
vLLM plugin (a call of more tokens sees its own tile exact, as the plugin's prefill does).
"""

from __future__ import annotations

from typing import Any

import torch

import kvarn_formats as kf

__all__ = ["ATTENTION_NAME", "PackedDecode", "kvarn_attention_forward", "register_attention"]

ATTENTION_NAME = "kvarn"


def _padded(mask: torch.Tensor | None) -> bool:
    """Whether an SDPA-style mask hides any key from a query (bool: True attends; float: 0
    attends)."""
    if mask is None:
        return False
    if mask.dtype == torch.bool:
        return not bool(mask.all())
    return bool((mask != 0).any())


def kvarn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"kvarn"`` attention: a ``KvarnCache`` decode step through ``kvarn_ops.decode``,
    anything else through transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = getattr(key, "_kvarn_layer", None)
    if layer is not None:
        if dropout:
            raise ValueError("dropout: the kvarn decode step has no attention dropout")
        if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
            raise ValueError(
                "attention: softcap and sliding windows are not supported by the kvarn decode"
            )
        if not _padded(attention_mask):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return layer.attend(query, float(scale)), None
        # a padded batch: the same cache contents through SDPA (the kernel has no mask)
        key, value = layer.full_kv()
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register_attention() -> None:
    """Register ``"kvarn"`` with transformers' attention and mask interfaces (SDPA's mask);
    idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kvarn_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class PackedDecode:
    """A layer's state for decode steps from its records: the filling tile rotated in an
    exact pool ``[B, G, Hkv, D]`` (pool block ``b`` is row ``b``'s), the block table of the
    records (rebuilt when a tile is added) and the decode kernel's workspace (grown by
    doubling the context it is sized for)."""

    def __init__(self, like: torch.Tensor, layout: kf.RecordLayout) -> None:
        b, hkv, _, d = like.shape
        g = layout.block_size
        self.layout = layout
        self.pool_k = torch.zeros((b, g, hkv, d), dtype=like.dtype, device=like.device)
        self.pool_v = torch.zeros_like(self.pool_k)
        self._table: tuple[int, torch.Tensor] | None = None
        self._ws: tuple[tuple[int, int, int], torch.Tensor] | None = None
        self._rows = torch.arange(b, dtype=torch.int32, device=like.device)  # pool block a row

    def write(self, tail_k: torch.Tensor, tail_v: torch.Tensor, new: int) -> None:
        """Store the last ``new`` tokens of the filling tile ``tail_k``/``tail_v``
        ``[B, Hkv, r, D]`` (model frame) into the pool, rotated (``kvarn_ops.store``)."""
        import kvarn_ops

        b, hkv, r, d = tail_k.shape
        n = min(new, r)
        if n == 0:
            return
        g = self.layout.block_size
        dev = tail_k.device
        kt = tail_k[:, :, r - n :].transpose(1, 2).reshape(b * n, hkv, d).contiguous()
        vt = tail_v[:, :, r - n :].transpose(1, 2).reshape(b * n, hkv, d).contiguous()
        rows = torch.arange(r - n, r, device=dev)
        slots = (torch.arange(b, device=dev)[:, None] * g + rows[None, :]).flatten()
        kvarn_ops.store(kt, vt, slots, self.pool_k, self.pool_v)

    def _block_table(self, b: int, tiles: int, device: torch.device) -> torch.Tensor:
        if self._table is None or self._table[0] != tiles:
            n = max(tiles, 1)  # a request with no full tile still has a table row
            table = torch.arange(b * n, dtype=torch.int32, device=device).view(b, n)
            self._table = (tiles, table)
        return self._table[1]

    def _workspace(self, b: int, hq: int, length: int, device: torch.device) -> torch.Tensor:
        import kvarn_ops

        if self._ws is not None:
            (wb, whq, cap), ws = self._ws
            if wb == b and whq == hq and length <= cap:
                return ws
        cap = max(4096, 1 << max(0, (length - 1).bit_length()))
        hkv, d = self.pool_k.shape[2], self.pool_k.shape[3]
        ws = kvarn_ops.decode_workspace(
            b, 1, hq, hkv, d, cap, self.layout.block_size, device=device
        )
        self._ws = ((b, hq, cap), ws)
        return ws

    def attend(
        self, records: torch.Tensor, length: int, query: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention ``[B, 1, Hq, D]`` (SDPA's output layout) of one query token a row
        ``query`` ``[B, Hq, 1, D]`` over ``length`` cached tokens: ``records``
        ``[B, tiles, Hkv, R]`` (``tiles = length // G``) and the pool's tail."""
        import kvarn_ops

        b, tiles, hkv, r = records.shape
        dev = query.device
        q = query.transpose(1, 2).contiguous()
        packed = records.view(b * tiles, hkv, r) if tiles else records.new_zeros((1, hkv, r))
        seq_lens = torch.full((b,), length, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        ws = self._workspace(b, q.shape[2], length, dev)
        kvarn_ops.decode(
            q, packed, self._block_table(b, tiles, dev), seq_lens, self.pool_k, self.pool_v,
            None, None, self._rows, self.layout, scale, out, ws,
        )  # fmt: skip
        return out

    def select(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (beam reorder, batch selection)."""
        idx = indices.to(self.pool_k.device)
        self.pool_k, self.pool_v = self.pool_k[idx], self.pool_v[idx]
        self._reset_rows()

    def _reset_rows(self) -> None:
        b = self.pool_k.shape[0]
        self._rows = torch.arange(b, dtype=torch.int32, device=self.pool_k.device)
        self._table = self._ws = None

    def repeat(self, repeats: int) -> None:
        self.pool_k = self.pool_k.repeat_interleave(repeats, dim=0)
        self.pool_v = self.pool_v.repeat_interleave(repeats, dim=0)
        self._reset_rows()
