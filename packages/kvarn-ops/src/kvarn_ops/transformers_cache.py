"""A transformers ``Cache`` whose layers keep their keys and values as KVarN records.

``model.generate(..., past_key_values=KvarnCache("kvarn_k4v2_g64", model.config))`` (or any
loop that passes the cache to the model) stores each layer's full ``G``-token tiles as the
format's records, the bytes ``kvarn_formats`` lays out (for ``kvarn_k4v2_g64`` at head_dim
128: 114 bytes per token and KV head against bf16's 512), and only the tile still filling as
exact tokens in the model's dtype. Every ``update`` returns what a query sees in the vLLM
plugin: the packed tiles dequantized (model frame), then the filling tile's tokens and the
call's new tokens exact. A tile is packed once it is full, after the call that filled it has
returned its keys and values, so every query sees its own tile exact; the first token of a
sequence is its attention sink (``sink_rows``: its V row is kept almost exact and, at 2-bit
K, its key is on every channel's grid), as in the plugin.

Plain torch (:mod:`kvarn_ops.reference`): it runs wherever torch does (tested on the CPU), and
its records are byte for byte the reference's. Each update dequantizes every packed tile of the
layer, as transformers' own quantized caches do, so a step's time grows with the context; the
Triton kernels serve the vLLM path. Needs transformers 5 (the ``eval`` extra).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

import kvarn_formats as kf
from kvarn_ops.reference.hadamard import hadamard
from kvarn_ops.reference.records import decode_records, encode_records

__all__ = ["KvarnCache", "KvarnLayer"]


def _dense_format(format_name: str) -> kf.DenseFormat:
    try:
        fmt = kf.parse_format(format_name)
    except kf.FormatError as exc:
        raise ValueError(f"format_name: {exc}") from None
    if not isinstance(fmt, kf.DenseFormat):
        raise ValueError(
            f"format_name: {format_name!r} is an MLA format; KvarnCache keeps dense K/V (a "
            "model with separate key and value heads)"
        )
    return fmt


class KvarnLayer(DynamicLayer):
    """One attention layer's cache: ``records`` uint8 ``[B, tiles, Hkv, R]`` (the packed
    tiles) and, as ``keys`` / ``values`` ``[B, Hkv, r, D]`` with ``r < G``, the exact tokens of
    the tile still filling (model frame)."""

    is_croppable = False

    def __init__(self, format_name: str) -> None:
        super().__init__()
        self.format = _dense_format(format_name)
        self.layout: kf.RecordLayout | None = None
        self.records: torch.Tensor | None = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        d = key_states.shape[-1]
        try:
            self.layout = kf.dense_layout(self.format, d)
        except kf.LayoutError as exc:
            raise ValueError(f"key_states: head_dim {d}: {exc}") from None
        super().lazy_initialization(key_states, value_states)
        b, hkv = key_states.shape[0], key_states.shape[1]
        self.keys = key_states.new_empty((b, hkv, 0, d))
        self.values = value_states.new_empty((b, hkv, 0, d))
        self.records = torch.empty(
            (b, 0, hkv, self.layout.record_bytes), dtype=torch.uint8, device=key_states.device
        )

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.ndim != 4 or value_states.shape != key_states.shape:
            raise ValueError(
                "key_states, value_states: expected the same [batch, kv_heads, tokens, head_dim] "
                f"shape, got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if not key_states.is_floating_point() or value_states.dtype != key_states.dtype:
            raise ValueError(
                f"key_states, value_states: one floating dtype expected, got {key_states.dtype} "
                f"and {value_states.dtype}"
            )
        if self.is_initialized:
            assert self.keys is not None
            want = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])
            got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
            if got != want or key_states.dtype != self.keys.dtype:
                raise ValueError(
                    f"key_states: batch, kv_heads, head_dim {got} and dtype {key_states.dtype} "
                    f"differ from the cache's {want} and {self.keys.dtype}"
                )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, Hkv, T, D]`` new tokens; return every cached token's keys and values as
        the queries of this call see them (packed tiles dequantized, the rest exact)."""
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        packed_k, packed_v = self.dequantized()
        keys = torch.cat((self.keys, key_states), dim=-2)
        values = torch.cat((self.values, value_states), dim=-2)
        out = torch.cat((packed_k, keys), dim=-2), torch.cat((packed_v, values), dim=-2)
        self._pack(keys, values)
        self.cumulative_length += key_states.shape[-2]
        return out

    def _pack(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode the full tiles of ``keys`` / ``values`` (the filling tile and the new
        tokens) into records; keep the rest exact."""
        assert self.layout is not None and self.records is not None
        g = self.layout.block_size
        b, hkv, n, d = keys.shape
        tiles = n // g
        if tiles:
            first = self.records.shape[1]
            k = hadamard(keys[:, :, : tiles * g].float()).reshape(b, hkv, tiles, g, d)
            v = hadamard(values[:, :, : tiles * g].float()).reshape(b, hkv, tiles, g, d)
            # records [B, tiles, Hkv] in that order: tiles of one head are rows of K/V above
            k = k.permute(0, 2, 1, 3, 4).reshape(-1, g, d)
            v = v.permute(0, 2, 1, 3, 4).reshape(-1, g, d)
            sink = torch.full((b, tiles, hkv), -1, dtype=torch.int32, device=keys.device)
            if first == 0:
                sink[:, 0] = 0  # the sequence's first token: its attention sink
            rec = encode_records(k, v, self.layout, sink_rows=sink.flatten())
            self.records = torch.cat((self.records, rec.view(b, tiles, hkv, -1)), dim=1)
        self.keys = keys[:, :, tiles * g :].contiguous()
        self.values = values[:, :, tiles * g :].contiguous()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed tiles' keys and values ``[B, Hkv, tiles * G, D]``, model frame, in the
        cache's dtype."""
        assert self.layout is not None and self.records is not None and self.keys is not None
        b, tiles, hkv, r = self.records.shape
        g, d = self.layout.block_size, self.layout.head_dim
        if tiles == 0:
            return self.keys[:, :, :0], self.values[:, :, :0]
        k, v = decode_records(self.records.reshape(-1, r), self.layout)
        shape = (b, tiles, hkv, g, d)
        k = hadamard(k).view(shape).permute(0, 2, 1, 3, 4).reshape(b, hkv, tiles * g, d)
        v = hadamard(v).view(shape).permute(0, 2, 1, 3, 4).reshape(b, hkv, tiles * g, d)
        return k.to(self.keys.dtype), v.to(self.keys.dtype)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes this layer holds: its records and its exact tokens."""
        if not self.is_initialized:
            return 0
        assert self.records is not None and self.keys is not None and self.values is not None
        exact = self.keys.numel() * self.keys.element_size() * 2
        return self.records.numel() + exact

    def reset(self) -> None:
        super().reset()
        self.records = None
        self.layout = None

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "KvarnCache cannot be cropped: its packed tiles are not cut at token boundaries "
            "(assisted generation and contrastive search need a croppable cache)"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            assert self.records is not None and self.keys is not None
            assert self.values is not None
            self.records = self.records.repeat_interleave(repeats, dim=0)
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            assert self.records is not None and self.keys is not None
            assert self.values is not None
            self.records = self.records[indices.to(self.records.device)]
            self.keys = self.keys[indices.to(self.keys.device)]
            self.values = self.values[indices.to(self.values.device)]

    def offload(self) -> None:
        if self.is_initialized:
            assert self.records is not None
            super().offload()
            self.records = self.records.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized:
            assert self.records is not None
            super().prefetch()
            self.records = self.records.to(self.device, non_blocking=True)


class KvarnCache(Cache):
    """A transformers cache holding KVarN records (see the module's docstring).

    Parameters
    ----------
    format_name : a dense kvarn format, e.g. ``"kvarn_k4v2_g64"``.
    config : the model's config (its text config's ``num_hidden_layers`` layers, all of them
        full attention: sliding-window layers would drop tokens the records keep).
    """

    def __init__(self, format_name: str, config: Any) -> None:
        _dense_format(format_name)
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or ["full_attention"]
        other = sorted(set(types) - {"full_attention"})
        if other:
            raise ValueError(
                f"config: KvarnCache serves full-attention layers only; this model has {other}"
            )
        self.format_name = format_name
        super().__init__(layers=[KvarnLayer(format_name) for _ in range(text.num_hidden_layers)])

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's records and exact tokens."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, KvarnLayer))
