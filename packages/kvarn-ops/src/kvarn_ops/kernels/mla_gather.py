"""MLA gathers: remap logical top-k indices to physical slots, materialize tokens as bf16
``[N, 576]`` (model frame), and stage them as 656-byte fp8 records (rotated frame, byte-exact
against ``kvarn_ops.reference.mla.mla_stage_fp8``).

Memory traffic per gathered token (b code bits, E/s as the pool): read ``64*b + 128`` record
bytes plus the block's ``2*1024 + 2`` scale bytes (cached across tokens of a block) for a
packed token, or ``512*E + s + 128`` for a pool token, plus 8 (slot) + 4 (map) bytes; write
1152 (materialize) or 656 (stage) bytes. Remap: read ``4*T*K + 4*T`` + used block-table
entries, write ``8*T*K``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops._validate import check_index_range, check_tensor
from kvarn_ops.kernels._common import (
    cast_rne,
    check_device,
    rotate_rows,
    round_to_bf16,
    round_to_e4m3,
)
from kvarn_ops.kernels.mla_common import field_offsets, load_tokens, pool_views
from kvarn_ops.reference.mla import (
    GROUP,
    MLA_DIM,
    STAGED_BYTES,
    _check_gather,
)

__all__ = ["mla_materialize", "mla_remap_indices", "mla_stage_fp8"]

BLOCK_T = 16
"""Tokens per program (the smallest tl.dot M, for the rotation of materialize)."""


@triton.jit
def _mla_remap_kernel(
    idx_ptr, req_ptr, bt_ptr, out_ptr, K, bt_stride, max_blocks, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inb = j < K
    idx = tl.load(idx_ptr + row * K + tl.where(inb, j, 0), mask=inb, other=-1)
    req = tl.load(req_ptr + row).to(tl.int64)
    lb = tl.where(idx >= 0, idx, 0) // 64
    ok = (idx >= 0) & (lb < max_blocks)
    pb = tl.load(bt_ptr + req * bt_stride + tl.where(ok, lb, 0), mask=ok, other=0)
    phys = pb.to(tl.int64) * 64 + (tl.where(ok, idx, 0) % 64)
    tl.store(out_ptr + row * K + j, tl.where(ok, phys, -1), mask=inb)


@triton.jit
def _mla_gather_kernel(
    slots_ptr,
    N,
    num_slots,
    rec_ptr,
    rec16_ptr,
    map_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    out_ptr,
    out8_ptr,
    out32_ptr,
    out16_ptr,
    STAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = i < N
    i = tl.where(inb, i, 0)
    slot = tl.load(slots_ptr + i, mask=inb, other=-1)
    ok = inb & (slot >= 0) & (slot < num_slots)
    lat, rope = load_tokens(
        slot,
        ok,
        rec_ptr,
        rec16_ptr,
        map_ptr,
        pool_ptr,
        pscale_ptr,
        prope_ptr,
        BLOCK_T,
        BITS,
        CS_OFF,
        ZP_OFF,
        RS_OFF,
        ROPE_OFF,
        REC,
        FP8,
    )
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    if STAGE:
        # 656-byte record: e4m3 latent [0, 512), 4 fp32 scales [512, 528), bf16 RoPE [528, 656).
        x = tl.reshape(round_to_bf16(lat), [BLOCK_T, 4, 128])
        amax = tl.max(tl.abs(x), axis=2)
        scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
        q = tl.div_rn(x, tl.broadcast_to(scale[:, :, None], x.shape))
        q = round_to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
        q = tl.reshape(q, [BLOCK_T, 512])
        tl.store(out8_ptr + i[:, None] * 656 + d[None, :], q.to(tl.float8e4nv), mask=ok[:, None])
        c = tl.arange(0, 4)
        tl.store(out32_ptr + i[:, None] * 164 + 128 + c[None, :], scale, mask=ok[:, None])
        tl.store(out16_ptr + i[:, None] * 328 + 264 + r[None, :], rope, mask=ok[:, None])
    else:
        y = rotate_rows(lat, BLOCK_T, 512, False)
        tl.store(
            out_ptr + i[:, None] * 576 + d[None, :], cast_rne(y, tl.bfloat16), mask=ok[:, None]
        )
        tl.store(out16_ptr + i[:, None] * 576 + 512 + r[None, :], rope, mask=ok[:, None])


def _launch_gather(
    packed,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    slots,
    format_name: str,
    out,
    stage: bool,
) -> None:
    import kvarn_formats as kf

    n = slots.shape[0]
    if n == 0:
        return
    layout = kf.mla_layout(format_name)
    pl, ps, pr, fp8 = pool_views(pool_latent, pool_scale, pool_rope)
    if stage:
        o, o8, o32, o16 = (
            out,
            out.view(torch.float8_e4m3fn),
            out.view(torch.float32),
            out.view(torch.int16),
        )
    else:
        o, o8, o32, o16 = out, out, out, out.view(torch.int16)
    grid = (triton.cdiv(n, BLOCK_T),)
    _mla_gather_kernel[grid](
        slots,
        n,
        packed.shape[0] * GROUP,
        packed,
        packed.view(torch.int16),
        block_pool_map,
        pl,
        ps,
        pr,
        o,
        o8,
        o32,
        o16,
        STAGE=stage,
        BLOCK_T=BLOCK_T,
        FP8=fp8,
        num_warps=4,
        **field_offsets(layout),
    )


@torch.library.custom_op("kvarn::mla_materialize", mutates_args=("out",))
def _materialize_op(
    packed: torch.Tensor,
    block_pool_map: torch.Tensor,
    pool_latent: torch.Tensor,
    pool_scale: torch.Tensor | None,
    pool_rope: torch.Tensor,
    slots: torch.Tensor,
    format_name: str,
    out: torch.Tensor,
) -> None:
    _launch_gather(
        packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, format_name, out, False
    )


@_materialize_op.register_fake
def _materialize_fake(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, format_name, out
) -> None:
    return None


@torch.library.custom_op("kvarn::mla_stage_fp8", mutates_args=("out",))
def _stage_op(
    packed: torch.Tensor,
    block_pool_map: torch.Tensor,
    pool_latent: torch.Tensor,
    pool_scale: torch.Tensor | None,
    pool_rope: torch.Tensor,
    slots: torch.Tensor,
    format_name: str,
    out: torch.Tensor,
) -> None:
    _launch_gather(
        packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, format_name, out, True
    )


@_stage_op.register_fake
def _stage_fake(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, format_name, out
) -> None:
    return None


@torch.library.custom_op("kvarn::mla_remap_indices", mutates_args=("out",))
def _remap_op(
    indices: torch.Tensor, req_ids: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor
) -> None:
    t, k = indices.shape
    if t == 0 or k == 0:
        return
    block_k = 128
    _mla_remap_kernel[(t, triton.cdiv(k, block_k))](
        indices,
        req_ids,
        block_table,
        out,
        k,
        block_table.stride(0),
        block_table.shape[1],
        BLOCK_K=block_k,
        num_warps=4,
    )


@_remap_op.register_fake
def _remap_fake(indices, req_ids, block_table, out) -> None:
    return None


def mla_materialize(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout, out
) -> None:
    """Triton ``mla_materialize`` (contract of :func:`kvarn_ops.reference.mla.mla_materialize`):
    ``out`` bfloat16 ``[N, 576]``, model frame; rows whose slot is -1 are not written."""
    n = _check_gather(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout)
    check_tensor("out", out, dtypes=torch.bfloat16, shape=(n, MLA_DIM), device=packed.device)
    check_device(packed)
    torch.ops.kvarn.mla_materialize(
        packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout.format_name, out
    )


def mla_stage_fp8(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout, out
) -> None:
    """Triton ``mla_stage_fp8`` (contract of :func:`kvarn_ops.reference.mla.mla_stage_fp8`):
    ``out`` uint8 ``[N, 656]`` staged fp8 records, rotated frame, byte-exact; rows whose slot
    is -1 are not written."""
    n = _check_gather(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout)
    check_tensor("out", out, dtypes=torch.uint8, shape=(n, STAGED_BYTES), device=packed.device)
    check_device(packed)
    torch.ops.kvarn.mla_stage_fp8(
        packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout.format_name, out
    )


def mla_remap_indices(indices, req_ids, block_table, out) -> None:
    """Triton ``mla_remap_indices`` (contract of
    :func:`kvarn_ops.reference.mla.mla_remap_indices`); on a GPU an index past the block table
    gives -1 instead of raising."""
    dev = indices.device
    check_tensor("indices", indices, dtypes=torch.int32, ndim=2, device=dev)
    t, k = indices.shape
    check_tensor("req_ids", req_ids, dtypes=torch.int32, shape=(t,), device=dev)
    check_tensor("block_table", block_table, dtypes=torch.int32, ndim=2, device=dev)
    check_tensor("out", out, dtypes=torch.int64, shape=(t, k), device=dev)
    check_index_range("req_ids", req_ids, block_table.shape[0])
    check_index_range("indices", indices, block_table.shape[1] * GROUP, low=-1)
    check_device(indices)
    torch.ops.kvarn.mla_remap_indices(indices, req_ids, block_table, out)
