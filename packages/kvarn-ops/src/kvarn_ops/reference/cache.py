"""The paged cache: the exact pool (store), packing full blocks (flush), reading a request's
context back (gather_context, materialize).

Shapes (docs/contracts.md): ``packed`` uint8 ``[num_blocks, Hkv, R]``; exact pool
``exact_k``/``exact_v`` ``[P, G, Hkv, D]`` float16/bfloat16/float8_e4m3fn, rotated frame,
with float32 ``k_scale``/``v_scale`` ``[P, G, Hkv]`` for fp8 (value = fp8 * scale).

Memory traffic (E = pool element bytes, s = 4 if fp8 else 0, Hkv heads, D head_dim):

- ``store``: read ``T*Hkv*D*(bytes of k + bytes of v) + 8T``; write ``2*T'*Hkv*(D*E + s)`` for
  the T' tokens with a slot.
- ``flush``: read ``2*N*G*Hkv*(D*E + s) + 8N``; write ``N*Hkv*R``.
- ``materialize``: read ``sum_b(floor(L_b/G))*Hkv*R + sum_b(L_b mod G)*2*Hkv*(D*E + s)`` plus the
  used block-table entries; write ``2*sum_b(L_b)*Hkv*D*bytes(k_out)``.
"""

from __future__ import annotations

import torch

from kvarn_formats import RecordLayout
from kvarn_ops._validate import (
    FP8_MAX,
    MODEL_DTYPES,
    check_dense_layout,
    check_index_range,
    check_pool,
    check_tensor,
)
from kvarn_ops.reference.hadamard import hadamard
from kvarn_ops.reference.records import decode_records, encode_records

__all__ = [
    "check_context_args",
    "check_flush_args",
    "check_store_args",
    "flush",
    "gather_context",
    "materialize",
    "quantize_pool_tokens",
    "read_pool_blocks",
    "store",
]


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a pool tensor, so indexed copies move bits (fp8 has no index_put)."""
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def quantize_pool_tokens(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round rotated tokens ``x [..., D]`` (fp32) to the pool dtype.

    Returns ``(values, scale)``: for float8_e4m3fn ``scale = amax(|x|) / 448`` per token
    (1.0 when amax is 0) and ``values = clamp(x / scale, -448, 448)`` rounded to nearest
    even e4m3; otherwise ``values = x`` rounded to ``dtype`` and ``scale = None``.
    """
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype), None
    amax = x.abs().amax(dim=-1)
    # Tensor / tensor: a correctly rounded division on every device (CUDA turns division by
    # a Python scalar into a multiplication by its reciprocal, one bit off half the time).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    vals = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return vals, scale


def read_pool_blocks(
    exact: torch.Tensor,
    scale: torch.Tensor | None,
    blocks: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Pool blocks ``blocks [N]`` of ``exact [P, G, Hkv, D]`` as ``[N, G, Hkv, D]`` in ``dtype``
    (float32 or float64; rotated frame; fp8 values multiplied by their per-token scale)."""
    idx = blocks.to(torch.long)
    vals = _bits_view(exact)[idx].view(exact.dtype).to(dtype)
    if scale is not None:
        vals = vals * scale[idx][..., None].to(dtype)
    return vals


def check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_slots: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """The argument checks of ``store`` (this reference and the Triton kernel): ValueError
    naming the bad argument; the pool's ``(P, G, Hkv, D)``."""
    p, g, hkv, d = check_pool(exact_k, exact_v, k_scale, v_scale)
    dev = exact_k.device
    check_tensor("k", k, dtypes=MODEL_DTYPES, ndim=3, device=dev, contiguous="rows")
    t = k.shape[0]
    check_tensor("k", k, shape=(t, hkv, d), contiguous="rows")
    check_tensor("v", v, dtypes=MODEL_DTYPES, shape=(t, hkv, d), device=dev, contiguous="rows")
    check_tensor("pool_slots", pool_slots, dtypes=torch.int64, shape=(t,), device=dev)
    check_index_range("pool_slots", pool_slots, p * g, sentinel=-1)
    return p, g, hkv, d


def check_flush_args(
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    src_pool_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    packed: torch.Tensor,
    layout: RecordLayout,
    sink_rows: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """The argument checks of ``flush`` (this reference and the Triton kernel): ValueError
    naming the bad argument; ``(N, G, Hkv, D)``."""
    check_dense_layout("layout", layout)
    p, g, hkv, d = check_pool(exact_k, exact_v, k_scale, v_scale, layout=layout)
    dev = exact_k.device
    check_tensor("packed", packed, dtypes=torch.uint8, ndim=3, device=dev)
    nb = packed.shape[0]
    check_tensor("packed", packed, shape=(nb, hkv, layout.record_bytes))
    check_tensor("src_pool_blocks", src_pool_blocks, dtypes=torch.int32, ndim=1, device=dev)
    n = src_pool_blocks.shape[0]
    check_tensor("dst_blocks", dst_blocks, dtypes=torch.int32, shape=(n,), device=dev)
    check_index_range("src_pool_blocks", src_pool_blocks, p)
    check_index_range("dst_blocks", dst_blocks, nb)
    if sink_rows is not None:
        check_tensor("sink_rows", sink_rows, dtypes=torch.int32, shape=(n,), device=dev)
        check_index_range("sink_rows", sink_rows, g, sentinel=-1)
    return n, g, hkv, d


def store(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_slots: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate new tokens and write them into the exact pool.

    Parameters
    ----------
    k, v : Tensor [T, Hkv, D], float16/bfloat16/float32, model frame; each token's
        ``[Hkv, D]`` contiguous, tokens at any stride (slices of a fused QKV projection).
    pool_slots : int64 [T]; token i goes to pool block ``slot // G``, offset ``slot % G``;
        -1 skips the token. Two tokens with the same slot: which one lands is unspecified.
    exact_k, exact_v : [P, G, Hkv, D] pool (written); k_scale, v_scale : float32 [P, G, Hkv]
        for an fp8 pool (written), else None.

    Notes
    -----
    A token holding NaN/Inf stays non-finite in the pool, so ``flush`` quantizes it as zeros
    and a decode reading it as the exact tail gives NaN. fp8: a NaN element stays NaN and the
    token's scale is 1.0 (its amax is NaN, which is not > 0); with an infinite element the
    scale is inf, that element NaN and the others 0. fp16 pools overflow to Inf above 65504.
    """
    p, g, hkv, d = check_store_args(k, v, pool_slots, exact_k, exact_v, k_scale, v_scale)
    sel = pool_slots >= 0
    slots = pool_slots[sel]
    blk, off = slots // g, slots % g
    for x, pool, scale in ((k, exact_k, k_scale), (v, exact_v, v_scale)):
        vals, s = quantize_pool_tokens(hadamard(x)[sel], pool.dtype)
        _bits_view(pool)[blk, off] = _bits_view(vals)
        if scale is not None and s is not None:
            scale[blk, off] = s


def flush(
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    src_pool_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    packed: torch.Tensor,
    layout: RecordLayout,
    sink_rows: torch.Tensor | None = None,
) -> None:
    """Pack N full pool blocks into records: ``packed[dst_blocks[i], h] = record of pool block
    src_pool_blocks[i], KV head h`` for every h (normalize + quantize + fold + bit-pack).

    Parameters
    ----------
    exact_k, exact_v, k_scale, v_scale : the exact pool (read).
    src_pool_blocks, dst_blocks : int32 [N].
    packed : uint8 [num_blocks, Hkv, R] (written at ``dst_blocks`` only). Repeated entries in
        ``dst_blocks``: which record lands is unspecified.
    layout : dense kvarn_formats.RecordLayout matching the pool's G and D.
    sink_rows : int32 [N] or None; the attention-sink token of block i (0 in a request's
        first block), -1 for none: its V row is kept almost exact in every head's record
        (``reference/sink.py``). None: no block has one.
    """
    n, g, hkv, d = check_flush_args(
        exact_k, exact_v, k_scale, v_scale, src_pool_blocks, dst_blocks, packed, layout, sink_rows
    )
    if n == 0:
        return
    kt = read_pool_blocks(exact_k, k_scale, src_pool_blocks).permute(0, 2, 1, 3)
    vt = read_pool_blocks(exact_v, v_scale, src_pool_blocks).permute(0, 2, 1, 3)
    rec = encode_records(
        kt.reshape(n * hkv, g, d).contiguous(),
        vt.reshape(n * hkv, g, d).contiguous(),
        layout,
        sink_rows=None if sink_rows is None else sink_rows.repeat_interleave(hkv),
    )
    packed[dst_blocks.to(torch.long)] = rec.view(n, hkv, -1)


def check_context_args(
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    layout: RecordLayout,
    *,
    min_len: int = 0,
) -> tuple[int, int, int, int]:
    """Shared checks of decode/materialize; returns ``(B, G, Hkv, D)``."""
    check_dense_layout("layout", layout)
    p, g, hkv, d = check_pool(exact_k, exact_v, k_scale, v_scale, layout=layout)
    dev = exact_k.device
    check_tensor("packed", packed, dtypes=torch.uint8, ndim=3, device=dev)
    nb = packed.shape[0]
    check_tensor("packed", packed, shape=(nb, hkv, layout.record_bytes))
    check_tensor("block_table", block_table, dtypes=torch.int32, ndim=2, device=dev)
    b, max_blocks = block_table.shape
    check_tensor("seq_lens", seq_lens, dtypes=torch.int32, shape=(b,), device=dev)
    check_tensor("tail_pool_block", tail_pool_block, dtypes=torch.int32, shape=(b,), device=dev)
    if seq_lens.device.type == "cpu" and b:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < min_len:
            raise ValueError(f"seq_lens: every entry must be >= {min_len}, found {lo}")
        if hi // g > max_blocks:
            raise ValueError(
                f"seq_lens: a length of {hi} tokens needs {hi // g} full blocks, but block_table "
                f"has {max_blocks} columns"
            )
        used = torch.arange(max_blocks, device=dev)[None, :] < (seq_lens // g)[:, None]
        check_index_range("block_table", block_table, nb, used=used)
        check_index_range("tail_pool_block", tail_pool_block, p, used=seq_lens % g > 0)
    return b, g, hkv, d


def gather_context(
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    layout: RecordLayout,
    request: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every cached token of one request, dequantized in ``dtype`` (float32 or float64):
    ``(k, v)`` ``[L, Hkv, D]``, rotated frame (full blocks from their records, the ``L mod G``
    newest from the pool)."""
    g = layout.block_size
    hkv, d = packed.shape[1], layout.head_dim
    length = int(seq_lens[request])
    n_full, tail = divmod(length, g)
    blocks = block_table[request, :n_full].to(torch.long)
    records = packed[blocks].reshape(n_full * hkv, layout.record_bytes)
    k_full, v_full = decode_records(records, layout, dtype)
    k_ctx = k_full.view(n_full, hkv, g, d).permute(0, 2, 1, 3).reshape(n_full * g, hkv, d)
    v_ctx = v_full.view(n_full, hkv, g, d).permute(0, 2, 1, 3).reshape(n_full * g, hkv, d)
    if tail:
        pb = tail_pool_block[request : request + 1]
        k_ctx = torch.cat((k_ctx, read_pool_blocks(exact_k, k_scale, pb, dtype)[0, :tail]))
        v_ctx = torch.cat((v_ctx, read_pool_blocks(exact_v, v_scale, pb, dtype)[0, :tail]))
    return k_ctx, v_ctx


def materialize(
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    layout: RecordLayout,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> None:
    """Write every cached token of each request, dequantized, model frame, into
    ``k_out``/``v_out`` at rows ``cu_seqlens[b] .. cu_seqlens[b] + seq_lens[b]``.

    Parameters
    ----------
    packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block, layout :
        the paged cache, as for ``decode`` (``seq_lens`` int32 [B] may be 0).
    k_out, v_out : [total_tokens, Hkv, D] bfloat16 or float16 (written at those rows only).
    cu_seqlens : int32 [B + 1] (entry B is not read; conventionally the total).
    """
    b, g, hkv, d = check_context_args(
        packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block, layout
    )
    dev = exact_k.device
    check_tensor("k_out", k_out, dtypes=(torch.bfloat16, torch.float16), ndim=3, device=dev)
    total = k_out.shape[0]
    check_tensor("k_out", k_out, shape=(total, hkv, d))
    check_tensor("v_out", v_out, dtypes=(k_out.dtype,), shape=(total, hkv, d), device=dev)
    check_tensor("cu_seqlens", cu_seqlens, dtypes=torch.int32, shape=(b + 1,), device=dev)
    if cu_seqlens.device.type == "cpu" and b:
        start = cu_seqlens[:b]
        end = start.to(torch.int64) + seq_lens
        if bool((start < 0).any()) or bool((end > total).any()):
            raise ValueError(
                f"cu_seqlens: rows cu_seqlens[b] .. cu_seqlens[b] + seq_lens[b] must lie in "
                f"[0, {total}) of k_out"
            )
    for r in range(b):
        k_ctx, v_ctx = gather_context(
            packed,
            block_table,
            seq_lens,
            exact_k,
            exact_v,
            k_scale,
            v_scale,
            tail_pool_block,
            layout,
            r,
        )
        row, length = int(cu_seqlens[r]), k_ctx.shape[0]
        k_out[row : row + length] = hadamard(k_ctx)
        v_out[row : row + length] = hadamard(v_ctx)
