"""MLA gathers: remap logical top-k indices to physical slots, materialize tokens as bf16
``[N, 576]`` (model frame), and stage them as 656-byte fp8 records (rotated frame, byte-exact
against ``kvarn_ops.reference.mla.mla_stage_fp8``).

Memory traffic per gathered token (b code bits, E/s as the pool): read ``64*b + 128`` record
bytes plus the block's ``2*1024 + 2`` scale bytes (cached across tokens of a block) for a
packed token, or ``512*E + s + 128`` for a pool token, plus 8 (slot) + 4 (map) bytes; write
1152 (materialize) or 656 (stage) bytes. Remap: read ``4*T*K + 4*T`` + used block-table
entries, write ``8*T*K``.

Those are the bytes a token needs, not what the memory system moves: the codes are dim-major,
so the 512 codes of one token lie in 512 dimension rows ``8*b`` bytes apart, and a token alone
touches ~512 32-byte sectors (16 KiB for k4, the whole code field of its block). Tokens of one
block that are gathered close together (adjacent in ``slots``) share those sectors in L1/L2;
randomly ordered slots over a cache larger than L2 do not, and then DRAM sector traffic, not
instruction count, bounds the gather.

Launch knobs (module attributes, read at every call): ``STAGE_TOKENS``, ``STAGE_WARPS``,
``MATERIALIZE_TOKENS``, ``MATERIALIZE_WARPS``; see :func:`launch_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops._validate import check_tensor
from kvarn_ops.kernels._common import (
    abs_max,
    cast_rne,
    check_device,
    clamp_e4m3,
    launch_or_op,
    rotate_rows,
    round_to_bf16,
    round_to_e4m3,
    to_e4m3,
)
from kvarn_ops.kernels._fastlaunch import PlanCache, launch
from kvarn_ops.kernels.mla_common import field_offsets, pool_views
from kvarn_ops.reference.mla import (
    GROUP,
    MLA_DIM,
    STAGED_BYTES,
    _check_gather,
    check_remap_args,
)

__all__ = ["mla_materialize", "mla_remap_indices", "mla_stage_fp8"]

STAGE_TOKENS = 8
"""Tokens per program of ``mla_stage_fp8`` (``BLOCK_T``; a power of two >= 1). A launch knob:
read at every call, so a sweep can set it between calls. H200 sweep (65,536 k4 tokens of 8,192
blocks; ``benchmarks/tune_launch.py --ops mla_stage_random,mla_stage_sorted`` sweeps it now):
8 tokens x 4 warps 0.243 ms for random slots (16 x 4: 0.282, 64 x 8: 0.397) and 0.104 ms for
sorted slots (16 x 4: 0.156), the best or within 2% of it in both orders."""
STAGE_WARPS = 4
"""``num_warps`` of ``mla_stage_fp8``."""
MATERIALIZE_TOKENS = 16
"""Tokens per program of ``mla_materialize`` (>= 16: the smallest tl.dot M of the rotation)."""
MATERIALIZE_WARPS = 4
"""``num_warps`` of ``mla_materialize``. Offline sm_90a compile, 16 tokens: 4 warps need 255
registers plus a 296-byte spill stack (the [16, 512] rotation); 8 warps 255 and no spills; yet
on the H200 4 warps are faster (same sweep: 0.781 vs 0.859 ms random, 0.316 vs 0.454 sorted)."""


def launch_config(stage: bool) -> tuple[int, int]:
    """``(tokens per program, num_warps)`` of the staging (``stage``) or materialize gather,
    from the module-level knobs; ValueError naming the knob when one is out of range."""
    if stage:
        names, block_t, warps, low = ("STAGE_TOKENS", "STAGE_WARPS"), STAGE_TOKENS, STAGE_WARPS, 1
    else:
        names, block_t, warps, low = (
            ("MATERIALIZE_TOKENS", "MATERIALIZE_WARPS"),
            MATERIALIZE_TOKENS,
            MATERIALIZE_WARPS,
            16,
        )
    if block_t < low or block_t & (block_t - 1):
        raise ValueError(f"{names[0]}: must be a power of two >= {low}, got {block_t}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{names[1]}: must be 1, 2, 4, 8 or 16, got {warps}")
    return block_t, warps


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
def _latent_columns(
    rec_ptr,
    rec16_ptr,
    pool_ptr,
    blk,
    off,
    prow,
    pscale,
    in_rec,
    in_pool,
    D0: tl.constexpr,
    CH: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
):
    """Latent columns ``D0 .. D0 + CH`` (fp32 ``[T, CH]``, rotated frame) of T tokens, before the
    per-token row scale: ``code * col_scale + zero_point`` for packed tokens (``in_rec``), the
    pool value times its fp8 scale ``pscale`` for pool tokens (``in_pool``), 0 elsewhere.

    Codes are read as aligned 32-bit words (records are 16-byte multiples, so word ``w`` of a
    record is ``REC // 4 * blk + w``) and unpacked with shifts: code ``(d, t)`` starts at stream
    bit ``(d*64 + t) * BITS``; when ``BITS`` does not divide 32 a code may straddle two words,
    and only those lanes load the second word."""
    T: tl.constexpr = blk.shape[0]
    d = D0 + tl.arange(0, CH)
    rm = tl.broadcast_to(in_rec[:, None], [T, CH])
    pm = tl.broadcast_to(in_pool[:, None], [T, CH])
    pv = tl.load(pool_ptr + prow[:, None] * 512 + d[None, :], mask=pm, other=0.0).to(tl.float32)
    if FP8:
        pv = pv * pscale[:, None]
    rec32 = rec_ptr.to(tl.pointer_type(tl.uint32))
    wrow = tl.where(in_rec, blk, 0).to(tl.int64) * (REC // 4)
    bit = (d[None, :] * 64 + off[:, None]) * BITS
    wptr = rec32 + wrow[:, None] + (bit >> 5)
    sh = (bit & 31).to(tl.uint32)
    lo = tl.load(wptr, mask=rm, other=0)
    if 32 % BITS == 0:
        code = (lo >> sh) & ((1 << BITS) - 1)
    else:
        hi = tl.load(wptr + 1, mask=rm & (sh + BITS > 32), other=0)
        code = ((lo >> sh) | (hi << ((32 - sh) & 31))) & ((1 << BITS) - 1)
    # fp16 scales of the block (rec16_ptr is an int16 view of the records), bitcast after loading.
    hrow = tl.where(in_rec, blk, 0).to(tl.int64) * (REC // 2)
    cs = tl.load(rec16_ptr + hrow[:, None] + (CS_OFF // 2) + d[None, :], mask=rm, other=0)
    zp = tl.load(rec16_ptr + hrow[:, None] + (ZP_OFF // 2) + d[None, :], mask=rm, other=0)
    cs = cs.to(tl.float16, bitcast=True).to(tl.float32)
    zp = zp.to(tl.float16, bitcast=True).to(tl.float32)
    # code * col_scale is exact in fp32, so FMA contraction does not change the sum.
    rv = code.to(tl.int32).to(tl.float32) * cs + zp
    return tl.where(pm, pv, rv)


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
    """BLOCK_T tokens per program. Per token: its slot, block map entry, row scale (packed) or
    pool scale (fp8 pool) once; the latent as words of codes plus the block's fp16 scale rows
    (packed) or the pool row; RoPE as 128 contiguous bytes. Staging runs in four 128-column
    chunks (one fp8 scale each), materialize on whole rows (the rotation mixes all 512)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = i < N
    i = tl.where(inb, i, 0)
    slot = tl.load(slots_ptr + i, mask=inb, other=-1)
    ok = inb & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // 64
    off = (slot % 64).to(tl.int32)
    pb = tl.load(map_ptr + blk, mask=ok, other=-1)
    in_pool = ok & (pb >= 0)
    in_rec = ok & (pb < 0)
    prow = tl.where(in_pool, pb, 0).to(tl.int64) * 64 + off
    if FP8:
        pscale = tl.load(pscale_ptr + prow, mask=in_pool, other=1.0)
    else:
        pscale = tl.full([BLOCK_T], 1.0, tl.float32)
    rs = tl.load(rec16_ptr + tl.where(in_rec, blk, 0) * (REC // 2) + RS_OFF // 2 + off, mask=in_rec)
    rs = tl.where(in_rec, rs.to(tl.float16, bitcast=True).to(tl.float32), 1.0)
    # RoPE bits from the pool row or the record (int16 views).
    r = tl.arange(0, 64)
    rope_pool = tl.load(
        prope_ptr + prow[:, None] * 64 + r[None, :],
        mask=tl.broadcast_to(in_pool[:, None], [BLOCK_T, 64]),
        other=0,
    )
    rope_rec = tl.load(
        rec16_ptr
        + (tl.where(in_rec, blk, 0) * (REC // 2) + ROPE_OFF // 2 + off * 64)[:, None]
        + r[None, :],
        mask=tl.broadcast_to(in_rec[:, None], [BLOCK_T, 64]),
        other=0,
    )
    rope = tl.where(tl.broadcast_to(in_pool[:, None], [BLOCK_T, 64]), rope_pool, rope_rec)
    if STAGE:
        # 656-byte record: e4m3 latent [0, 512), 4 fp32 scales [512, 528), bf16 RoPE [528, 656).
        c4 = tl.arange(0, 4)
        scales = tl.full([BLOCK_T, 4], 1.0, tl.float32)
        for c in tl.static_range(4):
            x = _latent_columns(
                rec_ptr,
                rec16_ptr,
                pool_ptr,
                blk,
                off,
                prow,
                pscale,
                in_rec,
                in_pool,
                c * 128,
                128,
                BITS,
                CS_OFF,
                ZP_OFF,
                REC,
                FP8,
            )
            x = round_to_bf16(x * rs[:, None])
            amax = abs_max(x, 1)  # NaN for a group holding NaN: scale 1.0, as the reference
            scale = tl.where(
                amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0
            )
            q = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
            q = round_to_e4m3(clamp_e4m3(q))
            d = c * 128 + tl.arange(0, 128)
            tl.store(
                out8_ptr + i[:, None] * 656 + d[None, :],
                to_e4m3(q),
                mask=tl.broadcast_to(ok[:, None], [BLOCK_T, 128]),
            )
            scales = tl.where(c4[None, :] == c, scale[:, None], scales)
        tl.store(
            out32_ptr + i[:, None] * 164 + 128 + c4[None, :],
            scales,
            mask=tl.broadcast_to(ok[:, None], [BLOCK_T, 4]),
        )
        tl.store(
            out16_ptr + i[:, None] * 328 + 264 + r[None, :],
            rope,
            mask=tl.broadcast_to(ok[:, None], [BLOCK_T, 64]),
        )
    else:
        x = _latent_columns(
            rec_ptr,
            rec16_ptr,
            pool_ptr,
            blk,
            off,
            prow,
            pscale,
            in_rec,
            in_pool,
            0,
            512,
            BITS,
            CS_OFF,
            ZP_OFF,
            REC,
            FP8,
        )
        y = rotate_rows(x * rs[:, None], BLOCK_T, 512, False)
        d = tl.arange(0, 512)
        tl.store(
            out_ptr + i[:, None] * 576 + d[None, :],
            cast_rne(y, tl.bfloat16),
            mask=tl.broadcast_to(ok[:, None], [BLOCK_T, 512]),
        )
        tl.store(
            out16_ptr + i[:, None] * 576 + 512 + r[None, :],
            rope,
            mask=tl.broadcast_to(ok[:, None], [BLOCK_T, 64]),
        )


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
    block_t, warps = launch_config(stage)
    grid = (triton.cdiv(n, block_t),)
    launch(
        _mla_gather_kernel,
        grid,
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
        BLOCK_T=block_t,
        FP8=fp8,
        num_warps=warps,
        **field_offsets(layout),
    )


def _materialize_op_impl(
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


_materialize_op = torch.library.custom_op("kvarn::mla_materialize", mutates_args=("out",))(
    _materialize_op_impl
)


@_materialize_op.register_fake
def _materialize_fake(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, format_name, out
) -> None:
    return None


def _stage_op_impl(
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


_stage_op = torch.library.custom_op("kvarn::mla_stage_fp8", mutates_args=("out",))(_stage_op_impl)


@_stage_op.register_fake
def _stage_fake(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, format_name, out
) -> None:
    return None


def _remap_op_impl(
    indices: torch.Tensor, req_ids: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor
) -> None:
    t, k = indices.shape
    if t == 0 or k == 0:
        return
    block_k = 128
    launch(
        _mla_remap_kernel,
        (t, triton.cdiv(k, block_k)),
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


_remap_op = torch.library.custom_op("kvarn::mla_remap_indices", mutates_args=("out",))(
    _remap_op_impl
)


@_remap_op.register_fake
def _remap_fake(indices, req_ids, block_table, out) -> None:
    return None


def _gather_switches() -> tuple:
    """What the gathers' path reads besides their arguments (launch knobs read at every call,
    the kernels)."""
    return (STAGE_TOKENS, STAGE_WARPS, MATERIALIZE_TOKENS, MATERIALIZE_WARPS, launch_config,
            _mla_gather_kernel, _mla_remap_kernel)  # fmt: skip


_GATHER_PLANS = PlanCache(_gather_switches)
"""Recorded launches of :func:`mla_materialize` and :func:`mla_stage_fp8` calls."""
_REMAP_PLANS = PlanCache(_gather_switches)
"""Recorded launches of :func:`mla_remap_indices` calls."""


def _gather(op, impl, stage: bool, packed, block_pool_map, pool_latent, pool_scale, pool_rope,
            slots, layout, out) -> None:  # fmt: skip
    tensors = (packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, out)
    key = _GATHER_PLANS.key(tensors, (id(layout), stage))
    if _GATHER_PLANS.replay(key, tensors):
        return
    with _GATHER_PLANS.recording(key, tensors, keep=(layout,)):
        n = _check_gather(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout)
        if stage:
            check_tensor(
                "out", out, dtypes=torch.uint8, shape=(n, STAGED_BYTES), device=packed.device
            )
        else:
            check_tensor(
                "out", out, dtypes=torch.bfloat16, shape=(n, MLA_DIM), device=packed.device
            )
        check_device(packed)
        args = (
            packed,
            block_pool_map,
            pool_latent,
            pool_scale,
            pool_rope,
            slots,
            layout.format_name,
        )
        launch_or_op(op, impl, *args, out)


def mla_materialize(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout, out
) -> None:
    """Triton ``mla_materialize`` (contract of :func:`kvarn_ops.reference.mla.mla_materialize`):
    ``out`` bfloat16 ``[N, 576]``, model frame; rows whose slot is -1 are not written. A
    repeated call of one signature replays the launch of the first without its checks
    (:mod:`._fastlaunch`)."""
    _gather(_materialize_op, _materialize_op_impl, False, packed, block_pool_map, pool_latent,
            pool_scale, pool_rope, slots, layout, out)  # fmt: skip


def mla_stage_fp8(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout, out
) -> None:
    """Triton ``mla_stage_fp8`` (contract of :func:`kvarn_ops.reference.mla.mla_stage_fp8`):
    ``out`` uint8 ``[N, 656]`` staged fp8 records, rotated frame, byte-exact; rows whose slot
    is -1 are not written. A repeated call of one signature replays the launch of the first
    without its checks (:mod:`._fastlaunch`)."""
    _gather(_stage_op, _stage_op_impl, True, packed, block_pool_map, pool_latent, pool_scale,
            pool_rope, slots, layout, out)  # fmt: skip


def mla_remap_indices(indices, req_ids, block_table, out) -> None:
    """Triton ``mla_remap_indices`` (contract of
    :func:`kvarn_ops.reference.mla.mla_remap_indices`); on a GPU an index past the block table
    gives -1 instead of raising. A repeated call of one signature replays the launch of the
    first without its checks (:mod:`._fastlaunch`)."""
    tensors = (indices, req_ids, block_table, out)
    key = _REMAP_PLANS.key(tensors, ())
    if _REMAP_PLANS.replay(key, tensors):
        return
    with _REMAP_PLANS.recording(key, tensors):
        check_remap_args(indices, req_ids, block_table, out)
        check_device(indices)
        launch_or_op(_remap_op, _remap_op_impl, indices, req_ids, block_table, out)
