"""mla_pack (normalize + RTN + fold + bit-pack full latent tiles from the exact pool into the
paged cache) and mla_rehydrate (its inverse: a record back into exact-pool rows).

The latent tile is the dense K orientation ``[512 channels, 64 tokens]``; the kernel follows
``kvarn_ops.reference.quantize.quantize_tiles`` step by step (prescale, 8 column/row
iterations with best-iterate tracking, RTN per channel, fold, fp16 rebalance), in fp32. The
iterations take the dense flush's form of the same mathematics (``flush_math.normalize_tile``:
two passes per iteration, spreads as logarithms). Codes can differ from the reference where
exp/log, a fused multiply-add or a reduction order changes the last bit of a value that sits on
a rounding boundary (measured in tests/test_mla_ops.py and the GPU parity suite). A launch of
few blocks (a decode step's) splits each tile over several programs instead
(``mla_pack_split.py``).

Memory traffic: pack reads ``N*64*(512*E + s + 128) + 8N`` and writes ``N*R``; rehydrate reads
``N*R + 8N`` and writes ``N*64*(512*E + s + 128)`` (E, s of the pool as in the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels import mla_pack_split
from kvarn_ops.kernels._common import (
    INTERPRET,
    apply_log_scales,
    check_device,
    frexp_exponent,
    launch_or_op,
    pack_geometry,
    pow2,
    unpack_codes_load,
)
from kvarn_ops.kernels._fastlaunch import PlanCache, launch
from kvarn_ops.kernels.flush_math import normalize_tile
from kvarn_ops.kernels.mla_common import field_offsets, pool_cast, pool_round, pool_views
from kvarn_ops.kernels.mla_pack_math import (
    copy_rope,
    load_rows,
    rtn_rows,
    store_code_rows,
    store_scales,
)
from kvarn_ops.reference.mla import (
    GROUP,
    MLA_CONFIG,
    _check_block_pairs,
    check_mla_pool,
    check_packed,
)

__all__ = ["mla_pack", "mla_rehydrate"]

REHYDRATE_T = 16
"""Tokens per rehydrate program (a [512, 16] code window; 4 programs per tile)."""


@triton.jit
def _mla_pack_kernel(
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    src_ptr,
    dst_ptr,
    rec_ptr,
    rec16_ptr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
):
    pid = tl.program_id(0)
    src = tl.load(src_ptr + pid).to(tl.int64)
    dst = tl.load(dst_ptr + pid).to(tl.int64)
    d = tl.arange(0, 512)
    t = tl.arange(0, 64)
    # K-orientation tile x[d, t] (rows = channels).
    x = load_rows(pool_ptr, pscale_ptr, src, d, t, FP8)
    # A token (column) holding NaN/Inf is quantized as zeros.
    finite = tl.min((tl.abs(x) < float("inf")).to(tl.int32), axis=0) > 0
    x = tl.where(finite[None, :], x, 0.0)
    # Prescale by 2**-floor(log2(max|x|)) (exact): the method becomes scale invariant.
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    e = tl.where(amax > 0.0, frexp_exponent(amax) - 1, 0)
    xp = x * pow2(-e)
    # Alternate column / row division by the spread, keep the best-balanced iterate: the
    # dense flush's form of the reference's step 3 (flush_math.normalize_tile).
    best_lr, best_lc = normalize_tile(xp, 512, 64, ITERS, STD_FLOOR)
    b = apply_log_scales(xp, best_lr, best_lc)
    # RTN over each channel (row); fold the step and zero point into the channel scale.
    codes, step, lo = rtn_rows(b, (1 << BITS) - 1)
    row_mult = tl.exp(best_lr)
    store_code_rows(rec_ptr + dst * REC, codes, BITS, 512)
    b16 = dst * (REC // 2)
    store_scales(rec16_ptr, b16, row_mult * step, row_mult * lo, best_lc, e, CS_OFF, ZP_OFF, RS_OFF)
    copy_rope(prope_ptr, rec16_ptr, src, b16, ROPE_OFF)


@triton.jit
def _mla_rehydrate_kernel(
    rec_ptr,
    rec16_ptr,
    src_ptr,
    dst_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    BLOCK_T: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
):
    pid = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    src = tl.load(src_ptr + pid).to(tl.int64)
    dst = tl.load(dst_ptr + pid).to(tl.int64)
    d = tl.arange(0, 512)
    t = t0 + tl.arange(0, BLOCK_T)
    base = src * REC
    b16 = src * (REC // 2)
    # codes [512, BLOCK_T] for tokens t0..t0+BLOCK_T (stream index d*64 + t).
    codes = unpack_codes_load(rec_ptr + base + (t0 * BITS) // 8, 512, BLOCK_T, 64, BITS, L, NB, NBP)
    cs = tl.load(rec16_ptr + b16 + CS_OFF // 2 + d).to(tl.float16, bitcast=True).to(tl.float32)
    zp = tl.load(rec16_ptr + b16 + ZP_OFF // 2 + d).to(tl.float16, bitcast=True).to(tl.float32)
    rs = tl.load(rec16_ptr + b16 + RS_OFF // 2 + t).to(tl.float16, bitcast=True).to(tl.float32)
    x = (codes.to(tl.float32) * cs[:, None] + zp[:, None]) * rs[None, :]
    vals, scale = pool_round(tl.trans(x), FP8)
    rows = dst * 64 + t
    tl.store(
        pool_ptr + rows[:, None] * 512 + d[None, :], pool_cast(vals, FP8, pool_ptr.dtype.element_ty)
    )
    if FP8:
        tl.store(pscale_ptr + rows, scale)
    rr = tl.arange(0, 64)
    rope = tl.load(rec16_ptr + b16 + ROPE_OFF // 2 + t[:, None] * 64 + rr[None, :])
    tl.store(prope_ptr + rows[:, None] * 64 + rr[None, :], rope)


def _geometry(format_name: str):
    import kvarn_formats as kf

    offs = field_offsets(kf.mla_layout(format_name))
    lg, nbytes, nbp = pack_geometry(offs["BITS"])
    return offs, {"L": lg, "NB": nbytes, "NBP": nbp}


def _split_parts(n: int, device) -> int:
    """Programs per tile: ``mla_pack_split.FORCE_PARTS`` if set, else its ``parts_for`` on a
    GPU, else 1 (the single-program kernel)."""
    if mla_pack_split.FORCE_PARTS is not None:
        return mla_pack_split.FORCE_PARTS
    if device.type == "cuda" and not INTERPRET:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return mla_pack_split.parts_for(n, sms)
    return 1


def _pack_op_impl(
    pool_latent: torch.Tensor,
    pool_scale: torch.Tensor | None,
    pool_rope: torch.Tensor,
    src_pool_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    packed: torch.Tensor,
    format_name: str,
) -> None:
    n = src_pool_blocks.shape[0]
    if n == 0:
        return
    offs, geo = _geometry(format_name)
    pl, ps, pr, fp8 = pool_views(pool_latent, pool_scale, pool_rope)
    cfg = MLA_CONFIG
    parts = _split_parts(n, pool_latent.device)
    if parts > 1:  # a decode step's few blocks: each tile over several programs
        mla_pack_split.launch(
            pl,
            ps,
            pr,
            src_pool_blocks,
            dst_blocks,
            packed,
            parts,
            cfg.iters,
            cfg.std_floor,
            fp8,
            offs,
        )
        return
    launch(
        _mla_pack_kernel,
        (n,),
        pl,
        ps,
        pr,
        src_pool_blocks,
        dst_blocks,
        packed,
        packed.view(torch.int16),
        ITERS=cfg.iters,
        STD_FLOOR=cfg.std_floor,
        FP8=fp8,
        num_warps=16,
        **offs,
        **geo,
    )


_pack_op = torch.library.custom_op("kvarn::mla_pack", mutates_args=("packed",))(_pack_op_impl)


@_pack_op.register_fake
def _pack_fake(
    pool_latent, pool_scale, pool_rope, src_pool_blocks, dst_blocks, packed, format_name
) -> None:
    return None


def _rehydrate_op_impl(
    packed: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_pool_blocks: torch.Tensor,
    pool_latent: torch.Tensor,
    pool_scale: torch.Tensor | None,
    pool_rope: torch.Tensor,
    format_name: str,
) -> None:
    n = src_blocks.shape[0]
    if n == 0:
        return
    offs, geo = _geometry(format_name)
    pl, ps, pr, fp8 = pool_views(pool_latent, pool_scale, pool_rope)
    launch(
        _mla_rehydrate_kernel,
        (n, GROUP // REHYDRATE_T),
        packed,
        packed.view(torch.int16),
        src_blocks,
        dst_pool_blocks,
        pl,
        ps,
        pr,
        BLOCK_T=REHYDRATE_T,
        FP8=fp8,
        num_warps=4,
        **offs,
        **geo,
    )


_rehydrate_op = torch.library.custom_op(
    "kvarn::mla_rehydrate", mutates_args=("pool_latent", "pool_scale", "pool_rope")
)(_rehydrate_op_impl)


@_rehydrate_op.register_fake
def _rehydrate_fake(
    packed, src_blocks, dst_pool_blocks, pool_latent, pool_scale, pool_rope, format_name
) -> None:
    return None


def _pack_switches() -> tuple:
    """What :func:`mla_pack`'s and :func:`mla_rehydrate`'s paths read besides their arguments
    (part of every plan's signature, :mod:`._fastlaunch`)."""
    return (MLA_CONFIG, REHYDRATE_T, mla_pack_split.FORCE_PARTS, mla_pack_split.MIN_PARTS,
            mla_pack_split.MAX_PARTS, mla_pack_split.parts_for, _mla_pack_kernel,
            _mla_rehydrate_kernel, mla_pack_split._mla_pack_split_kernel)  # fmt: skip


_PACK_PLANS = PlanCache(_pack_switches)
"""Recorded launches of :func:`mla_pack` calls."""
_REHYDRATE_PLANS = PlanCache(_pack_switches)
"""Recorded launches of :func:`mla_rehydrate` calls."""


def mla_pack(
    pool_latent, pool_scale, pool_rope, src_pool_blocks, dst_blocks, packed, layout
) -> None:
    """Triton ``mla_pack`` (contract of :func:`kvarn_ops.reference.mla.mla_pack`, without the
    reference-only refit). On a GPU, out-of-range block ids are not checked (no host sync).
    A repeated call of one signature replays the launch of the first without its checks
    (:mod:`._fastlaunch`), its scratch allocated anew."""
    tensors = (pool_latent, pool_scale, pool_rope, src_pool_blocks, dst_blocks, packed)
    key = _PACK_PLANS.key(tensors, (id(layout),))
    if _PACK_PLANS.replay(key, tensors):
        return
    with _PACK_PLANS.recording(key, tensors, keep=(layout,)):
        p = check_mla_pool(pool_latent, pool_scale, pool_rope)
        dev = pool_latent.device
        nb = check_packed(packed, layout, device=dev)
        _check_block_pairs(src_pool_blocks, dst_blocks, p, nb, "src_pool_blocks", "dst_blocks", dev)
        check_device(pool_latent)
        if (
            MLA_CONFIG.log_scale_clip is not None
            or not MLA_CONFIG.prescale
            or not MLA_CONFIG.rebalance_fp16
            or MLA_CONFIG.rounding != "rtn"
        ):  # pragma: no cover - guards a config change
            raise NotImplementedError(
                "the MLA pack kernel implements only min/max RTN (MLA_CONFIG)"
            )
        launch_or_op(
            _pack_op,
            _pack_op_impl,
            pool_latent,
            pool_scale,
            pool_rope,
            src_pool_blocks,
            dst_blocks,
            packed,
            layout.format_name,
        )


def mla_rehydrate(
    packed, src_blocks, dst_pool_blocks, pool_latent, pool_scale, pool_rope, layout
) -> None:
    """Triton ``mla_rehydrate`` (contract of :func:`kvarn_ops.reference.mla.mla_rehydrate`).
    A repeated call of one signature replays the launch of the first (:mod:`._fastlaunch`)."""
    tensors = (packed, src_blocks, dst_pool_blocks, pool_latent, pool_scale, pool_rope)
    key = _REHYDRATE_PLANS.key(tensors, (id(layout),))
    if _REHYDRATE_PLANS.replay(key, tensors):
        return
    with _REHYDRATE_PLANS.recording(key, tensors, keep=(layout,)):
        p = check_mla_pool(pool_latent, pool_scale, pool_rope)
        dev = pool_latent.device
        nb = check_packed(packed, layout, device=dev)
        _check_block_pairs(src_blocks, dst_pool_blocks, nb, p, "src_blocks", "dst_pool_blocks", dev)
        check_device(pool_latent)
        launch_or_op(
            _rehydrate_op,
            _rehydrate_op_impl,
            packed,
            src_blocks,
            dst_pool_blocks,
            pool_latent,
            pool_scale,
            pool_rope,
            layout.format_name,
        )
