"""mla_pack for the few blocks of a decode step: each block's tile split over programs.

An MLA model packs one [512 channels, 64 tokens] latent tile per block and layer, so a
decode step in which requests fill blocks packs a handful of tiles, and one program per tile
(``mla_pack.py``) leaves the launch at one program's latency: about 0.35 ms per layer on an
H200. Here each tile takes ``PARTS`` programs, each holding ``512 / PARTS`` channels (rows):
row statistics stay in the program, the tokens' (columns') statistics are exchanged through
the tile's scratch once per normalization iteration (``flush_math.normalize_split``,
``flush_sync.exchange``), each program rounds and packs its channels, and the last to finish
(an acquire-release counter, zeroed per launch) moves the power of two between the scale
fields and stores them. The programs of a tile wait for one another, so the launcher splits
only while every program of the launch can be resident at once (one per SM).

The records equal the reference's as the single-program kernel's do (the same arithmetic;
the column variances are combined from the slices' partials, so their last bits may differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels import _fastlaunch as fl
from kvarn_ops.kernels._common import INTERPRET, apply_log_scales, frexp_exponent, pow2
from kvarn_ops.kernels.flush_math import normalize_split
from kvarn_ops.kernels.flush_sync import exchange, fence
from kvarn_ops.kernels.mla_pack_math import (
    copy_rope,
    load_rows,
    rtn_rows,
    store_code_rows,
    store_scales,
)

__all__ = ["FORCE_PARTS", "MAX_PARTS", "MIN_PARTS", "launch", "parts_for", "scratch_stride"]

#: Most programs per tile (16 channels each). H200, one block: 4 / 8 / 16 / 32 programs per
#: tile 107 / 56 / 45 / 42 us against 359 us for one program.
MAX_PARTS = 32
#: Fewest: two programs of 256 channels each spill (2,104 B of stack frame, sm_90a) and took
#: 690 us for 64 blocks, against 367 us for one program per tile.
MIN_PARTS = 4
#: Programs per tile for the next launch: None = :func:`parts_for` (GPU) or 1 (the
#: interpreter); tests and benchmarks set an int.
FORCE_PARTS: int | None = None


def parts_for(tiles: int, sms: int) -> int:
    """Programs per tile for ``tiles`` tiles on a GPU with ``sms`` SMs: the largest power of
    two up to :data:`MAX_PARTS` that keeps ``tiles x parts`` within one program per SM; 1
    (the single-program kernel) when fewer than :data:`MIN_PARTS` fit."""
    if tiles * MIN_PARTS > sms:
        return 1
    parts = MIN_PARTS
    while parts * 2 <= MAX_PARTS and tiles * parts * 2 <= sms:
        parts *= 2
    return parts


def scratch_stride(parts: int, iters: int) -> int:
    """fp32 scratch per tile: the balanced tile (the interpreter's emulation slices its rows
    through it), 512 log channel scales, 512 folded scales and 512 zero points, then
    ``iters + 2`` exchange slots of ``parts x 3`` vectors of 64."""
    return 512 * 64 + 3 * 512 + (iters + 2) * parts * 3 * 64


@triton.jit
def _mla_pack_split_kernel(
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    src_ptr,
    dst_ptr,
    rec_ptr,
    rec16_ptr,
    scratch_ptr,
    counter_ptr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
    PARTS: tl.constexpr,
    EMU: tl.constexpr,
    SCRATCH: tl.constexpr,
):
    pid = tl.program_id(0)
    part = tl.program_id(1)
    src = tl.load(src_ptr + pid).to(tl.int64)
    dst = tl.load(dst_ptr + pid).to(tl.int64)
    cnt = counter_ptr + pid
    scr = scratch_ptr + pid.to(tl.int64) * SCRATCH
    XOFF: tl.constexpr = 512 * 64 + 3 * 512
    SZ: tl.constexpr = 512 * 64
    RP: tl.constexpr = 512 // PARTS
    M: tl.constexpr = 512 if EMU else RP
    t = tl.arange(0, 64)
    d = tl.arange(0, M)
    if not EMU:
        d = part * RP + d
    x = load_rows(pool_ptr, pscale_ptr, src, d, t, FP8)
    # A token (column) holding NaN/Inf is quantized as zeros, and the prescale is 2**-floor(
    # log2(max|x|)) over the whole tile: both from every part's columns (exchange slot 0).
    finite = tl.abs(x) < float("inf")
    fin = finite.to(tl.float32)
    ax = tl.where(finite, tl.abs(x), 0.0)
    if EMU:
        fin_p = tl.min(tl.reshape(fin, [PARTS, RP, 64]), axis=1)
        max_p = tl.max(tl.reshape(ax, [PARTS, RP, 64]), axis=1)
    else:
        fin_p = tl.min(fin, axis=0)
        max_p = tl.max(ax, axis=0)
    g_fin, g_max, _ = exchange(scr + XOFF, cnt, 0, part, fin_p, max_p, fin_p, 2, 64, PARTS, EMU)
    col_ok = tl.min(g_fin, axis=0) > 0.0
    x = tl.where(col_ok[None, :], x, 0.0)
    amax = tl.max(tl.where(col_ok, tl.max(g_max, axis=0), 0.0), axis=0)
    e = tl.where(amax > 0.0, frexp_exponent(amax) - 1, 0)
    xp = x * pow2(-e)
    best_lr, best_lc = normalize_split(
        xp, scr + XOFF, cnt, 1, part, 512, RP, 64, PARTS, EMU, ITERS, STD_FLOOR
    )
    balanced = apply_log_scales(xp, best_lr, best_lc)
    rp = part * RP + tl.arange(0, RP)
    if EMU:
        # This part's channels of the whole tile, through the scratch.
        mine = (d // RP) == part
        tl.store(scr + d[:, None] * 64 + t[None, :], balanced, mask=mine[:, None])
        tl.store(scr + SZ + d, best_lr, mask=mine)
        tl.debug_barrier()
        b = tl.load(scr + rp[:, None] * 64 + t[None, :])
        row_mult = tl.exp(tl.load(scr + SZ + rp))
    else:
        b = balanced
        row_mult = tl.exp(best_lr)
    codes, step, lo = rtn_rows(b, (1 << BITS) - 1)
    store_code_rows(rec_ptr + dst * REC + part * (RP * 8 * BITS), codes, BITS, RP)
    tl.store(scr + SZ + 512 + rp, row_mult * step)
    tl.store(scr + SZ + 1024 + rp, row_mult * lo)
    b16 = dst * (REC // 2)
    if part == 0:
        copy_rope(prope_ptr, rec16_ptr, src, b16, ROPE_OFF)
    # Release this part's stores (every thread, then the barrier), count it in; the last part
    # acquires all of them. The exchanges counted PARTS each before.
    fence(part, not EMU)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    NX: tl.constexpr = 0 if EMU else ITERS + 2
    if arrived == PARTS * (NX + 1) - 1:
        fence(part, not EMU)
        s_all = tl.load(scr + SZ + 512 + tl.arange(0, 512), cache_modifier=".cg")
        z_all = tl.load(scr + SZ + 1024 + tl.arange(0, 512), cache_modifier=".cg")
        store_scales(rec16_ptr, b16, s_all, z_all, best_lc, e, CS_OFF, ZP_OFF, RS_OFF)


def launch(pl, ps, pr, src, dst, packed, parts: int, iters: int, std_floor: float, fp8, consts):
    """One launch of ``parts`` programs per block (``parts > 1``); ``consts``: the record's
    field offsets and code width (``mla_common.field_offsets``)."""
    n = src.shape[0]
    dev = pl.device
    if dev.type == "cuda" and not INTERPRET:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if n * parts > sms:
            raise ValueError(
                f"FORCE_PARTS: {parts} programs per block x {n} blocks exceed the {sms} "
                "programs a split MLA pack keeps resident"
            )
    stride = scratch_stride(parts, iters)
    counters = fl.scratch(n, torch.int32, dev, zero=True)
    scratch = fl.scratch(n * stride, torch.float32, dev)
    fl.launch(
        _mla_pack_split_kernel,
        (n, parts),
        pl,
        ps,
        pr,
        src,
        dst,
        packed,
        packed.view(torch.int16),
        scratch,
        counters,
        ITERS=iters,
        STD_FLOOR=std_floor,
        FP8=fp8,
        PARTS=parts,
        EMU=INTERPRET,
        SCRATCH=stride,
        num_warps=4,
        **consts,
    )
