"""A transformers ``Cache`` whose layers keep their keys and values as KVarN records.

``model.generate(..., past_key_values=KvarnCache("kvarn_k4v2_g64", model.config))`` (or any
loop that passes the cache to the model) stores each layer's full ``G``-token tiles as the
format's records, the bytes ``kvarn_formats`` lays out (for ``kvarn_k4v2_g64`` at head_dim
128: 114 bytes per token and KV head against bf16's 512), and only the tile still filling as
exact tokens in the model's dtype. Every ``update`` returns what a query sees in the vLLM
plugin: the packed tiles dequantized (model frame), then the filling tile's tokens and the
call's new tokens exact. A tile is packed once it is full, after the call that filled it has
returned its keys and values, so every query sees its own tile exact (as ``kvarn-eval``'s
teacher-forced pass; the plugin's decode step whose token completes a tile reads that tile
quantized, as the ``"kvarn"`` attention below does); the first token of a
sequence is its attention sink (``sink_rows``: its V row is kept almost exact and, at 2-bit
K, its key is on every channel's grid), as in the plugin.

Two backends (``backend=``, :mod:`kvarn_ops.cache_codec`): ``"reference"``, plain torch on
any device and dtype, records byte for byte ``reference.encode_records`` of the tiles rotated
in fp32 and held in the model's dtype (as the serving path's exact pool holds them);
``"kernels"``, the serving path's Triton ops (the tokens rotated into a bf16/fp16 pool,
packed by ``flush``, read back by one ``materialize`` launch a layer), for bfloat16/float16
models on a CUDA device; ``"auto"`` (the default) takes the kernels where they apply. Each
update dequantizes every packed tile of the layer, as transformers' own quantized caches do,
so a step's time grows with the context. Needs transformers 5 (the ``eval`` extra).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

import kvarn_formats as kf
from kvarn_ops.cache_codec import BACKENDS, choose_backend, decode_tiles, encode_tiles
from kvarn_ops.transformers_decode import ATTENTION_NAME, PackedDecode, register_attention

__all__ = ["KvarnCache", "KvarnLayer"]

register_attention()  # model.set_attn_implementation("kvarn") works once this module is imported


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
    the tile still filling (model frame). With ``packed_decode`` (the model's attention is
    ``"kvarn"``, :mod:`kvarn_ops.transformers_decode`) one-token steps return handles the
    ``"kvarn"`` attention reads the records through, not the dequantized context."""

    is_croppable = False

    def __init__(
        self, format_name: str, backend: str = "auto", packed_decode: bool = False
    ) -> None:
        super().__init__()
        self.format = _dense_format(format_name)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if packed_decode and backend == "reference":
            raise ValueError(
                "backend: 'reference' cannot serve the 'kvarn' attention (its decode steps run "
                "the decode kernel over the records); use 'auto' or 'kernels'"
            )
        self.requested_backend = "kernels" if packed_decode else backend
        self.packed_decode = packed_decode
        self.decoder: PackedDecode | None = None
        self.backend: str | None = None  # chosen from the first K/V (kvarn_ops.cache_codec)
        self.layout: kf.RecordLayout | None = None
        self.records: torch.Tensor | None = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        d = key_states.shape[-1]
        try:
            self.layout = kf.dense_layout(self.format, d)
        except kf.LayoutError as exc:
            raise ValueError(f"key_states: head_dim {d}: {exc}") from None
        self.backend = choose_backend(self.requested_backend, key_states)
        super().lazy_initialization(key_states, value_states)
        b, hkv = key_states.shape[0], key_states.shape[1]
        self.keys = key_states.new_empty((b, hkv, 0, d))
        self.values = value_states.new_empty((b, hkv, 0, d))
        self.records = torch.empty(
            (b, 0, hkv, self.layout.record_bytes), dtype=torch.uint8, device=key_states.device
        )
        if self.packed_decode:
            self.decoder = PackedDecode(key_states, self.layout)

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
        t = key_states.shape[-2]
        keys = torch.cat((self.keys, key_states), dim=-2)
        values = torch.cat((self.values, value_states), dim=-2)
        if self.decoder is not None and t == 1:
            # the serving order: store, pack a tile this token fills, then the query reads
            self._pack(keys, values)
            self.cumulative_length += t
            self.decoder.write(self.keys, self.values, t)
            handle_k, handle_v = key_states.view_as(key_states), value_states.view_as(value_states)
            handle_k._kvarn_layer = self  # type: ignore[attr-defined]
            return handle_k, handle_v
        packed_k, packed_v = self.dequantized()
        out = torch.cat((packed_k, keys), dim=-2), torch.cat((packed_v, values), dim=-2)
        self._pack(keys, values)
        self.cumulative_length += t
        if self.decoder is not None:
            self.decoder.write(self.keys, self.values, t)
        return out

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The ``"kvarn"`` attention of a one-token step (:mod:`kvarn_ops.transformers_decode`):
        ``[B, 1, Hq, D]`` from ``query`` ``[B, Hq, 1, D]`` over the records and the pool."""
        if self.decoder is None or self.records is None:
            raise ValueError("query: this KvarnLayer was not built for the 'kvarn' attention")
        if query.shape[2] != 1:
            raise ValueError(f"query: one token a row expected, got {query.shape[2]}")
        return self.decoder.attend(self.records, self.cumulative_length, query, scale)

    def full_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token's keys and values (packed tiles dequantized, the rest exact)."""
        assert self.keys is not None and self.values is not None
        packed_k, packed_v = self.dequantized()
        return torch.cat((packed_k, self.keys), dim=-2), torch.cat((packed_v, self.values), dim=-2)

    def _pack(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode the full tiles of ``keys`` / ``values`` (the filling tile and the new
        tokens) into records; keep the rest exact."""
        assert self.layout is not None and self.records is not None
        assert self.backend is not None
        g = self.layout.block_size
        tiles = keys.shape[-2] // g
        if tiles:
            first = self.records.shape[1] == 0
            rec = encode_tiles(
                keys[:, :, : tiles * g], values[:, :, : tiles * g], self.layout, first,
                self.backend,
            )  # fmt: skip
            self.records = torch.cat((self.records, rec), dim=1)
        self.keys = keys[:, :, tiles * g :].contiguous()
        self.values = values[:, :, tiles * g :].contiguous()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed tiles' keys and values ``[B, Hkv, tiles * G, D]``, model frame, in the
        cache's dtype."""
        assert self.layout is not None and self.records is not None and self.keys is not None
        assert self.backend is not None
        if self.records.shape[1] == 0:
            return self.keys[:, :, :0], self.values[:, :, :0]
        return decode_tiles(self.records, self.layout, self.keys.dtype, self.backend)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes this layer holds: its records and its exact tokens."""
        if not self.is_initialized:
            return 0
        assert self.records is not None and self.keys is not None and self.values is not None
        exact = self.keys.numel() * self.keys.element_size() * 2
        if self.decoder is not None:  # the filling tile again, rotated, a whole tile a row
            exact += self.decoder.pool_k.numel() * self.decoder.pool_k.element_size() * 2
        return self.records.numel() + exact

    def reset(self) -> None:
        super().reset()
        self.records = None
        self.layout = None
        self.decoder = None

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
            if self.decoder is not None:
                self.decoder.repeat(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            assert self.records is not None and self.keys is not None
            assert self.values is not None
            self.records = self.records[indices.to(self.records.device)]
            self.keys = self.keys[indices.to(self.keys.device)]
            self.values = self.values[indices.to(self.values.device)]
            if self.decoder is not None:
                self.decoder.select(indices)

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
    backend : ``"auto"`` (default), ``"reference"`` or ``"kernels"``
        (:mod:`kvarn_ops.cache_codec`).

    A model whose attention implementation is ``"kvarn"`` (``model.set_attn_implementation(
    "kvarn")``, registered when this module is imported) when the cache is built gets its
    one-token steps from the records through ``kvarn_ops.decode``
    (:mod:`kvarn_ops.transformers_decode`); that needs the kernels backend.
    """

    def __init__(self, format_name: str, config: Any, backend: str = "auto") -> None:
        _dense_format(format_name)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or ["full_attention"]
        other = sorted(set(types) - {"full_attention"})
        if other:
            raise ValueError(
                f"config: KvarnCache serves full-attention layers only; this model has {other}"
            )
        self.format_name = format_name
        self._text_config = text
        self.packed_decode = getattr(text, "_attn_implementation", None) == ATTENTION_NAME
        if self.packed_decode and backend == "reference":
            raise ValueError(
                "backend: 'reference' cannot serve the model's 'kvarn' attention (its decode "
                "steps run the decode kernel over the records); use 'auto' or 'kernels'"
            )
        super().__init__(
            layers=[
                KvarnLayer(format_name, backend, self.packed_decode)
                for _ in range(text.num_hidden_layers)
            ]
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        now = getattr(self._text_config, "_attn_implementation", None) == ATTENTION_NAME
        if now != self.packed_decode:
            raise ValueError(
                "config: the model's attention implementation changed after this KvarnCache "
                "was built (the 'kvarn' attention and the cache go together); build a new cache"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's records and exact tokens."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, KvarnLayer))
