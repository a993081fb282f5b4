"""The bulk flush in one Gluon pass: a tile's plan and its finish in the same program.

The planned flush (``flush_plan.py``) runs a tile's normalization and clipping search in the
Gluon kernel of ``flush_rows.py`` (a row per thread), stores the plan, and has the Triton
flush reload the tile to round, fold and pack it. Here the same program goes on: the tile is
still in its registers a row per thread, so the winner's codes are one more rounding
(``flush_rows.codes_of``, the finish's ``clip_codes``), and the record's fields are written
from there:

- codes: each thread's ``C / TPR`` codes of one row are consecutive in the record's bit
  stream (code ``r * C + c`` at bit ``(r * C + c) * BITS``), so for ``BITS`` in 2, 4, 8 a
  thread shifts them into whole 32-bit words and stores those (:func:`pack_store`);
- steps 5-6: the row's folded scale and zero point ``exp(lr) * (step, lo)``, the column
  scales ``exp(lc)``, the power of two moved between the sides so every fp16 field is normal
  where possible (``_common.fp16_balance_shift``), saturating fp16 stores.

The finish's arithmetic, operation for operation (the same tile values, the same rounding,
the same scale formulas), on the same Gluon plan: the records are the two-pass flush's but
where the compiler contracted another multiply and add into one fused multiply-add in one of
the two kernels and a near tie of the search fell the other way (measured on an H100: 1-2
codes of 26 million at d128; ``gpu/test_dense_parity.py`` holds the two to the flush's bounds,
and each to the reference's). No plan buffer: a bulk flush of any size is one launch per tile
kind.

Scope: what ``flush_rows.geometry`` lays out a row per thread, with 2-, 4- or 8-bit codes on
both sides and fields that follow each other without padding (every such format so far;
others take the two passes, ``flush_plan.onepass_supported``). Gluon does not run under the
Triton interpreter: on the CPU a test compiles this module for sm_80, sm_90a and sm_120a, and
another checks the launcher's arguments against the record layout.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvarn_ops.kernels.flush_rows import (
    _frexp_exponent,
    _pow2,
    codes_of,
    inverse,
    load_tile,
    normalize,
    search_plan,
)

__all__ = ["ONEPASS_BITS", "flush_kernel"]

#: Code widths this kernel packs (whole codes per 32-bit word).
ONEPASS_BITS = (2, 4, 8)


@gluon.jit
def rtn_codes(b, LEVELS: gl.constexpr):
    """Min/max RTN of each row (``flush._round_rows`` with ``ROUNDING == 0``): codes, step,
    zero point; ``levels / rng`` as torch's reversed division, two IEEE roundings."""
    LR: gl.constexpr = gl.SliceLayout(1, b.type.layout)
    lo = gl.min(b, axis=1)
    rng = gl.max(b, axis=1) - lo
    pos = rng > 0.0
    one = gl.full(rng.shape, 1.0, gl.float32, LR)
    inv = gl.where(pos, gl.div_rn(one, gl.where(pos, rng, 1.0)) * LEVELS, 0.0)
    step = gl.div_rn(rng, gl.full(rng.shape, LEVELS, gl.float32, LR))
    return codes_of(b, lo, inv, LEVELS), step, lo


@gluon.jit
def pack_store(ptr, q, R: gl.constexpr, C: gl.constexpr, BITS: gl.constexpr):
    """Store the fp32 integer codes ``q [R, C]`` (a row, or a run of whole words of one, per
    thread) as the little-endian bit stream ``r * C + c`` at ``ptr`` (4-byte aligned), in
    32-bit words."""
    L: gl.constexpr = q.type.layout
    CPW: gl.constexpr = 32 // BITS
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, L)), 1)
    c = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, L)), 0)
    shifted = q.to(gl.int32) << ((c % CPW) * BITS)
    word_of = r * (C // CPW) + c // CPW
    # the CPW codes of a word hold disjoint bits: their sum is their bitwise OR
    words = gl.sum(gl.reshape(shifted, [R, C // CPW, CPW]), axis=2)
    offs = gl.max(gl.reshape(word_of, [R, C // CPW, CPW]), axis=2)
    gl.store(ptr.to(gl.pointer_type(gl.int32)) + offs, words)


@gluon.jit
def store_f16(ptr, values):
    """Saturating fp16 store of a 1-D vector (the reference's ``_to_fp16``)."""
    n = gl.arange(0, values.shape[0], layout=values.type.layout)
    v = gl.minimum(gl.maximum(values, -65504.0), 65504.0)
    gl.store(ptr.to(gl.pointer_type(gl.float16)) + n, v.to(gl.float16))


@gluon.jit
def balance_shift(s, z, w, e):
    """``_common.fp16_balance_shift``: the exponent ``j`` moved between the row side (``s``,
    ``z``, stored times ``2**(e + j)``) and the column side (``w``, times ``2**-j``)."""
    mag = gl.maximum(gl.abs(s), gl.abs(z))
    nz = mag > 0.0
    ea = _frexp_exponent(mag) + e
    big = 536870911  # int32 max // 4, as the reference
    a_lo = gl.min(gl.where(nz, ea, big), axis=0)
    a_hi = gl.max(gl.where(nz, ea, -big), axis=0)
    eb = _frexp_exponent(w)
    b_lo = gl.min(eb, axis=0)
    b_hi = gl.max(eb, axis=0)
    has_a = gl.max(nz.to(gl.int32), axis=0) > 0
    lower = gl.where(has_a, gl.maximum(-13 - a_lo, b_hi - 15), b_hi - 15)
    upper = gl.where(has_a, gl.minimum(15 - a_hi, b_lo + 13), b_lo + 13)
    return (lower + upper) >> 1


@gluon.jit
def flush_kernel(
    pool_ptr,
    scale_ptr,
    src_ptr,
    dst_ptr,
    sink_ptr,
    packed_ptr,
    num_pool_blocks,
    num_blocks,
    G: gl.constexpr,
    H: gl.constexpr,
    D: gl.constexpr,
    R: gl.constexpr,
    C: gl.constexpr,
    TOKENS_ON_ROWS: gl.constexpr,
    FP8: gl.constexpr,
    BITS: gl.constexpr,
    SEARCH: gl.constexpr,
    PATTERN: gl.constexpr,
    ITERS: gl.constexpr,
    STD_FLOOR: gl.constexpr,
    TPR: gl.constexpr,
    TPC: gl.constexpr,
    WARPS: gl.constexpr,
    MARKED: gl.constexpr,
    RECORD_BYTES: gl.constexpr,
    CODES_OFF: gl.constexpr,
    ROW_SCALE_OFF: gl.constexpr,
    ROW_ZP_OFF: gl.constexpr,
    COL_SCALE_OFF: gl.constexpr,
):
    """Flush tile ``(program_id(0), program_id(1))`` of one kind into its record: K tiles
    (``[D, G]``, tokens on columns; row side = the channel scale and zero point, column side
    = the token scale) or V tiles (``[G, D]``, tokens on rows; row side = the token scale and
    zero point, column side = the channel scale). ``MARKED == 1``: only blocks without a sink
    row (the others take the single pass)."""
    L: gl.constexpr = gl.BlockedLayout([1, C // TPR], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([R // TPC, 1], [TPC, 32 // TPC], [1, WARPS], [0, 1])
    LEVELS: gl.constexpr = (1 << BITS) - 1
    i = gl.program_id(0)
    head = gl.program_id(1)
    src = gl.load(src_ptr + i).to(gl.int64)
    dst = gl.load(dst_ptr + i).to(gl.int64)
    # out-of-range indices (rejected on the host by the launcher) write nothing
    ok = (src >= 0) & (src < num_pool_blocks) & (dst >= 0) & (dst < num_blocks)
    if MARKED == 1:
        ok = ok & (gl.load(sink_ptr + i) < 0)
    if ok:
        xp, xt, e = load_tile(
            pool_ptr, scale_ptr, src, head, G, H, D, R, C, TOKENS_ON_ROWS, FP8, L, LT
        )
        lr, lc = normalize(xp, xt, R, C, ITERS, STD_FLOOR * STD_FLOOR)
        lcp = gl.convert_layout(lc, gl.SliceLayout(0, L))
        b = (xp * gl.expand_dims(gl.exp(-lr), 1)) * gl.expand_dims(gl.exp(-lcp), 0)
        if SEARCH:
            z, s, step, lo = search_plan(b, lcp, R, LEVELS, PATTERN)
            q = codes_of(b, z, inverse(gl.abs(s)), LEVELS)
        else:
            q, step, lo = rtn_codes(b, LEVELS)
        rec = packed_ptr + (dst * H + head) * RECORD_BYTES
        pack_store(rec + CODES_OFF, q, R, C, BITS)
        # Steps 5-6: fold, move powers of two between the sides, store fp16.
        row_mult = gl.exp(lr)
        s_f = row_mult * step
        z_f = row_mult * lo
        w = gl.exp(lc)
        j = balance_shift(s_f, z_f, w, e)
        shift_a = _pow2(e + j)
        store_f16(rec + ROW_SCALE_OFF, s_f * shift_a)
        store_f16(rec + ROW_ZP_OFF, z_f * shift_a)
        store_f16(rec + COL_SCALE_OFF, w * _pow2(-j))
