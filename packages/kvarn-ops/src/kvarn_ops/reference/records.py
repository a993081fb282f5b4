"""Whole dense records: writing every field at the offsets of a kvarn-formats layout and
reading them back.

A record holds one tile (G tokens of one KV head); fields and dequantization are those of
docs/contracts.md. fp16 fields are stored little-endian; bytes not covered by a field
(alignment padding) are written as zeros.

Memory traffic per record: ``encode_records`` reads ``2 * G * D * 4`` bytes (fp32 K and V)
and writes ``R = layout.record_bytes``; ``decode_records`` reads ``R`` and writes
``2 * G * D * 4``.
"""

from __future__ import annotations

import torch

from kvarn_formats import Field, RecordLayout
from kvarn_ops._validate import MODEL_DTYPES, check_dense_layout, check_tensor
from kvarn_ops.reference.bitpack import pack_codes, unpack_codes
from kvarn_ops.reference.quantize import (
    DEFAULT_CONFIG,
    NormalizeConfig,
    dequantize_k,
    dequantize_v,
    quantize_k,
    quantize_v,
)

__all__ = [
    "FIELD_NAMES",
    "decode_records",
    "encode_records",
    "field_bytes",
    "fields_to_records",
    "record_fields",
]

FIELD_NAMES = (
    "k_codes",
    "k_col_scale",
    "k_zero_point",
    "k_row_scale",
    "v_codes",
    "v_col_scale",
    "v_row_scale",
    "v_zero_point",
)
"""The fields of a dense record (docs/contracts.md)."""


def _bits(f: Field) -> int:
    if f.bits is None:  # pragma: no cover - kvarn-formats sets bits on every codes field
        raise ValueError(f"layout: codes field {f.name} has no bit width")
    return f.bits


def field_bytes(records: torch.Tensor, layout: RecordLayout, name: str) -> torch.Tensor:
    """The raw bytes of field ``name`` of every record: a uint8 view ``[..., field.size]``
    of ``records [..., R]`` (writing to it writes the records)."""
    f = layout.field(name)
    return records[..., f.offset : f.offset + f.size]


def _fp16_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 ``[..., n]`` -> uint8 ``[..., 2n]``, little-endian."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack((bits & 0xFF, bits >> 8), dim=-1).reshape(*x.shape[:-1], -1).to(torch.uint8)


def _bytes_to_fp16(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2n]`` little-endian -> float16 ``[..., n]``."""
    pairs = b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2).to(torch.int32)
    bits = pairs[..., 0] | (pairs[..., 1] << 8)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.float16)


def fields_to_records(
    fields: dict, layout: RecordLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Write decoded fields (as returned by :func:`record_fields`) into records ``[N, R]``.

    Codes fields are uint8 ``[N, *field.shape]``, scale fields float16 ``[N, *field.shape]``.
    Padding bytes are zeroed. ``out`` (uint8 ``[N, R]``, contiguous) is written in place when
    given.
    """
    n = fields["k_codes"].shape[0]
    r = layout.record_bytes
    if out is None:
        out = torch.empty(n, r, dtype=torch.uint8, device=fields["k_codes"].device)
    else:
        check_tensor("out", out, dtypes=torch.uint8, shape=(n, r))
    covered = torch.zeros(r, dtype=torch.bool)
    for name in FIELD_NAMES:
        f = layout.field(name)
        val = fields[name]
        if f.dtype == "codes":
            data = pack_codes(val.reshape(n, -1), _bits(f))
        elif f.dtype == "float16":
            data = _fp16_to_bytes(val.reshape(n, -1).to(torch.float16))
        else:  # pragma: no cover - dense layouts have only codes and float16 fields
            raise ValueError(f"layout: field {name} has unsupported dtype {f.dtype}")
        if data.shape[-1] != f.size:
            raise ValueError(f"layout: field {name} is {f.size} bytes, data is {data.shape[-1]}")
        out[:, f.offset : f.end] = data
        covered[f.offset : f.end] = True
    pad = (~covered).nonzero().flatten()
    if pad.numel():
        out[:, pad.to(out.device)] = 0
    return out


def encode_records(
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RecordLayout,
    *,
    out: torch.Tensor | None = None,
    config: NormalizeConfig = DEFAULT_CONFIG,
    sink_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize N (K tile, V tile) pairs into N dense records.

    Parameters
    ----------
    k, v : Tensor [N, G, D], float32 (float16/bfloat16 accepted), rotated frame, token-major.
        A token holding any NaN/Inf is quantized as zeros (see ``quantize``).
    layout : kvarn_formats.RecordLayout, dense, with ``block_size == G``, ``head_dim == D``.
    out : uint8 [N, R], optional; written in place (every byte) and returned.
    config : NormalizeConfig; the ops always use the default.
    sink_rows : int32/int64 [N] or None; the token of each tile that is the attention sink
        (a request's first token: 0 in its first block), -1 for none. With
        ``config.sink_token`` that token's V row is kept almost exact (``reference/sink.py``),
        and at 2-bit K its key is on every channel's grid (``reference/sink_key.py``).

    Returns
    -------
    uint8 [N, R], ``R = layout.record_bytes``.
    """
    check_tensor("k", k, dtypes=MODEL_DTYPES, ndim=3)
    check_dense_layout("layout", layout, head_dim=k.shape[-1])
    n, g, d = k.shape
    if g != layout.block_size:
        raise ValueError(
            f"k: tiles of {g} tokens, but layout {layout.format_name!r} has {layout.block_size}"
        )
    check_tensor("v", v, dtypes=MODEL_DTYPES, shape=(n, g, d), device=k.device)
    if out is not None:
        check_tensor(
            "out", out, dtypes=torch.uint8, shape=(n, layout.record_bytes), device=k.device
        )
    fields = quantize_k(k, _bits(layout.field("k_codes")), config, sink_rows)
    fields.update(quantize_v(v, _bits(layout.field("v_codes")), config, sink_rows))
    return fields_to_records(fields, layout, out)


def record_fields(records: torch.Tensor, layout: RecordLayout) -> dict:
    """Every field of records ``[N, R]``, decoded: codes as uint8 ``[N, *shape]`` (K codes
    ``[N, D, G]``, V codes ``[N, G, D]``), scales as float16 ``[N, *shape]``."""
    check_tensor("records", records, dtypes=torch.uint8, ndim=2, contiguous=False)
    check_dense_layout("layout", layout)
    if records.shape[1] != layout.record_bytes:
        raise ValueError(
            f"records: expected {layout.record_bytes} bytes per record for "
            f"{layout.format_name!r} head_dim {layout.head_dim}, got {records.shape[1]}"
        )
    n = records.shape[0]
    fields = {}
    for name in FIELD_NAMES:
        f = layout.field(name)
        raw = field_bytes(records, layout, name)
        if f.dtype == "codes":
            val = unpack_codes(raw, _bits(f), f.count)
        else:
            val = _bytes_to_fp16(raw)
        fields[name] = val.reshape(n, *f.shape)
    return fields


def decode_records(
    records: torch.Tensor, layout: RecordLayout, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize records ``[N, R]`` into ``(k, v)``, ``[N, G, D]`` rotated frame, computed in
    ``dtype`` (float32, or float64 for an oracle)."""
    fields = record_fields(records, layout)
    return dequantize_k(fields, dtype), dequantize_v(fields, dtype)
