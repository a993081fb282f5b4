"""The bulk flush's normalization and clipping search in Gluon, with layouts chosen by hand.

The first of a planned flush's two passes (``flush_plan.py``) on a CUDA GPU: one program per
tile, which loads the tile, prescales and normalizes it and runs the clipping search, then
stores the plan: the log scales ``lr [R]``, ``lc [C]``, each row's winning clipping range
``(z, s)`` (``s`` negated for min/max) and its step and zero point after the refit. The
second pass (the Triton flush with ``PLANNED``) turns the plan into the record: codes, fold,
fp16 rebalance, bit-pack.

Why Gluon: Triton chooses the flush tile's register layout itself, and for a ``[128, 64]``
fp32 tile at 4 warps it spreads each row over 8-16 threads, so every per-row sum of the search
is a shuffle tree and each row's scalar work (the candidate's step, the refit's quotient, the
comparison) is repeated in each of those threads. Here a thread holds a whole row
(``size_per_thread = [1, C / TPR]``, ``TPR = 2`` threads a row at 128 columns), and for the
normalization a second copy of the tile holds a whole column per thread, made once through
shared memory; only the R + C line scales cross between the two copies each iteration. On an
H100, 32,768 tiles of each shape (``benchmarks/probe_flush_columns.py``, ``probe_flush_norm.py``,
BENCHMARKS.md "2026-12-06"): the search 5.0 -> 1.15 ms (4-bit K tiles, window) and 11.3 -> 2.8
ms (2-bit V tiles, 14-ratio window), the normalization 2.0 -> 1.1 ms and 2.5 -> 1.1 ms.

Same candidates, formulas and order of operations as ``flush_math`` (``normalize_tile``,
``clip_search_plan``) but for the order of each sum's terms and, in the search's candidates,
a fused multiply-add for the code argument and the refit's covariance as ``sum(w * (b - mb) *
q)`` (11 operations per value and candidate instead of 14; BENCHMARKS.md "2026-12-06, later"):
codes agree with the reference's as the Triton flush's do (checked on the GPU by
``gpu/test_dense_parity.py``). Gluon does not
run under the Triton interpreter; a CPU test compiles this module for sm_90a and sm_120a, and
the Triton twin of the plan (``flush_plan._plan_kernel``) is what the interpreter runs.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvarn_ops.kernels._common import CLIP_COUNT_BY_LEVELS, CLIP_RATIOS
from kvarn_ops.kernels.flush_math import (
    _PAT_HI,
    _PAT_K,
    _PAT_LO,
    _PAT_MAX,
    _PAT_N,
    _PAT_OFF,
    _PAT_OPEN,
    _PAT_STARTS,
    _PAT_UNIT,
)

__all__ = ["geometry", "plan_consts"]

_RATIOS = gl.constexpr(tuple(float(r) for r in CLIP_RATIOS))
_MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2**23: the fp32 add rounds to an integer, ties to even


@gluon.jit
def clip_ratio(i, COUNT: gl.constexpr):
    """``CLIP_RATIOS[i]`` for a runtime ``0 <= i < COUNT``."""
    ratio = 0.0
    for j in gl.static_range(COUNT):
        ratio = gl.where(i == j, _RATIOS[j], ratio)
    return ratio


@gluon.jit
def codes_of(b, z, inv, LEVELS: gl.constexpr, FUSED: gl.constexpr = False):
    """``clamp(rint((b - z) * inv), 0, LEVELS)`` per row (``flush_math``'s ``clip_codes``).
    ``FUSED``: ``b * inv - z * inv`` in one fused multiply-add, for the search's candidates
    (it moves a code only where ``(b - z) * inv`` is within about 1e-7 of a rounding
    boundary; the stored codes take the reference's form)."""
    if FUSED:
        q = gl.fma(b, gl.expand_dims(inv, 1), gl.expand_dims(-(z * inv), 1))
    else:
        q = (b - gl.expand_dims(z, 1)) * gl.expand_dims(inv, 1)
    q = (q + _MAGIC) - _MAGIC
    return gl.minimum(gl.maximum(q, 0.0), LEVELS * 1.0)


@gluon.jit
def inverse(s):
    """``1 / s`` (IEEE) where ``s > 0``, else 0."""
    pos = s > 0.0
    one = gl.full(s.shape, 1.0, gl.float32, s.type.layout)
    return gl.where(pos, gl.div_rn(one, gl.where(pos, s, 1.0)), 0.0)


@gluon.jit
def moments(u, AXIS: gl.constexpr, N: gl.constexpr):
    """Population variance (two-pass) and mean square of every line of ``u`` along AXIS."""
    mean = gl.sum(u, axis=AXIS) / N
    dev = u - gl.expand_dims(mean, AXIS)
    var = gl.sum(dev * dev, axis=AXIS) / N
    return var, var + mean * mean


@gluon.jit
def log_spread(var, ms, FLOOR2: gl.constexpr):
    """``log max(std, floor * rms)`` of each line, zero lines filled with the mean of the
    others' logs (``flush_math``'s ``_log_spread(_half_log(...))``)."""
    v = gl.maximum(var, FLOOR2 * ms)
    pos = v > 0.0
    hl = 0.5 * gl.log(gl.where(pos, v, 1.0))
    count = gl.sum(pos.to(gl.int32), axis=0)
    fill = gl.sum(gl.where(pos, hl, 0.0), axis=0) / gl.maximum(count, 1).to(gl.float32)
    return gl.where(pos, hl, fill)


@gluon.jit
def spread_ratio(log_spread_):
    return gl.exp(gl.max(log_spread_, axis=0) - gl.min(log_spread_, axis=0))


@gluon.jit
def normalize(xp, xt, R: gl.constexpr, C: gl.constexpr, ITERS: gl.constexpr, FLOOR2: gl.constexpr):
    """``flush_math.normalize_tile`` of the prescaled tile held twice: ``xp`` a row per thread
    (layout L), ``xt`` a column per thread (layout LT). Returns ``(lr, lc)`` in the slices of
    L (rows) and LT (columns)."""
    LR: gl.constexpr = gl.SliceLayout(1, xp.type.layout)
    LC: gl.constexpr = gl.SliceLayout(0, xp.type.layout)
    LTR: gl.constexpr = gl.SliceLayout(1, xt.type.layout)
    LTC: gl.constexpr = gl.SliceLayout(0, xt.type.layout)
    lr = gl.zeros([R], gl.float32, LR)
    lc = gl.zeros([C], gl.float32, LTC)
    var_c, ms_c = moments(xt, 0, R)
    lcs = log_spread(var_c, ms_c, FLOOR2)
    var_r, ms_r = moments(xp, 1, C)
    best = spread_ratio(lcs) + spread_ratio(log_spread(var_r, ms_r, FLOOR2))
    best_lr = lr
    best_lc = lc
    for _ in range(ITERS):
        lc = lc + lcs
        b = gl.exp(-lc)
        y = (xp * gl.expand_dims(gl.exp(-lr), 1)) * gl.expand_dims(gl.convert_layout(b, LC), 0)
        var_r, ms_r = moments(y, 1, C)
        lr = lr + log_spread(var_r, ms_r, FLOOR2)
        lr_t = gl.convert_layout(lr, LTR)
        y = (xt * gl.expand_dims(gl.exp(-lr_t), 1)) * gl.expand_dims(b, 0)
        var_c, ms_c = moments(y, 0, R)
        lcs = log_spread(var_c, ms_c, FLOOR2)
        imb = spread_ratio(lcs) + 1.0
        better = imb < best
        best = gl.where(better, imb, best)
        best_lr = gl.where(better, lr, best_lr)
        best_lc = gl.where(better, lc, best_lc)
    return best_lr, best_lc


@gluon.jit
def candidate_error(b, z, s, w, mb, wdb, vb, rsw, LEVELS: gl.constexpr):
    """Each row's weighted error of the candidate with clipped range ``(z, s)`` after its
    unbiased refit (``flush_math._candidate_error``). ``wdb = w * (b - mb)``: the covariance
    of the codes and the row is ``sum(wdb * q)`` (``flush_math`` centres the codes too, which
    adds ``mq * sum(wdb)``, zero but for rounding), one fused multiply-add per value."""
    q = codes_of(b, z, inverse(s), LEVELS, True)
    mq = gl.sum(w * q, axis=1) * rsw
    cov = gl.sum(wdb * q, axis=1) * rsw
    ok = cov > 0.0
    s_u = gl.where(ok, gl.div_rn(vb, gl.where(ok, cov, 1.0)), s)
    z_u = gl.where(ok, mb - s_u * mq, z)
    e = b - (q * gl.expand_dims(s_u, 1) + gl.expand_dims(z_u, 1))
    return gl.sum(e * e * w, axis=1)


@gluon.jit
def _pick(i, TABLE: gl.constexpr, BASE: gl.constexpr, N: gl.constexpr):
    v = TABLE[BASE]
    for j in gl.static_range(1, N):
        v = gl.where(i == j, TABLE[BASE + j], v)
    return v


@gluon.jit
def _pattern_range(k, mid, half, LEVELS: gl.constexpr):
    r = k * _PAT_UNIT[LEVELS]
    f: gl.constexpr = 2.0 / LEVELS
    return mid - r * half, half * (r * f)


@gluon.jit
def search_plan(b, lc, R: gl.constexpr, LEVELS: gl.constexpr, PATTERN: gl.constexpr):
    """``flush_math.clip_search_plan`` of the balanced tile ``b`` (a row per thread) with log
    column scales ``lc`` (slice of b's layout): each row's winning clipping range ``(z, signed
    s)`` and its ``(step, lo)`` after the refit."""
    LR: gl.constexpr = gl.SliceLayout(1, b.type.layout)
    w1 = gl.exp(2.0 * (lc - gl.max(lc, axis=0)))
    w = gl.expand_dims(w1, 0)
    lo0 = gl.min(b, axis=1)
    hi0 = gl.max(b, axis=1)
    rng = hi0 - lo0
    step0 = gl.div_rn(rng, gl.full([R], LEVELS, gl.float32, LR))
    swt = gl.sum(w1, axis=0)
    sw = gl.zeros([R], gl.float32, LR) + swt
    mb = gl.div_rn(gl.sum(w * b, axis=1), sw)
    db = b - gl.expand_dims(mb, 1)
    vb = gl.div_rn(gl.sum(w * (db * db), axis=1), sw)
    wdb = w * db
    rsw = gl.div_rn(1.0, swt)
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * rng
    err = b - (
        codes_of(b, lo0, inverse(step0), LEVELS, True) * gl.expand_dims(step0, 1)
        + gl.expand_dims(lo0, 1)
    )
    best_e = gl.where(rng > 0.0, gl.sum(err * err * w, axis=1), -1.0)
    if PATTERN and _PAT_N[LEVELS] > 0:
        n: gl.constexpr = _PAT_N[LEVELS]
        lo_k: gl.constexpr = _PAT_LO[LEVELS]
        hi_k: gl.constexpr = _PAT_HI[LEVELS]
        at: gl.constexpr = LEVELS * _PAT_MAX
        best_k = gl.full([R], -1.0, gl.float32, LR)
        base = gl.full([R], hi_k, gl.float32, LR)
        for i in range(n):
            opens = _pick(i, _PAT_OPEN, at, n)
            base = gl.where(opens != 0, gl.where(best_k < 0.0, hi_k, best_k), base)
            k_step = gl.minimum(gl.maximum(base + _pick(i, _PAT_OFF, at, n), lo_k), hi_k)
            k = gl.where(i < _PAT_STARTS[LEVELS], _pick(i, _PAT_K, at, n), k_step)
            z, s = _pattern_range(k, mid, half, LEVELS)
            e = candidate_error(b, z, s, w, mb, wdb, vb, rsw, LEVELS)
            better = e < best_e
            best_e = gl.where(better, e, best_e)
            best_k = gl.where(better, k, best_k)
        refit = best_k >= 0.0
        z, s = _pattern_range(gl.maximum(best_k, 0.0), mid, half, LEVELS)
        code_z = gl.where(refit, z, lo0)
        signed = gl.where(refit, s, -step0)
    else:
        code_z = lo0
        signed = -step0
        COUNT: gl.constexpr = CLIP_COUNT_BY_LEVELS[LEVELS]
        for i in range(COUNT):
            ratio = clip_ratio(i, COUNT)
            z = mid - ratio * half
            s = half * gl.div_rn(2.0 * ratio, LEVELS * 1.0)
            e = candidate_error(b, z, s, w, mb, wdb, vb, rsw, LEVELS)
            better = e < best_e
            best_e = gl.where(better, e, best_e)
            code_z = gl.where(better, z, code_z)
            signed = gl.where(better, s, signed)
    # The winner's codes and, where it is not min/max, its unbiased refit
    # (``flush_math._finish``): the finish then only rounds.
    s_abs = gl.abs(signed)
    q = codes_of(b, code_z, inverse(s_abs), LEVELS)
    mq = gl.sum(w * q, axis=1) * rsw
    cov = gl.sum(wdb * q, axis=1) * rsw
    ok = cov > 0.0
    s_u = gl.where(ok, gl.div_rn(vb, gl.where(ok, cov, 1.0)), s_abs)
    z_u = gl.where(ok, mb - s_u * mq, code_z)
    refit = signed > 0.0
    return code_z, signed, gl.where(refit, s_u, s_abs), gl.where(refit, z_u, code_z)


@gluon.jit
def _frexp_exponent(v):
    field = (v.to(gl.int32, bitcast=True) >> 23) & 0xFF
    return gl.where(v == 0.0, 0, field - 126)


@gluon.jit
def _pow2(n):
    first = gl.minimum(gl.maximum(n, -126), 127)
    a = ((first + 127) << 23).to(gl.float32, bitcast=True)
    return a * ((n - first + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def load_tile(
    pool_ptr,
    scale_ptr,
    src,
    head,
    G: gl.constexpr,
    H: gl.constexpr,
    D: gl.constexpr,
    R: gl.constexpr,
    C: gl.constexpr,
    TOKENS_ON_ROWS: gl.constexpr,
    FP8: gl.constexpr,
    L: gl.constexpr,
    LT: gl.constexpr,
):
    """Steps 1-2 of tile ``(src, head)`` (``flush_plan.load_prescaled``): the tile with its
    non-finite tokens zeroed, times ``2**-e``, held twice (``xp`` a row per thread in layout
    L, ``xt`` a column per thread in LT), and the prescale exponent ``e``."""
    if TOKENS_ON_ROWS:
        # V: rows are tokens (contiguous channels along a row: a row per thread loads them)
        r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
        row = (src * G + r) * H + head
        xp = gl.load(pool_ptr + gl.expand_dims(row * D, 1) + gl.expand_dims(c, 0))
        xp = xp.to(gl.float32)
        if FP8:
            xp = xp * gl.expand_dims(gl.load(scale_ptr + row), 1)
        fin = ((xp == xp) & (gl.abs(xp) < float("inf"))).to(gl.int32)
        xp = gl.where(gl.expand_dims(gl.min(fin, axis=1) > 0, 1), xp, 0.0)
        xt = gl.convert_layout(xp, LT)
    else:
        # K: columns are tokens (contiguous channels down a column: a column per thread)
        r = gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, LT))
        row = (src * G + c) * H + head
        xt = gl.load(pool_ptr + gl.expand_dims(row * D, 0) + gl.expand_dims(r, 1))
        xt = xt.to(gl.float32)
        if FP8:
            xt = xt * gl.expand_dims(gl.load(scale_ptr + row), 0)
        fin = ((xt == xt) & (gl.abs(xt) < float("inf"))).to(gl.int32)
        xt = gl.where(gl.expand_dims(gl.min(fin, axis=0) > 0, 0), xt, 0.0)
        xp = gl.convert_layout(xt, L)
    amax = gl.max(gl.max(gl.abs(xp), axis=1), axis=0)
    e = gl.where(amax > 0.0, _frexp_exponent(amax) - 1, 0)
    scale = _pow2(-e)
    return xp * scale, xt * scale, e


@gluon.jit
def plan_kernel(
    pool_ptr,
    scale_ptr,
    src_ptr,
    sink_ptr,
    plan_ptr,
    num_pool_blocks,
    G: gl.constexpr,
    H: gl.constexpr,
    D: gl.constexpr,
    R: gl.constexpr,
    C: gl.constexpr,
    TOKENS_ON_ROWS: gl.constexpr,
    WHICH: gl.constexpr,
    FP8: gl.constexpr,
    LEVELS: gl.constexpr,
    SEARCH: gl.constexpr,
    PATTERN: gl.constexpr,
    ITERS: gl.constexpr,
    STD_FLOOR: gl.constexpr,
    STRIDE: gl.constexpr,
    TPR: gl.constexpr,
    TPC: gl.constexpr,
    WARPS: gl.constexpr,
    MARKED: gl.constexpr,
):
    """The plan of tile ``(program_id(0), program_id(1), WHICH)`` of a flush: K tiles (WHICH
    0, ``[D, G]``, tokens on columns) or V tiles (1, ``[G, D]``, tokens on rows). Plan layout
    (``flush_plan.plan_stride``): ``lr [R]``, ``lc [C]``, ``z [R]``, signed ``s [R]``, ``step
    [R]``, ``lo [R]`` (fp32; the last four only with ``SEARCH``)."""
    L: gl.constexpr = gl.BlockedLayout([1, C // TPR], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([R // TPC, 1], [TPC, 32 // TPC], [1, WARPS], [0, 1])
    FLOOR2: gl.constexpr = STD_FLOOR * STD_FLOOR
    i = gl.program_id(0)
    head = gl.program_id(1)
    src = gl.load(src_ptr + i).to(gl.int64)
    ok = (src >= 0) & (src < num_pool_blocks)
    if MARKED == 1:
        ok = ok & (gl.load(sink_ptr + i) < 0)
    if ok:
        xp, xt, e = load_tile(
            pool_ptr, scale_ptr, src, head, G, H, D, R, C, TOKENS_ON_ROWS, FP8, L, LT
        )
        lr, lc = normalize(xp, xt, R, C, ITERS, FLOOR2)
        tile = (i * H + head) * 2 + WHICH
        base = plan_ptr + tile.to(gl.int64) * STRIDE
        rr = gl.arange(0, R, layout=gl.SliceLayout(1, L))
        ct = gl.arange(0, C, layout=gl.SliceLayout(0, LT))
        gl.store(base + rr, lr)
        gl.store(base + R + ct, lc)
        if SEARCH:
            lcp = gl.convert_layout(lc, gl.SliceLayout(0, L))
            b = (xp * gl.expand_dims(gl.exp(-lr), 1)) * gl.expand_dims(gl.exp(-lcp), 0)
            z, s, step, lo = search_plan(b, lcp, R, LEVELS, PATTERN)
            gl.store(base + R + C + rr, z)
            gl.store(base + 2 * R + C + rr, s)
            gl.store(base + 3 * R + C + rr, step)
            gl.store(base + 4 * R + C + rr, lo)


def geometry(r: int, c: int, warps: int | None = None) -> tuple[int, int, int] | None:
    """``(threads per row, threads per column, warps)`` of the plan of an ``[r, c]`` tile:
    by default a row per thread up to 64 columns (``warps = r * max(1, c / 64) / 32``);
    ``warps`` asks for another count, whose rows and columns are then split over more
    threads. None where the tile does not fill whole warps both ways (the single-pass flush
    serves it)."""
    if warps is None:
        if (r * max(1, c // 64)) % 32:
            return None
        warps = r * max(1, c // 64) // 32
    if warps < 1 or warps > 16 or warps & (warps - 1):
        return None
    threads = 32 * warps
    if threads % r or threads % c:
        return None
    tpr, tpc = threads // r, threads // c
    if tpr > 32 or tpc > 32 or c % tpr or r % tpc:
        return None
    return tpr, tpc, warps


def plan_consts(r: int, c: int, warps: int | None = None) -> dict | None:
    """``TPR``, ``TPC``, ``WARPS`` of :func:`plan_kernel` for ``[r, c]`` tiles, or None."""
    g = geometry(r, c, warps)
    if g is None:
        return None
    tpr, tpc, warps = g
    return dict(TPR=tpr, TPC=tpc, WARPS=warps)
