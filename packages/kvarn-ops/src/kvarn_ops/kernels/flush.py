"""flush: pack N full exact-pool blocks into dense KVarN records, in place in the paged cache.

Memory traffic (E = pool element bytes, s = 4 if fp8 else 0): read
``2*N*G*Hkv*(D*E + s) + 8N``; write ``N*Hkv*R`` (R = layout.record_bytes).

One launch, one program per (block, KV head, K or V): the program loads its tile, normalizes,
quantizes, folds and bit-packs it, and writes its half of the record, padding bytes included
(zeros, as the reference writer). A launch of few tiles (a decode step's flush) is one
program's latency, so there each tile takes several programs (:func:`parts_for`): all
normalize the tile, each rounds and packs a slice of its rows, and the last to finish stores
the scale fields (``_flush_tile``). The numerical algorithm is that of
``kvarn_ops.reference.quantize`` (module docstring, steps 1-6) for the ``NormalizeConfig``
given to :func:`flush` (the reference default unless given), step for step; steps 3 and 4 are
computed in a cheaper form of the same mathematics (``flush_math.py``: fewer passes over the
tile, spreads as logarithms), so codes differ from the reference only where a float reduction
order or an exp/log ulp flips a rounding (measured in tests/test_flush.py).

Step 4 (codes and per-row step and zero point) is chosen per tile kind at compile time
(``K_ROUNDING``/``V_ROUNDING``, ids in :data:`ROUNDING_IDS`), from ``config.rounding`` and
``config.rounding_v``:

- ``"rtn"`` (0): min/max round-to-nearest (reference ``quantize_rows``).
- ``"unbiased_clip"`` (1): reference ``round_rows(..., "unbiased_clip")``
  (``flush_math.unbiased_clip_search``): per row, the min/max candidate, then the first
  ``CLIP_COUNTS[bits]`` clip ratios of ``CLIP_RATIOS`` in order (1.0 first; all 14 at 2 bits,
  5 at 4 bits, 2 at 8), each with its codes from the clipped range
  and the unbiased refit ``step = var_w(B) / cov_w(codes, B)``, ``lo = mean_w(B) - step *
  mean_w(codes)`` (weights ``exp(2 * (lc - max lc))``; the clipped ``(s, z)`` where
  ``cov <= 0``); the candidate of least weighted error is kept (strict ``<``: ties keep the
  earlier one; zero-range rows keep min/max). Same fp32 formulas; the divisions are IEEE
  (``div_rn``), as torch's.
- ``"unbiased_clip"`` with ``config.clip_search="pattern"`` (2, ``DEFAULT_CONFIG``): the same,
  but at 2 bits the candidates after min/max are those of the pattern search
  ``CLIP_PATTERNS[2]`` (6 instead of 14: two starts, then two steps of two neighbours of
  each row's best; the ratio ``k / 32`` from each row's ``k``); other widths take the window.
Other modes (and prescale off, no fp16 rebalance, a log-scale clip) are refused by
:func:`check_config`.

Cost: per tile element, the normalization takes two passes of about 6 fp32 operations per
iteration (2 iterations in ``DEFAULT_CONFIG``, 8 published), and the clipping search about
16 per candidate (the codes, the refit's code mean and covariance, the error; 7 candidates at
2 bits with the default's pattern search, 15 with the window; 6 at 4 bits, 3 at 8). At 50% of the
H200's copy bandwidth on bf16 input the flush would have about 30 fp32 operations per
element: it is compute bound, two orders of magnitude from that target (BENCHMARKS.md has
the measured times and profiles). The compiler's layout gives every thread
8 rows of a tile, each row shared by 8 or 16 threads, so the per-row work of every candidate
(two IEEE divisions among it, five before the means took the tile's ``1 / sum(w)``) is
repeated that often; a layout with whole rows per thread is
not expressible in Triton. The candidate loop is not unrolled (unrolled, it spilled more).

Bulk launches (one program per tile, no sink steps) on a CUDA GPU take a Gluon kernel with
that layout instead: by default one pass (``flush_onepass.py``: normalize, search, round,
fold, pack in one program), or with ``KVARN_FLUSH_FUSED=0`` two passes (``flush_plan.py``: the
Gluon kernel stores each tile's plan, then this kernel, ``PLANNED``, applies it and packs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

import kvarn_formats as kf
from kvarn_ops.kernels import flush_plan
from kvarn_ops.kernels._common import (
    INTERPRET,
    apply_log_scales,
    check_device,
    fp16_balance_shift,
    launch_or_op,
    pack_codes_store,
    pack_geometry,
    pow2,
    round_half_even,
)
from kvarn_ops.kernels._fastlaunch import PlanCache, launch, scratch
from kvarn_ops.kernels.flush_math import finish_planned, normalize_tile, unbiased_clip_search
from kvarn_ops.kernels.flush_plan import (
    launch_onepass,
    launch_plan,
    load_prescaled,
    plan_engine,
    plan_stride,
)
from kvarn_ops.kernels.flush_sink import apply_sink, sink_override
from kvarn_ops.kernels.flush_sink_key import pin_search
from kvarn_ops.kernels.flush_sync import fence
from kvarn_ops.reference.cache import check_flush_args
from kvarn_ops.reference.quantize import DEFAULT_CONFIG, NormalizeConfig
from kvarn_ops.reference.rounding import CLIP_SEARCHES, ROUNDING_MODES
from kvarn_ops.reference.sink_key import SINK_KEY_BITS

__all__ = ["ROUNDING_IDS", "check_config", "flush"]

_ALIGN = 16
_FP16_EXP_MIN = -13  # frexp exponent of the smallest normal fp16 (reference step 6)
_FP16_EXP_MAX = 15


@triton.jit
def _store_fp16(ptr, values, N: tl.constexpr):
    # Saturating cast, as the reference's _to_fp16: a scale beyond fp16 stays finite.
    values = tl.minimum(tl.maximum(values, -65504.0), 65504.0)
    tl.store(ptr.to(tl.pointer_type(tl.float16)) + tl.arange(0, N), values.to(tl.float16))


@triton.jit
def _zero_pad(ptr, PAD: tl.constexpr):
    # Alignment padding after a field (at most 15 bytes): zeros, like the reference writer.
    if PAD > 0:
        k = tl.arange(0, 16)
        tl.store(ptr + k, tl.zeros([16], dtype=tl.uint8), mask=k < PAD)


@triton.jit
def _flush_tile(
    pool_ptr,
    scale_ptr,
    src,
    head,
    rec_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    TOKENS_ON_ROWS: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    BITS: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    CODES_OFF: tl.constexpr,
    CODES_PAD: tl.constexpr,
    ROW_SCALE_OFF: tl.constexpr,
    ROW_SCALE_PAD: tl.constexpr,
    ROW_ZP_OFF: tl.constexpr,
    ROW_ZP_PAD: tl.constexpr,
    COL_SCALE_OFF: tl.constexpr,
    COL_SCALE_PAD: tl.constexpr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
    ROUNDING: tl.constexpr,
    scr_ptr,
    cnt_ptr,
    part,
    PARTS: tl.constexpr,
    ASM: tl.constexpr,
    sink_row,
    SINK: tl.constexpr,
    PIN: tl.constexpr,
    PLANNED: tl.constexpr,
):
    """Quantize one tile ``X [R, C]`` (K: R = D channels, C = G tokens; V: R = G tokens,
    C = D) into its record fields: codes ``[R, C]``, row-side scale and zero point ``[R]``,
    column-side scale ``[C]``.

    With ``PARTS > 1`` this program is part ``part`` of the tile's ``PARTS`` programs: all
    normalize the whole tile (the same instructions on the same data, so the same scales);
    each rounds and packs its ``R / PARTS`` rows (step 4) and leaves their fp32 step and zero
    point in the tile's scratch ``scr_ptr``; the last to arrive (counter ``cnt_ptr``, zero at
    launch) folds and rebalances the scales of every row (steps 5-6) and stores them.

    With ``SINK`` (V tiles), row ``sink_row`` (-1: none) is the attention-sink token, kept
    almost exact (``flush_sink.py``, reference ``reference/sink.py``). With ``PIN`` (2-bit K
    tiles), column ``sink_row`` is the sink token, whose key every channel's grid passes
    through (``flush_sink_key.py``, reference ``reference/sink_key.py``).

    With ``PLANNED`` (one program per tile, no sink steps) the tile's normalization and
    clipping search were done by the planned flush's first pass (``flush_plan.py``), whose
    plan is at ``scr_ptr``: this program applies its log scales, rounds the tile on each row's
    planned clipping range, folds the planned step and zero point, and packs."""
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    # Steps 1-2: load (non-finite tokens zeroed) and prescale.
    xs, e = load_prescaled(pool_ptr, scale_ptr, src, head, R, C, TOKENS_ON_ROWS, G, H, D, FP8)
    # Step 3: alternate column / row division by the spread; keep the best-balanced iterate
    # (flush_math.py), or the planned one (flush_plan.py).
    if PLANNED:
        best_lr = tl.load(scr_ptr + r)
        best_lc = tl.load(scr_ptr + R + c)
    else:
        best_lr, best_lc = normalize_tile(xs, R, C, ITERS, STD_FLOOR)
    balanced = apply_log_scales(xs, best_lr, best_lc)
    if SINK:
        balanced, best_lc, sink_codes, sink_step, sink_lo, sink_row = apply_sink(
            balanced, best_lc, sink_row, (1 << BITS) - 1, R, C
        )

    if PARTS == 1:
        if PIN:
            codes, step, lo = _round_rows_pinned(balanced, best_lc, sink_row, BITS, R, C, ROUNDING)
        elif PLANNED and ROUNDING != 0:
            # the planned winner's codes, step and zero point (flush_plan.py)
            codes = finish_planned(
                balanced,
                tl.load(scr_ptr + R + C + r),
                tl.load(scr_ptr + 2 * R + C + r),
                (1 << BITS) - 1,
            ).to(tl.int32)
            step = tl.load(scr_ptr + 3 * R + C + r)
            lo = tl.load(scr_ptr + 4 * R + C + r)
        else:
            codes, step, lo = _round_rows(balanced, best_lc, BITS, R, C, ROUNDING)
        if SINK:
            codes, step, lo = sink_override(
                codes, step, lo, r, sink_row, sink_codes, sink_step, sink_lo
            )
        pack_codes_store(rec_ptr + CODES_OFF, codes, R, C, BITS, L, NB, NBP)
        # Step 5: fold the RTN step and offset into the normalization scales.
        row_mult = tl.exp(best_lr)
        _store_scales(
            rec_ptr,
            row_mult * step,
            row_mult * lo,
            best_lc,
            e,
            R,
            C,
            BITS,
            CODES_OFF,
            CODES_PAD,
            ROW_SCALE_OFF,
            ROW_SCALE_PAD,
            ROW_ZP_OFF,
            ROW_ZP_PAD,
            COL_SCALE_OFF,
            COL_SCALE_PAD,
        )
    else:
        # This part's rows of the balanced tile and their log scales, through the tile's
        # scratch: the search then runs on an [R / PARTS, C] tensor of its own layout.
        RP: tl.constexpr = R // PARTS
        mine = (r // RP) == part
        tl.store(scr_ptr + r[:, None] * C + c[None, :], balanced, mask=mine[:, None])
        tl.store(scr_ptr + R * C + r, best_lr, mask=mine)
        tl.debug_barrier()
        rp = part * RP + tl.arange(0, RP)
        b = tl.load(scr_ptr + rp[:, None] * C + c[None, :])
        row_mult = tl.exp(tl.load(scr_ptr + R * C + rp))
        if PIN:
            codes, step, lo = _round_rows_pinned(b, best_lc, sink_row, BITS, RP, C, ROUNDING)
        else:
            codes, step, lo = _round_rows(b, best_lc, BITS, RP, C, ROUNDING)
        if SINK:
            codes, step, lo = sink_override(
                codes, step, lo, rp, sink_row, sink_codes, sink_step, sink_lo
            )
        pack_codes_store(
            rec_ptr + CODES_OFF + part * (RP * C * BITS // 8), codes, RP, C, BITS, L, NB, NBP
        )
        tl.store(scr_ptr + R * C + R + rp, row_mult * step)
        tl.store(scr_ptr + R * C + 2 * R + rp, row_mult * lo)
        # Release this part's stores (every thread, then the barrier), count it in; the last
        # part acquires all of them.
        fence(part, ASM)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == PARTS - 1:
            fence(part, ASM)
            s_all = tl.load(scr_ptr + R * C + R + r, cache_modifier=".cg")
            z_all = tl.load(scr_ptr + R * C + 2 * R + r, cache_modifier=".cg")
            _store_scales(
                rec_ptr,
                s_all,
                z_all,
                best_lc,
                e,
                R,
                C,
                BITS,
                CODES_OFF,
                CODES_PAD,
                ROW_SCALE_OFF,
                ROW_SCALE_PAD,
                ROW_ZP_OFF,
                ROW_ZP_PAD,
                COL_SCALE_OFF,
                COL_SCALE_PAD,
            )


@triton.jit
def _round_rows(
    b, lc, BITS: tl.constexpr, R: tl.constexpr, C: tl.constexpr, ROUNDING: tl.constexpr
):
    """Step 4: codes (int32) and per-row ``(step, lo)`` of the balanced rows ``b [R, C]``,
    ties to even."""
    levels: tl.constexpr = (1 << BITS) - 1
    if ROUNDING == 0:
        # Min/max RTN (reference quantize_rows). Its ``levels / rng`` is torch's reversed
        # division, reciprocal(rng) * levels: two IEEE roundings.
        lo = tl.min(b, axis=1)
        rng = tl.max(b, axis=1) - lo
        ones = tl.full([R], 1.0, tl.float32)
        inv = tl.where(rng > 0.0, tl.div_rn(ones, tl.where(rng > 0.0, rng, 1.0)) * levels, 0.0)
        codes = round_half_even((b - lo[:, None]) * inv[:, None])
        codes = tl.minimum(tl.maximum(codes, 0.0), levels * 1.0)
        step = tl.div_rn(rng, tl.full([R], levels, tl.float32))
    else:
        # Clipping search with unbiased refit (reference round_rows, "unbiased_clip");
        # PATTERN_ID: its pattern search (clip_search="pattern").
        codes, step, lo = unbiased_clip_search(b, lc, levels, R, C, ROUNDING == PATTERN_ID)
    return codes.to(tl.int32), step, lo


@triton.jit
def _round_rows_pinned(
    b, lc, pin, BITS: tl.constexpr, R: tl.constexpr, C: tl.constexpr, ROUNDING: tl.constexpr
):
    """Step 4 of a K tile that may hold the sink token (column ``pin``, runtime; -1: none):
    its grids through the sink's key (``flush_sink_key.py``) in place of the search, so no
    tile value is live across both."""
    if pin >= 0:
        codes, step, lo = pin_search(b, lc, pin, (1 << BITS) - 1, R, C)
    else:
        codes, step, lo = _round_rows(b, lc, BITS, R, C, ROUNDING)
    return codes, step, lo


@triton.jit
def _store_scales(
    rec_ptr,
    s,
    z,
    lc,
    e,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    CODES_OFF: tl.constexpr,
    CODES_PAD: tl.constexpr,
    ROW_SCALE_OFF: tl.constexpr,
    ROW_SCALE_PAD: tl.constexpr,
    ROW_ZP_OFF: tl.constexpr,
    ROW_ZP_PAD: tl.constexpr,
    COL_SCALE_OFF: tl.constexpr,
    COL_SCALE_PAD: tl.constexpr,
):
    """Steps 5 (folded row scale ``s`` and zero point ``z`` [R], column scale ``exp(lc)``
    [C]) and 6 (move 2**j between the sides so every fp16 field is normal where possible;
    ``e``: the prescale exponent), then the fp16 stores and the padding after every field but
    the codes' own bytes."""
    w = tl.exp(lc)
    j = fp16_balance_shift(s, z, w, e)
    shift_a = pow2(e + j)
    shift_b = pow2(-j)
    _zero_pad(rec_ptr + CODES_OFF + R * C * BITS // 8, CODES_PAD)
    _store_fp16(rec_ptr + ROW_SCALE_OFF, s * shift_a, R)
    _zero_pad(rec_ptr + ROW_SCALE_OFF + 2 * R, ROW_SCALE_PAD)
    _store_fp16(rec_ptr + ROW_ZP_OFF, z * shift_a, R)
    _zero_pad(rec_ptr + ROW_ZP_OFF + 2 * R, ROW_ZP_PAD)
    _store_fp16(rec_ptr + COL_SCALE_OFF, w * shift_b, C)
    _zero_pad(rec_ptr + COL_SCALE_OFF + 2 * C, COL_SCALE_PAD)


@triton.jit
def _flush_kernel(
    exact_k_ptr,
    exact_v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    src_ptr,
    dst_ptr,
    packed_ptr,
    scratch_ptr,
    counter_ptr,
    sink_ptr,
    num_pool_blocks,
    num_blocks,
    G: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    RECORD_BYTES: tl.constexpr,
    K_BITS: tl.constexpr,
    K_L: tl.constexpr,
    K_NB: tl.constexpr,
    K_NBP: tl.constexpr,
    V_BITS: tl.constexpr,
    V_L: tl.constexpr,
    V_NB: tl.constexpr,
    V_NBP: tl.constexpr,
    KC_OFF: tl.constexpr,
    KC_PAD: tl.constexpr,
    KS_OFF: tl.constexpr,
    KS_PAD: tl.constexpr,
    KZ_OFF: tl.constexpr,
    KZ_PAD: tl.constexpr,
    KR_OFF: tl.constexpr,
    KR_PAD: tl.constexpr,
    VC_OFF: tl.constexpr,
    VC_PAD: tl.constexpr,
    VS_OFF: tl.constexpr,
    VS_PAD: tl.constexpr,
    VR_OFF: tl.constexpr,
    VR_PAD: tl.constexpr,
    VZ_OFF: tl.constexpr,
    VZ_PAD: tl.constexpr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
    K_ROUNDING: tl.constexpr,
    V_ROUNDING: tl.constexpr,
    PARTS: tl.constexpr,
    ASM: tl.constexpr,
    SCRATCH: tl.constexpr,
    SINK: tl.constexpr,
    PIN: tl.constexpr,
    MARKED: tl.constexpr = 0,
    PLANNED: tl.constexpr = False,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    which = tl.program_id(2) // PARTS
    part = tl.program_id(2) % PARTS
    # the tile's counter and scratch (used when PARTS > 1; scratch_stride(G, D) floats)
    tile = (i * H + head) * 2 + which
    cnt_ptr = counter_ptr + tile
    scr_ptr = scratch_ptr + tile.to(tl.int64) * SCRATCH
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    # Out-of-range indices (rejected on the CPU by the launcher) write nothing on a GPU.
    ok = (src >= 0) & (src < num_pool_blocks) & (dst >= 0) & (dst < num_blocks)
    # one of the two launches of a bulk flush with sink rows (sink_split): 1 takes the
    # blocks without a sink row, 2 those with one
    if MARKED == 1:
        ok = ok & (tl.load(sink_ptr + i) < 0)
    elif MARKED == 2:
        ok = ok & (tl.load(sink_ptr + i) >= 0)
    if ok:
        rec_ptr = packed_ptr + (dst * H + head) * RECORD_BYTES
        if which == 0:
            # K tile [D, G]: rows = channels (col_scale/zero_point), columns = tokens.
            sink_col = -1
            if PIN:
                sink_col = tl.load(sink_ptr + i)
            _flush_tile(
                exact_k_ptr,
                k_scale_ptr,
                src,
                head,
                rec_ptr,
                D,
                G,
                False,
                G,
                H,
                D,
                FP8,
                K_BITS,
                K_L,
                K_NB,
                K_NBP,
                KC_OFF,
                KC_PAD,
                KS_OFF,
                KS_PAD,
                KZ_OFF,
                KZ_PAD,
                KR_OFF,
                KR_PAD,
                ITERS,
                STD_FLOOR,
                K_ROUNDING,
                scr_ptr,
                cnt_ptr,
                part,
                PARTS,
                ASM,
                sink_col,
                False,
                PIN,
                PLANNED,
            )
        else:
            # V tile [G, D]: rows = tokens (row_scale/zero_point), columns = channels.
            sink_row = -1
            if SINK:
                sink_row = tl.load(sink_ptr + i)
            _flush_tile(
                exact_v_ptr,
                v_scale_ptr,
                src,
                head,
                rec_ptr,
                G,
                D,
                True,
                G,
                H,
                D,
                FP8,
                V_BITS,
                V_L,
                V_NB,
                V_NBP,
                VC_OFF,
                VC_PAD,
                VR_OFF,
                VR_PAD,
                VZ_OFF,
                VZ_PAD,
                VS_OFF,
                VS_PAD,
                ITERS,
                STD_FLOOR,
                V_ROUNDING,
                scr_ptr,
                cnt_ptr,
                part,
                PARTS,
                ASM,
                sink_row,
                SINK,
                False,
                PLANNED,
            )


_FIELD_KEYS = {
    "k_codes": "KC",
    "k_col_scale": "KS",
    "k_zero_point": "KZ",
    "k_row_scale": "KR",
    "v_codes": "VC",
    "v_col_scale": "VS",
    "v_row_scale": "VR",
    "v_zero_point": "VZ",
}


def record_constants(layout) -> dict:
    """Constexpr arguments of ``_flush_kernel`` for a dense layout: field offsets, the padding
    bytes after each field (up to the next field or the record end) and the pack geometry."""
    fields = sorted(layout.fields, key=lambda f: f.offset)
    out = {"RECORD_BYTES": layout.record_bytes}
    for f, nxt in zip(fields, [*fields[1:], None], strict=True):
        end = layout.record_bytes if nxt is None else nxt.offset
        key = _FIELD_KEYS[f.name]
        out[f"{key}_OFF"] = f.offset
        out[f"{key}_PAD"] = end - f.end
    for prefix, name in (("K", "k_codes"), ("V", "v_codes")):
        bits = layout.field(name).bits
        group, nb, nbp = pack_geometry(bits)
        out.update(
            {f"{prefix}_BITS": bits, f"{prefix}_L": group, f"{prefix}_NB": nb, f"{prefix}_NBP": nbp}
        )
    return out


#: Programs per tile from which a 4-warp tile's programs take 8 warps. Every program of a
#: split tile normalizes the whole tile (the redundant part of its time), and with 8 warps
#: each thread holds half the values: H100, 2 iterations, one block x 8 KV heads (8 programs
#: per tile), 30.3 -> 25.6 us at k4v2 and 31.4 -> 26.2 us at k2v2. With one program per tile
#: 8 warps are slower (bulk k4v2 14.6 -> 19.3 ms; offline 243 registers without spills, so an
#: SM holds one 8-warp program where it held two 4-warp ones: the same 8 warps).
SPLIT_WARPS_MIN_PARTS = 8


def warps_for(head_dim: int, group: int, parts: int = 1) -> int:
    """4 warps per 8192-value tile (64 fp32 values per thread), up to 16; 8 for a 4-warp
    tile split over at least :data:`SPLIT_WARPS_MIN_PARTS` programs."""
    warps = max(4, min(16, head_dim * group // 2048))
    if parts >= SPLIT_WARPS_MIN_PARTS and warps < 8:
        return 8
    return warps


def scratch_stride(group: int, head_dim: int) -> int:
    """fp32 scratch per tile when a tile takes several programs: its ``G*D`` balanced values,
    then ``R`` log row scales, ``R`` folded steps and ``R`` zero points (``R <= max(G, D)``)."""
    return group * head_dim + 3 * max(group, head_dim)


#: Programs per SM a split launch may fill. One: a tile's program is latency bound with one
#: warp per scheduler, and two programs sharing an SM slowed each other down (H200: 1 block
#: at 8 programs per tile 64 us, 2 blocks at 8 per tile, two per SM, 82 us; at 4 per tile
#: 73 us).
PROGRAMS_PER_SM = 1
#: Fewest rows a program of a split tile rounds.
MIN_PART_ROWS = 8


def parts_for(tiles: int, group: int, head_dim: int, sms: int) -> int:
    """Programs per tile for a launch of ``tiles`` tiles (N blocks x Hkv x 2) on a GPU with
    ``sms`` SMs: the largest power of two that keeps tiles x parts within ``sms *
    PROGRAMS_PER_SM`` programs, at most ``min(G, D) / MIN_PART_ROWS``; 1 when the tiles alone
    fill half of that or more.

    A tile's program took about 120 us on an H200 (8 normalization iterations and 15
    clipping candidates, 64 values per thread, one warp per scheduler), so a flush of a few
    blocks, as in every decode step where a request fills a block, costs that whatever N is.
    The programs of a split tile normalize redundantly (about 60 us of the 120) and share the
    clipping search (BENCHMARKS.md, "2026-12-04: the flush of a decode step"); with the
    default's 4 iterations a one-block step's flush took 42 us; with its 2 since 2026-12-05,
    the pattern search and 8 warps per program (:func:`warps_for`) 23.6 us (an H100,
    BENCHMARKS.md)."""
    slots = sms * PROGRAMS_PER_SM
    if 2 * tiles > slots:
        return 1
    cap = min(group, head_dim) // MIN_PART_ROWS
    parts = 1
    while parts * 2 <= cap and tiles * parts * 2 <= slots:
        parts *= 2
    return parts


#: Programs per tile chosen for the next launch: None = :func:`parts_for` (GPU) or 1 (the
#: interpreter); tests set an int.
FORCE_PARTS: int | None = None


#: Tiles per SM from which a flush with sink rows runs as two launches (:func:`sink_split`).
SINK_SPLIT_TILES_PER_SM = 16
#: Whether the next launch with sink rows splits: None = :func:`sink_split`; tests set a bool.
FORCE_SINK_SPLIT: bool | None = None


def sink_split(tiles: int, parts: int, sms: int) -> bool:
    """Whether a flush with ``sink_rows`` of ``tiles`` tiles at ``parts`` programs per tile
    runs as two launches: the blocks without a sink row through the kernel compiled without
    the sink steps, then the marked blocks (a request's first) with them, each program of the
    other kind exiting after one load. Compiled in, the sink steps cost every tile 3-8% of a
    bulk flush at 2-bit K, marked or not (BENCHMARKS.md, "2026-12-05"). Only for launches of
    many waves (at least ``SINK_SPLIT_TILES_PER_SM`` tiles per SM, one program each): the
    second launch runs after the first, so in a decode step's flush of a few blocks the
    marked block's tile would add its whole latency. ``sms`` 0 (the interpreter): no split."""
    if FORCE_SINK_SPLIT is not None:
        return FORCE_SINK_SPLIT
    return parts == 1 and sms > 0 and tiles >= SINK_SPLIT_TILES_PER_SM * sms


#: Most tiles one launch of the two-pass planned flush takes (``flush_plan.py``; the one pass
#: has no plan buffer and no chunks): its plan buffer,
#: ``tiles * plan_stride(G, D)`` fp32, is allocated per launch (46 MB at D 128, G 64), and a
#: bulk flush of more tiles runs in chunks of this many (H100, 4,096 blocks x 8 KV heads in
#: four chunks: 2.2-2.3% slower than one chunk of 184 MB, BENCHMARKS.md "2026-12-06").
PLAN_TILES_MAX = 16384


ROUNDING_IDS = {"rtn": 0, "unbiased_clip": 1}
"""Rounding modes of ``NormalizeConfig`` the kernel implements, and their ``ROUNDING`` ids;
``"unbiased_clip"`` with ``clip_search="pattern"`` is :data:`PATTERN_ID` (:func:`rounding_id`)."""
PATTERN_ID = tl.constexpr(2)


def rounding_id(name: str, rounding: str, clip_search: str = "window") -> int:
    """The kernel's ``ROUNDING`` id of a rounding mode and clipping search; ``name`` names the
    argument in errors."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"{name}: must be one of {ROUNDING_MODES}, got {rounding!r}")
    if clip_search not in CLIP_SEARCHES:
        raise ValueError(f"clip_search: must be one of {CLIP_SEARCHES}, got {clip_search!r}")
    if rounding not in ROUNDING_IDS:
        raise NotImplementedError(
            f"{name}: kvarn_ops.kernels.flush implements rounding {tuple(ROUNDING_IDS)}, got "
            f"{rounding!r}"
        )
    pattern = rounding == "unbiased_clip" and clip_search == "pattern"
    return PATTERN_ID.value if pattern else ROUNDING_IDS[rounding]


def check_config(config: NormalizeConfig) -> tuple[str, str]:
    """The (K, V) rounding modes of ``config`` if the kernel implements it: prescale, fp16
    rebalance, no log-scale clip, rounding and effective V rounding in :data:`ROUNDING_IDS`
    (any ``iters`` and ``std_floor``, passed through). Raises ValueError for a non-config and
    NotImplementedError, naming ``config``, for anything else."""
    if not isinstance(config, NormalizeConfig):
        raise ValueError(f"config: must be a NormalizeConfig, got {type(config).__name__}")
    if not config.prescale or not config.rebalance_fp16 or config.log_scale_clip is not None:
        raise NotImplementedError(
            f"config: kvarn_ops.kernels.flush implements prescale=True, rebalance_fp16=True and "
            f"log_scale_clip=None only, got {config}; use kvarn_ops.reference instead"
        )
    k_rounding = config.rounding
    v_rounding = config.rounding if config.rounding_v is None else config.rounding_v
    if k_rounding not in ROUNDING_IDS or v_rounding not in ROUNDING_IDS:
        raise NotImplementedError(
            f"config: kvarn_ops.kernels.flush implements rounding {tuple(ROUNDING_IDS)} for K "
            f"and V, got rounding={config.rounding!r}, rounding_v={config.rounding_v!r}; use "
            f"kvarn_ops.reference instead"
        )
    return k_rounding, v_rounding


def _launch(
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    src_pool_blocks,
    dst_blocks,
    packed,
    format_name: str,
    iters: int,
    std_floor: float,
    k_rounding: str,
    v_rounding: str,
    sink_rows: torch.Tensor | None = None,
    sink_key: bool = True,
    clip_search: str = "window",
) -> None:
    k_round = rounding_id("k_rounding", k_rounding, clip_search)
    v_round = rounding_id("v_rounding", v_rounding, clip_search)
    n = src_pool_blocks.shape[0]
    if n == 0:
        return
    p, g, hkv, d = exact_k.shape
    layout = kf.dense_layout(format_name, d)
    fp8 = exact_k.dtype == torch.float8_e4m3fn
    ks = k_scale if fp8 else exact_k
    vs = v_scale if fp8 else exact_v
    dev = exact_k.device
    tiles = n * hkv * 2
    sms = 0
    if dev.type == "cuda" and not INTERPRET:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if FORCE_PARTS is not None:
        parts = FORCE_PARTS
    elif sms:
        parts = parts_for(tiles, g, d, sms)
    else:
        parts = 1
    stride = scratch_stride(g, d)
    if parts > 1:
        # Zeroed per launch (one memset): launches on several streams never share counters.
        counters = scratch(tiles, torch.int32, dev, zero=True)
        scr_all = scratch(tiles * stride, torch.float32, dev)
    else:  # neither is read: any int32 tensor of the call will do
        counters = src_pool_blocks
        scr_all = src_pool_blocks.view(torch.float32)
    pin = sink_rows is not None and sink_key and layout.field("k_codes").bits in SINK_KEY_BITS
    # (MARKED, SINK, PIN) of each launch
    modes: tuple[tuple[int, bool, bool], ...]
    if sink_rows is None:
        modes = ((0, False, False),)
    elif sink_split(tiles, parts, sms):
        modes = ((1, False, False), (2, True, pin))
    else:
        modes = ((0, True, pin),)
    sink_arg = src_pool_blocks if sink_rows is None else sink_rows
    # The bulk launches without sink steps may take the planned flush (flush_plan.py), in
    # chunks of at most PLAN_TILES_MAX tiles (its plan buffer is transient memory).
    consts = record_constants(layout)
    engine = plan_engine(exact_k, g, d, consts) if parts == 1 else None
    for marked, sink, pin_k in modes:
        planned = engine is not None and not sink and not pin_k
        if planned and engine == "fused":
            # one pass (flush_onepass.py): no plan buffer, no chunks
            launch_onepass(
                exact_k,
                exact_v,
                ks,
                vs,
                src_pool_blocks,
                dst_blocks,
                sink_arg,
                packed,
                consts,
                k_round=k_round,
                v_round=v_round,
                pattern_id=PATTERN_ID.value,
                iters=iters,
                std_floor=std_floor,
                marked=marked,
            )
            continue
        step = max(1, PLAN_TILES_MAX // (2 * hkv)) if planned else n
        for lo in range(0, n, step):
            blocks = slice(lo, min(n, lo + step))
            nc = blocks.stop - blocks.start
            src_c, dst_c, sink_c = (t[blocks] for t in (src_pool_blocks, dst_blocks, sink_arg))
            scr, scr_stride = scr_all, stride
            if planned and engine is not None:
                scr_stride = plan_stride(g, d)
                scr = scratch(nc * hkv * 2 * scr_stride, torch.float32, dev)
                launch_plan(
                    engine,
                    exact_k,
                    exact_v,
                    ks,
                    vs,
                    src_c,
                    sink_c,
                    scr,
                    k_bits=consts["K_BITS"],
                    v_bits=consts["V_BITS"],
                    k_round=k_round,
                    v_round=v_round,
                    pattern_id=PATTERN_ID.value,
                    iters=iters,
                    std_floor=std_floor,
                    marked=marked,
                )
            launch(
                _flush_kernel,
                (nc, hkv, 2 * parts),
                exact_k,
                exact_v,
                ks,
                vs,
                src_c,
                dst_c,
                packed,
                scr,
                counters,
                sink_c,
                p,
                packed.shape[0],
                G=g,
                H=hkv,
                D=d,
                FP8=fp8,
                ITERS=iters,
                STD_FLOOR=std_floor,
                K_ROUNDING=k_round,
                V_ROUNDING=v_round,
                PARTS=parts,
                ASM=not INTERPRET,
                SCRATCH=scr_stride,
                SINK=sink,
                PIN=pin_k,
                MARKED=marked,
                PLANNED=planned,
                num_warps=warps_for(d, g, parts),
                **consts,
            )


@torch.library.custom_op("kvarn::flush", mutates_args=("packed",))
def _flush_op(
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    src_pool_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    packed: torch.Tensor,
    format_name: str,
    iters: int,
    std_floor: float,
    k_rounding: str,
    v_rounding: str,
    sink_rows: torch.Tensor | None = None,
    sink_key: bool = True,
    clip_search: str = "window",
) -> None:
    _launch(
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        src_pool_blocks,
        dst_blocks,
        packed,
        format_name,
        iters,
        std_floor,
        k_rounding,
        v_rounding,
        sink_rows,
        sink_key,
        clip_search,
    )


@_flush_op.register_fake
def _flush_fake(
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    src_pool_blocks,
    dst_blocks,
    packed,
    format_name,
    iters,
    std_floor,
    k_rounding,
    v_rounding,
    sink_rows=None,
    sink_key=True,
    clip_search="window",
) -> None:
    return None


def _flush_switches() -> tuple:
    """What :func:`flush`'s path reads besides its arguments (part of every plan's signature,
    :mod:`._fastlaunch`): the environment switches of the planned flush and the module
    settings that tests and benchmarks replace."""
    env = os.environ.get
    return (
        env("KVARN_FLUSH_PLAN"), env("KVARN_FLUSH_FUSED"), flush_plan.FORCE_PLAN, FORCE_PARTS,
        FORCE_SINK_SPLIT, PROGRAMS_PER_SM, MIN_PART_ROWS, SPLIT_WARPS_MIN_PARTS,
        SINK_SPLIT_TILES_PER_SM, PLAN_TILES_MAX, parts_for, sink_split, warps_for,
        _flush_kernel, plan_engine,
    )  # fmt: skip


_PLANS = PlanCache(_flush_switches)
"""Recorded launches of :func:`flush` calls (host time: see :mod:`._fastlaunch`)."""


def flush(
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    src_pool_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    packed: torch.Tensor,
    layout,
    sink_rows: torch.Tensor | None = None,
    *,
    config: NormalizeConfig = DEFAULT_CONFIG,
) -> None:
    """Pack N full pool blocks into records, every KV head, one launch (Triton).

    ``packed[dst_blocks[i], h]`` becomes the record of pool block ``src_pool_blocks[i]``, KV
    head ``h`` (normalize + quantize + fold + bit-pack, as ``kvarn_ops.reference.flush``).

    Parameters
    ----------
    exact_k, exact_v : [P, G, Hkv, D] float16/bfloat16/float8_e4m3fn pool, rotated frame (read).
    k_scale, v_scale : float32 [P, G, Hkv] for an fp8 pool, else None (read).
    src_pool_blocks, dst_blocks : int32 [N].
    packed : uint8 [num_blocks, Hkv, R], contiguous (written at ``dst_blocks`` only, every byte
        of those records).
    layout : dense ``kvarn_formats.RecordLayout`` with the pool's G and D.
    config : NormalizeConfig, keyword only; the reference default (what
        ``kvarn_ops.reference.flush`` uses) unless given. The records equal
        ``kvarn_ops.reference.encode_records(..., config=config)`` of the same tiles.
    sink_rows : int32 [N] or None, keyword only; the attention-sink token of block i (0 in a
        request's first block, -1 for none). With ``config.sink_token`` (the default) its V
        row is kept almost exact in every head's record (``reference/sink.py``) and, in 2-bit
        K tiles (``config.sink_key``), its key is on every channel's grid
        (``reference/sink_key.py``); None: no block has one (and the kernel is compiled
        without the steps).

    A repeated call of one signature (shapes, strides, dtypes, alignment, layout, config)
    replays the launches of the first without its checks (:mod:`._fastlaunch`); its scratch
    is allocated anew each time.

    Raises
    ------
    ValueError
        Naming the bad argument. Out-of-range block indices are reported for CPU tensors; on a
        GPU a program with an out-of-range index writes nothing.
    NotImplementedError
        For a ``config`` the kernel does not implement (see :func:`check_config`).
    """
    tensors = (exact_k, exact_v, k_scale, v_scale, src_pool_blocks, dst_blocks, packed, sink_rows)
    key = None
    if type(config) is NormalizeConfig:
        key = _PLANS.key(tensors, (id(layout), config))
    if _PLANS.replay(key, tensors):
        return
    with _PLANS.recording(key, tensors, keep=(layout,)):
        k_rounding, v_rounding = check_config(config)
        check_flush_args(
            exact_k,
            exact_v,
            k_scale,
            v_scale,
            src_pool_blocks,
            dst_blocks,
            packed,
            layout,
            sink_rows,
        )
        check_device(exact_k)
        launch_or_op(
            _flush_op,
            _launch,
            exact_k,
            exact_v,
            k_scale,
            v_scale,
            src_pool_blocks,
            dst_blocks,
            packed,
            layout.format_name,
            config.iters,
            float(config.std_floor),
            k_rounding,
            v_rounding,
            sink_rows if config.sink_token else None,
            config.sink_key,
            config.clip_search,
        )
