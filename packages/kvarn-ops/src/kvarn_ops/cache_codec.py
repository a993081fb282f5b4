"""Full tiles of a ``[batch, kv_heads, tokens, head_dim]`` K/V stream to KVarN records and
back, through the reference or the Triton kernels (the codec of ``transformers_cache``).

Records are uint8 ``[B, tiles, Hkv, R]``: tile ``t`` of batch row ``b`` and KV head ``h`` is
record ``[b, t, h]``, tokens ``t * G .. t * G + G - 1`` of that row. A row's first tile may
carry its attention sink (token 0: ``first=True``), as the serving plugin's first block does.

Two backends, one contract:

- ``"reference"``: :func:`kvarn_ops.reference.encode_records` of the tiles rotated in fp32
  and rounded to the K/V's dtype (what the serving path's exact pool holds), and
  :func:`~kvarn_ops.reference.decode_records`; any device and dtype.
- ``"kernels"``: the serving path's ops: ``store`` (rotation into a bf16/fp16 exact pool),
  ``flush`` (records; codes as the reference's for >= 99.9% of the values, see
  ``tests/test_flush.py``) and ``materialize`` (one launch dequantizes every record of a
  layer). bfloat16/float16 K/V on a CUDA device (or the Triton interpreter).

``"auto"`` takes the kernels for bfloat16/float16 CUDA tensors when Triton imports, the
reference otherwise.
"""

from __future__ import annotations

import os

import torch

import kvarn_formats as kf
from kvarn_ops.reference.hadamard import hadamard
from kvarn_ops.reference.records import decode_records, encode_records

__all__ = ["BACKENDS", "choose_backend", "decode_tiles", "encode_tiles"]

BACKENDS = ("auto", "reference", "kernels")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_imports() -> bool:
    try:
        import kvarn_ops.kernels  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def choose_backend(backend: str, like: torch.Tensor) -> str:
    """``"reference"`` or ``"kernels"`` for K/V tensors like ``like`` (see the module's
    docstring); ``backend="kernels"`` on tensors the kernels cannot take raises ValueError
    naming ``key_states``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "kernels":
        if like.dtype not in _KERNEL_DTYPES:
            raise ValueError(
                f"key_states: backend='kernels' takes bfloat16 or float16 K/V, got {like.dtype}"
            )
        if like.device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"key_states: backend='kernels' needs CUDA tensors (or TRITON_INTERPRET=1), got "
                f"a {like.device.type} tensor"
            )
        if not _triton_imports():
            raise ValueError("backend: 'kernels' needs Triton (kvarn_ops.kernels did not import)")
        return "kernels"
    usable = like.dtype in _KERNEL_DTYPES and like.device.type == "cuda"
    return "kernels" if usable and _triton_imports() else "reference"


def _sink_rows(b: int, tiles: int, first: bool, device: torch.device) -> torch.Tensor:
    """int32 [B * tiles]: 0 for each row's first tile when ``first``, else -1."""
    sink = torch.full((b, tiles), -1, dtype=torch.int32, device=device)
    if first:
        sink[:, 0] = 0
    return sink.flatten()


def encode_tiles(
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: kf.RecordLayout,
    first: bool,
    backend: str,
) -> torch.Tensor:
    """Records uint8 ``[B, n // G, Hkv, R]`` of the full tiles of ``keys``/``values``
    ``[B, Hkv, n, D]`` (model frame; ``n`` a multiple of ``G``). ``first``: the tiles start
    at each row's token 0 (its first tile holds the attention sink)."""
    g = layout.block_size
    b, hkv, n, d = keys.shape
    tiles = n // g
    if n != tiles * g:
        raise ValueError(f"keys: {n} tokens is not a whole number of {g}-token tiles")
    if backend == "reference":
        # rotated in fp32 and held in the model's dtype, as the serving path's exact pool
        # holds them (a no-op for float32 models)
        k = hadamard(keys.float()).to(keys.dtype).float().reshape(b, hkv, tiles, g, d)
        v = hadamard(values.float()).to(values.dtype).float().reshape(b, hkv, tiles, g, d)
        # records [B, tiles, Hkv]: the tiles of one row and head are consecutive token runs
        k = k.permute(0, 2, 1, 3, 4).reshape(-1, g, d)
        v = v.permute(0, 2, 1, 3, 4).reshape(-1, g, d)
        sink = _sink_rows(b, tiles, first, keys.device).repeat_interleave(hkv)
        return encode_records(k, v, layout, sink_rows=sink).view(b, tiles, hkv, -1)
    import kvarn_ops

    # the serving path: rotate into an exact pool of the model's dtype, one block per tile
    nblk = b * tiles
    pool_k = torch.empty((nblk, g, hkv, d), dtype=keys.dtype, device=keys.device)
    pool_v = torch.empty_like(pool_k)
    kt = keys.transpose(1, 2).reshape(nblk * g, hkv, d).contiguous()
    vt = values.transpose(1, 2).reshape(nblk * g, hkv, d).contiguous()
    slots = torch.arange(nblk * g, dtype=torch.int64, device=keys.device)
    kvarn_ops.store(kt, vt, slots, pool_k, pool_v)
    packed = torch.empty((nblk, hkv, layout.record_bytes), dtype=torch.uint8, device=keys.device)
    blocks = torch.arange(nblk, dtype=torch.int32, device=keys.device)
    sink = _sink_rows(b, tiles, first, keys.device)
    kvarn_ops.flush(pool_k, pool_v, None, None, blocks, blocks, packed, layout, sink)
    return packed.view(b, tiles, hkv, -1)


def decode_tiles(
    records: torch.Tensor, layout: kf.RecordLayout, dtype: torch.dtype, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, Hkv, tiles * G, D]`` (model frame, ``dtype``) of records uint8
    ``[B, tiles, Hkv, R]``."""
    b, tiles, hkv, r = records.shape
    g, d = layout.block_size, layout.head_dim
    if backend == "reference" or tiles == 0:
        shape = (b, tiles, hkv, g, d)
        k, v = decode_records(records.reshape(-1, r), layout)
        k = hadamard(k).view(shape).permute(0, 2, 1, 3, 4).reshape(b, hkv, tiles * g, d)
        v = hadamard(v).view(shape).permute(0, 2, 1, 3, 4).reshape(b, hkv, tiles * g, d)
        return k.to(dtype), v.to(dtype)
    import kvarn_ops

    dev = records.device
    n = tiles * g
    i32 = torch.int32
    k_out = torch.empty((b * n, hkv, d), dtype=dtype, device=dev)
    v_out = torch.empty_like(k_out)
    # no exact tail here: a one-block pool the kernel never reads (every length is whole tiles)
    pool = torch.zeros((1, g, hkv, d), dtype=dtype, device=dev)
    kvarn_ops.materialize(
        records.reshape(b * tiles, hkv, r),
        torch.arange(b * tiles, dtype=i32, device=dev).view(b, tiles),
        torch.full((b,), n, dtype=i32, device=dev),
        pool,
        pool,
        None,
        None,
        torch.zeros((b,), dtype=i32, device=dev),
        layout,
        k_out,
        v_out,
        torch.arange(0, (b + 1) * n, n, dtype=i32, device=dev),
    )
    return k_out.view(b, n, hkv, d).transpose(1, 2), v_out.view(b, n, hkv, d).transpose(1, 2)
