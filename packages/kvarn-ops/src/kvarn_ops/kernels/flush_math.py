"""The flush's quantizer arithmetic, cheaper than the reference's literal form (Triton helpers).

The reference quantizer (``reference/quantize.py``, ``reference/rounding.py``) is written to be
read. Every normalization iteration takes three two-pass spreads of freshly scaled tiles. The
flush computes the same quantities with fewer operations per tile element:

- **Normalization** (:func:`normalize_tile`): two passes over the tile per iteration, the row
  moments of the iterate after the column update and the column moments of the iterate after
  the row update. The reference's third spread is not needed:
  - after the row update every row's spread is exactly 1 (std and rms both scale with the
    row; a zero row is filled with the geometric mean of the others, 1), so an iterate's
    imbalance is its column ratio plus 1;
  - the column spreads of an iterate are the next column update.
  Spreads are carried as logarithms, ``0.5 * log(max(var, floor**2 * ms))``. That needs no
  square roots, and the zero-line fill (a geometric mean) becomes an arithmetic mean of
  logs. The mean square ``ms`` (it only sets the floor) is ``var + mean**2``, not a third
  reduction of the tile: two reductions per pass instead of three. The scaled tiles are
  formed as the reference forms them, ``(xp * exp(-lr)) * exp(-lc)``, so their values, and
  the spreads' sums but for order, are the reference's.
- **Clipping search** (:func:`unbiased_clip_search`): the reference's candidates, refit and
  error sums, but only the winner's clipping range is carried through the loop and its refit
  is recomputed once after it: two live row vectors instead of four, in a loop at the
  register limit. Two shortcuts were tried and not kept (:func:`_refit` says why): the
  covariance in one reduction round, and an approximate quotient for the step. A third was
  also dropped: the error of each candidate from the refit's moments (an expansion in the
  variance, covariance and code variance, which saves the error pass). It cancels
  catastrophically in rows that the codes fit almost exactly; offline it picked candidates
  with up to 2.3x the reference's error. Tried again with the reference scoring the same way
  (up to 5 bits, clamped at 0: summed error of the chosen candidates within 1e-7 of the
  literal form on normalized Gaussian and Student-t tiles), it saved too little to keep:
  sm_90a, k4v2 D 128, loop instructions per candidate 1,582 -> 1,506 (K tile) and 1,586 ->
  1,431 (V tile), spill frame 368 -> 512 B. About 830 of the V tile's 1,431 are per-value
  arithmetic (64 values a thread, 13 operations each); the rest are the rows' scalars (8 rows
  a thread, each replicated over the 16 lanes that share it, two correctly rounded quotients
  per row), the reductions' shuffles and, in the K tile, whose rows span the four warps,
  shared-memory rounds and spill loads.

Equal in exact arithmetic. In fp32 they differ from the reference's results by rounding, as a
different reduction order does. Measured in ``tests/test_flush.py`` and in the GPU parity
suite, with the same code agreement and error bounds as the literal form.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn_ops.kernels._common import CLIP_COUNT_BY_LEVELS, clip_codes, clip_ratio
from kvarn_ops.kernels.flush_sync import exchange, partials
from kvarn_ops.reference.rounding import CLIP_PATTERNS


# The pattern searches (reference ``CLIP_PATTERNS``) as compile-time tables indexed by
# ``LEVELS = 2**bits - 1`` (0 where a width has none). The per-candidate tables are flat,
# candidate ``i`` of width ``LEVELS`` at ``LEVELS * _PAT_MAX + i`` (Triton indexes a constexpr
# tuple of scalars, not of tuples): a start's ``k`` (0 for a step's candidates), a step's
# offset (0 for starts), and whether the candidate opens a step (its centre becomes the best
# so far).
def _pattern_of(levels: int):
    bits = (levels + 1).bit_length() - 1
    return CLIP_PATTERNS.get(bits) if levels + 1 == 1 << bits else None


def _by_levels(fn, empty):
    return tl.constexpr(tuple(fn(p) if p else empty for p in map(_pattern_of, range(256))))


def _candidates(p) -> tuple[tuple[float, float, int], ...]:
    starts = tuple((float(k), 0.0, 0) for k in p.starts)
    steps = tuple((0.0, float(o), int(o < 0)) for h in p.steps for o in (-h, h))
    return starts + steps


_PAT_MAX_N = max(p.count for p in CLIP_PATTERNS.values())
_PAT_MAX = tl.constexpr(_PAT_MAX_N)


def _flat(field: int, empty):
    out = []
    for levels in range(256):
        p = _pattern_of(levels)
        rows = [c[field] for c in _candidates(p)] if p else []
        out += rows + [empty] * (_PAT_MAX_N - len(rows))
    return tl.constexpr(tuple(out))


_PAT_N = _by_levels(lambda p: p.count, 0)
_PAT_STARTS = _by_levels(lambda p: len(p.starts), 0)
_PAT_K = _flat(0, 0.0)
_PAT_OFF = _flat(1, 0.0)
_PAT_OPEN = _flat(2, 0)
_PAT_LO = _by_levels(lambda p: float(p.lo), 0.0)
_PAT_HI = _by_levels(lambda p: float(p.hi), 0.0)
_PAT_UNIT = _by_levels(lambda p: 1.0 / p.denom, 0.0)

__all__ = [
    "clip_search_plan",
    "finish_planned",
    "normalize_split",
    "normalize_tile",
    "unbiased_clip_search",
]


@triton.jit
def _line_moments(u, AXIS: tl.constexpr, N: tl.constexpr):
    """Population variance (two-pass) and mean square of every line of ``u`` along AXIS (N
    values). The mean square is ``var + mean**2``: equal in exact arithmetic, and it saves a
    reduction of the whole tile (the mean square only sets the spread's floor)."""
    mean = tl.sum(u, axis=AXIS) / N
    if AXIS == 0:
        dev = u - mean[None, :]
    else:
        dev = u - mean[:, None]
    var = tl.sum(dev * dev, axis=AXIS) / N
    return var, var + mean * mean


@triton.jit
def _half_log(var, ms, STD_FLOOR2: tl.constexpr):
    """``log(max(std, floor * rms))`` of lines with this variance and mean square, as
    ``0.5 * log(max(var, floor**2 * ms))`` (no square roots), and whether it is positive;
    ``(0, False)`` for a zero line."""
    v = tl.maximum(var, STD_FLOOR2 * ms)
    pos = v > 0.0
    return 0.5 * tl.log(tl.where(pos, v, 1.0)), pos


@triton.jit
def _log_spread(half_log, pos):
    """Natural log of the reference ``_spread``: ``half_log`` where positive, else the mean of
    those (the log of the geometric mean of the positive spreads; 0 if there are none)."""
    count = tl.sum(pos.to(tl.int32), axis=0)
    fill = tl.sum(tl.where(pos, half_log, 0.0), axis=0) / tl.maximum(count, 1).to(tl.float32)
    return tl.where(pos, half_log, fill)


@triton.jit
def _ratio(log_spread):
    """max/min of the spreads, from their logs (one term of the reference ``_imbalance``)."""
    return tl.exp(tl.max(log_spread, axis=0) - tl.min(log_spread, axis=0))


@triton.jit
def normalize_tile(
    xp, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, STD_FLOOR: tl.constexpr
):
    """The reference ``normalize_tiles`` (step 3) of one prescaled tile ``xp [R, C]``: the
    natural-log scales ``(lr [R], lc [C])`` of the best-balanced iterate among 0..ITERS (ties
    keep the earlier one). Two passes per iteration (module docstring)."""
    FLOOR2: tl.constexpr = STD_FLOOR * STD_FLOOR
    lr = tl.zeros([R], dtype=tl.float32)
    lc = tl.zeros([C], dtype=tl.float32)
    var_c, ms_c = _line_moments(xp, 0, R)
    hl_c, pos_c = _half_log(var_c, ms_c, FLOOR2)
    lcs = _log_spread(hl_c, pos_c)
    var_r, ms_r = _line_moments(xp, 1, C)
    hl_r, pos_r = _half_log(var_r, ms_r, FLOOR2)
    best = _ratio(lcs) + _ratio(_log_spread(hl_r, pos_r))
    best_lr = lr
    best_lc = lc
    for _ in range(ITERS):
        # lcs: the column log spreads of the current iterate (lr, lc)
        lc = lc + lcs
        b = tl.exp(-lc)
        var_r, ms_r = _line_moments((xp * tl.exp(-lr)[:, None]) * b[None, :], 1, C)
        hl_r, pos_r = _half_log(var_r, ms_r, FLOOR2)
        lr = lr + _log_spread(hl_r, pos_r)
        var_c, ms_c = _line_moments((xp * tl.exp(-lr)[:, None]) * b[None, :], 0, R)
        hl_c, pos_c = _half_log(var_c, ms_c, FLOOR2)
        lcs = _log_spread(hl_c, pos_c)
        # every row of the new iterate has spread 1 (zero rows: the geometric mean of 1s)
        imb = _ratio(lcs) + 1.0
        better = imb < best
        best = tl.where(better, imb, best)
        best_lr = tl.where(better, lr, best_lr)
        best_lc = tl.where(better, lc, best_lc)
    return best_lr, best_lc


@triton.jit
def _column_log_spreads(g1, g2, R: tl.constexpr, RP: tl.constexpr, FLOOR2: tl.constexpr):
    """The column log spreads (``_log_spread`` of ``_half_log``) of a tile from its row slices'
    partials ``[PARTS, C]`` (sums, squared deviations from the slice means): the variance
    combined as Chan, Golub and LeVeque's pairwise update, ``M2 = sum M2_p + RP * sum (mean_p -
    mean)**2``, stable where a column's mean dwarfs its spread; the mean square as in
    :func:`_line_moments`."""
    mean = tl.sum(g1, axis=0) / R
    d = g1 / RP - mean[None, :]
    var = (tl.sum(g2, axis=0) + RP * tl.sum(d * d, axis=0)) / R
    hl, pos = _half_log(var, var + mean * mean, FLOOR2)
    return _log_spread(hl, pos)


@triton.jit
def normalize_split(
    xp,
    scr,
    cnt,
    slot0,
    part,
    R: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    PARTS: tl.constexpr,
    EMU: tl.constexpr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
):
    """:func:`normalize_tile` of a tile ``[R, C]`` whose rows are split over ``PARTS``
    programs: ``xp`` holds this program's ``RP = R / PARTS`` rows (the whole tile when
    ``EMU``, ``flush_sync``). Returns ``(lr, lc)``: the log scales of this program's rows and
    of every column, the best-balanced iterate's, as :func:`normalize_tile` chooses it.

    Row statistics stay local. Column statistics take one exchange per iteration (slots
    ``slot0 .. slot0 + ITERS``): each program's column sums and squared deviations, combined
    by every program in the same order (:func:`_column_log_spreads`), so all of them take the
    same column scales and the same best iterate. The first exchange also carries each
    slice's extreme row log spreads (iterate 0's row imbalance, the only one not equal to 1).
    A zero row's log scale stays 0 instead of the other rows' mean: it scales zeros, and its
    folded scale and zero point are 0 either way."""
    FLOOR2: tl.constexpr = STD_FLOOR * STD_FLOOR
    M: tl.constexpr = R if EMU else RP
    lr = tl.zeros([M], dtype=tl.float32)
    lc = tl.zeros([C], dtype=tl.float32)
    # Iterate 0: the rows' extreme log spreads ride in the first exchange (entries 0 and 1 of
    # a third partial, as -max and min, so that the parts' entries combine by min).
    var_r, ms_r = _line_moments(xp, 1, C)
    hl_r, pos_r = _half_log(var_r, ms_r, FLOOR2)
    c = tl.arange(0, C)
    if EMU:
        hl3 = tl.reshape(hl_r, [PARTS, RP])
        pos3 = tl.reshape(pos_r, [PARTS, RP])
        neg_hi = tl.min(tl.where(pos3, -hl3, float("inf")), axis=1)[:, None]
        lo = tl.min(tl.where(pos3, hl3, float("inf")), axis=1)[:, None]
        ext = tl.where(c[None, :] == 0, neg_hi, tl.where(c[None, :] == 1, lo, 0.0))
    else:
        neg_hi = tl.min(tl.where(pos_r, -hl_r, float("inf")), axis=0)
        lo = tl.min(tl.where(pos_r, hl_r, float("inf")), axis=0)
        ext = tl.where(c == 0, neg_hi, tl.where(c == 1, lo, 0.0))
    s1, m2 = partials(xp, RP, C, PARTS, EMU)
    g1, g2, g3 = exchange(scr, cnt, slot0, part, s1, m2, ext, 3, C, PARTS, EMU)
    lcs = _column_log_spreads(g1, g2, R, RP, FLOOR2)
    neg_hi = tl.min(tl.min(tl.where(c[None, :] == 0, g3, float("inf")), axis=1), axis=0)
    lo = tl.min(tl.min(tl.where(c[None, :] == 1, g3, float("inf")), axis=1), axis=0)
    # No positive row: every log spread 0 (the fill of an empty mean), ratio 1.
    row_ratio = tl.where(lo < float("inf"), tl.exp(-neg_hi - lo), 1.0)
    best = _ratio(lcs) + row_ratio
    best_lr = lr
    best_lc = lc
    for it in range(ITERS):
        lc = lc + lcs
        b = tl.exp(-lc)
        var_r, ms_r = _line_moments((xp * tl.exp(-lr)[:, None]) * b[None, :], 1, C)
        hl_r, pos_r = _half_log(var_r, ms_r, FLOOR2)
        lr = lr + tl.where(pos_r, hl_r, 0.0)
        s1, m2 = partials((xp * tl.exp(-lr)[:, None]) * b[None, :], RP, C, PARTS, EMU)
        g1, g2, _ = exchange(scr, cnt, slot0 + 1 + it, part, s1, m2, s1, 2, C, PARTS, EMU)
        lcs = _column_log_spreads(g1, g2, R, RP, FLOOR2)
        imb = _ratio(lcs) + 1.0
        better = imb < best
        best = tl.where(better, imb, best)
        best_lr = tl.where(better, lr, best_lr)
        best_lc = tl.where(better, lc, best_lc)
    return best_lr, best_lc


@triton.jit
def _refit(c, w, b, mb, vb, s, z, rsw):
    """The unbiased refit of every row for codes ``c``, as the reference computes it: ``mq =
    (sum w c) rsw``, ``cov = (sum w (c - mq)(b - mb)) rsw`` (``rsw = 1 / sum w``, the tile's),
    ``step = vb / cov``, ``lo = mb - step * mq``, or the clipped ``(s, z)`` where ``cov <= 0``;
    the quotient IEEE (``div_rn``) as torch's.

    The covariance keeps the reference's form (two reduction rounds). Folding ``mq`` out of it
    (one round: ``sum w c (b - mb)``, the ``mq`` term being zero but for rounding) changed the
    result where one column carries almost all the weight: its ``b - mb`` is then rounding
    noise that ``c - mq`` multiplies down, and without that factor the noise swamped the
    covariance (36 of 2048 V codes of the special tiles' outlier tile differed from the
    reference). Likewise the step's quotient stays exact: with an approximate one (2 ulp) the
    H200 picked another of two nearly tied candidates in some rows (codes 2 apart)."""
    mq = tl.sum(w * c, axis=1) * rsw
    cov = tl.sum((w * (c - mq[:, None])) * (b - mb[:, None]), axis=1) * rsw
    ok = cov > 0.0
    s_u = tl.where(ok, tl.div_rn(vb, tl.where(ok, cov, 1.0)), s)
    return s_u, tl.where(ok, mb - s_u * mq, z)


@triton.jit
def _pick(i, TABLE: tl.constexpr, BASE: tl.constexpr, N: tl.constexpr):
    """``TABLE[BASE + i]`` for a runtime scalar ``0 <= i < N`` (a chain of selects)."""
    v = TABLE[BASE]
    for j in tl.static_range(1, N):
        v = tl.where(i == j, TABLE[BASE + j], v)
    return v


@triton.jit
def _pattern_range(k, mid, half, LEVELS: tl.constexpr):
    """The clipped range of candidate ``k`` (per row) of the pattern search, as the reference
    forms it: ``r = k / denom`` (exact), ``lo = mid - r * half``, ``step = half * (r * 2 /
    LEVELS)`` with ``2 / LEVELS`` the fp32 constant."""
    r = k * _PAT_UNIT[LEVELS]
    f: tl.constexpr = 2.0 / LEVELS
    return mid - r * half, half * (r * f)


@triton.jit
def unbiased_clip_search(
    b, lc, LEVELS: tl.constexpr, R: tl.constexpr, C: tl.constexpr, PATTERN: tl.constexpr = False
):
    """The reference's ``round_rows(b, lc, bits, "unbiased_clip", search)`` for one balanced
    tile ``b [R, C]`` (fp32) with natural-log column scales ``lc [C]``; ``LEVELS = 2**bits - 1``;
    ``PATTERN`` the ``"pattern"`` search (``CLIP_PATTERNS[bits]``; the window at other
    widths), else the window.

    Returns ``(codes, step, lo)``: fp32 integer codes ``[R, C]``, fp32 ``[R]`` each, with ``b ~=
    codes * step + lo``. Same candidates in the same order (min/max first, then the first
    ``CLIP_COUNTS[bits]`` clip ratios, each with its unbiased refit), the candidate's codes from the
    same fp32 expression, strict ``<`` (ties keep the earlier candidate), zero-range rows keep
    min/max; sums as the module docstring says. Only the winner's clipping range is carried through
    the search; its codes and refit are recomputed from it at the end. The pattern search carries
    each row's best ``k`` (-1: min/max) and its step's centre instead, the candidate's ``k`` per
    row from the tables above (no per-row table: ``k / denom`` is exact).
    """
    w, mb, vb, rsw, code_z, code_s, refit = _search(b, lc, LEVELS, R, PATTERN)
    return _finish(b, w, mb, vb, rsw, code_z, code_s, refit, LEVELS)


@triton.jit
def _search(b, lc, LEVELS: tl.constexpr, R: tl.constexpr, PATTERN: tl.constexpr):
    """The search of :func:`unbiased_clip_search` up to its winner: the weights and moments
    the refit needs, and each row's winning clipping range and whether it is refit."""
    lo0 = tl.min(b, axis=1)
    hi0 = tl.max(b, axis=1)
    rng = hi0 - lo0
    lv = tl.full([R], LEVELS, tl.float32)
    step0 = tl.div_rn(rng, lv)
    w, mb, db, vb, rsw = _weighted_moments(b, lc, R)
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * rng

    c0 = clip_codes(b, lo0, step0, LEVELS)
    err = b - (c0 * step0[:, None] + lo0[:, None])
    # A zero-range row keeps min/max: no error is below -1.
    best_e = tl.where(rng > 0.0, tl.sum(err * err * w, axis=1), -1.0)
    if PATTERN and _PAT_N[LEVELS] > 0:
        code_z, code_s, refit = _pattern_loop(
            b, w, mb, vb, rsw, mid, half, lo0, step0, best_e, LEVELS
        )
    else:
        code_z, code_s, refit = _window_loop(
            b, w, mb, vb, rsw, mid, half, lo0, step0, best_e, LEVELS
        )
    return w, mb, vb, rsw, code_z, code_s, refit


@triton.jit
def _weighted_moments(b, lc, R: tl.constexpr):
    """The search's column weights ``exp(2 * (lc - max lc))`` ``[1, C]``, each row's weighted
    mean ``mb``, deviations ``db``, weighted variance ``vb`` and the tile's ``1 / sum w``."""
    w1 = tl.exp(2.0 * (lc - tl.max(lc, axis=0)))
    w = w1[None, :]
    sw = tl.zeros([R], tl.float32) + tl.sum(w1, axis=0)
    mb = tl.div_rn(tl.sum(w * b, axis=1), sw)
    db = b - mb[:, None]
    vb = tl.div_rn(tl.sum(w * (db * db), axis=1), sw)
    rsw = tl.div_rn(1.0, tl.sum(w1, axis=0))  # a scalar: one register, not one per row
    return w, mb, db, vb, rsw


@triton.jit
def _finish(b, w, mb, vb, rsw, code_z, code_s, refit, LEVELS: tl.constexpr):
    """The winner's codes from its clipping range ``(code_z, code_s)`` and, where ``refit``,
    its unbiased refit (else the range itself: min/max)."""
    codes = clip_codes(b, code_z, code_s, LEVELS)
    step, lo = _refit(codes, w, b, mb, vb, code_s, code_z, rsw)
    step = tl.where(refit, step, code_s)
    lo = tl.where(refit, lo, code_z)
    return codes, step, lo


@triton.jit
def clip_search_plan(b, lc, LEVELS: tl.constexpr, R: tl.constexpr, PATTERN: tl.constexpr = False):
    """The winner of :func:`unbiased_clip_search` as a plan: each row's clipping range ``(z,
    s)``, ``s`` negated where the winner is min/max (no refit), and the ``(step, lo)`` the
    search returns; :func:`finish_planned` gives its codes. The planned flush
    (``flush_plan.py``) stores it."""
    w, mb, vb, rsw, code_z, code_s, refit = _search(b, lc, LEVELS, R, PATTERN)
    _, step, lo = _finish(b, w, mb, vb, rsw, code_z, code_s, refit, LEVELS)
    return code_z, tl.where(refit, code_s, -code_s), step, lo


@triton.jit
def finish_planned(b, code_z, signed_s, LEVELS: tl.constexpr):
    """:func:`unbiased_clip_search`'s codes from a plan of :func:`clip_search_plan` (or its
    Gluon twin): the winner's clipping range rounds the tile (its step and zero point are in
    the plan)."""
    return clip_codes(b, code_z, tl.abs(signed_s), LEVELS)


@triton.jit
def _candidate_error(b, z, s, w, mb, vb, rsw, LEVELS: tl.constexpr):
    """Each row's weighted error of the candidate with clipped range ``(z, s)``: its codes, the
    unbiased refit, the error sum."""
    c = clip_codes(b, z, s, LEVELS)
    s_u, z_u = _refit(c, w, b, mb, vb, s, z, rsw)
    err = b - (c * s_u[:, None] + z_u[:, None])
    return tl.sum(err * err * w, axis=1)


@triton.jit
def _window_loop(b, w, mb, vb, rsw, mid, half, lo0, step0, best_e, LEVELS: tl.constexpr):
    """The window's candidates; the winner's ``(lo, step)`` and whether it is refit (not
    min/max)."""
    # Only the winner's clipping range is carried (fewer live vectors: the loop is at the
    # register limit); a negative step marks min/max, which has no refit.
    code_z = lo0
    code_s = -step0
    count: tl.constexpr = CLIP_COUNT_BY_LEVELS[LEVELS]
    for i in tl.range(0, count, loop_unroll_factor=1):
        ratio = clip_ratio(i, count)
        z = mid - ratio * half
        # the reference's step_factor: one quotient per candidate, not per row
        s = half * tl.div_rn(2.0 * ratio, LEVELS * 1.0)
        e = _candidate_error(b, z, s, w, mb, vb, rsw, LEVELS)
        better = e < best_e
        best_e = tl.where(better, e, best_e)
        code_z = tl.where(better, z, code_z)
        code_s = tl.where(better, s, code_s)
    return code_z, tl.abs(code_s), code_s > 0.0


@triton.jit
def _pattern_loop(b, w, mb, vb, rsw, mid, half, lo0, step0, best_e, LEVELS: tl.constexpr):
    """The pattern search's candidates (``CLIP_PATTERNS[bits]``): each row's best ``k`` so far (-1:
    min/max) and the centre of the current step (the best at its start, min/max as the grid's
    top) are carried; returns as :func:`_window_loop`."""
    n: tl.constexpr = _PAT_N[LEVELS]
    lo_k: tl.constexpr = _PAT_LO[LEVELS]
    hi_k: tl.constexpr = _PAT_HI[LEVELS]
    best_k = tl.full(best_e.shape, -1.0, tl.float32)
    at: tl.constexpr = LEVELS * _PAT_MAX
    base = tl.full(best_e.shape, hi_k, tl.float32)
    for i in tl.range(0, n, loop_unroll_factor=1):
        opens = _pick(i, _PAT_OPEN, at, n)
        base = tl.where(opens != 0, tl.where(best_k < 0.0, hi_k, best_k), base)
        k_step = tl.minimum(tl.maximum(base + _pick(i, _PAT_OFF, at, n), lo_k), hi_k)
        k = tl.where(i < _PAT_STARTS[LEVELS], _pick(i, _PAT_K, at, n), k_step)
        z, s = _pattern_range(k, mid, half, LEVELS)
        e = _candidate_error(b, z, s, w, mb, vb, rsw, LEVELS)
        better = e < best_e
        best_e = tl.where(better, e, best_e)
        best_k = tl.where(better, k, best_k)
    refit = best_k >= 0.0
    z, s = _pattern_range(tl.maximum(best_k, 0.0), mid, half, LEVELS)
    return tl.where(refit, z, lo0), tl.where(refit, s, step0), refit
