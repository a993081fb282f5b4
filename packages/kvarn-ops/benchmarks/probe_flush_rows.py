"""The flush's clipping search and normalization in Gluon with layouts chosen by hand: the
``rows`` variants of ``probe_flush_columns.py`` and ``probe_flush_norm.py``.

The search: one tile row per thread (two threads per row for 128-column tiles), the tile in
registers.

Triton chooses the flush tile's register layout itself, and for a ``[128, 64]`` fp32 tile at
4 warps it spreads each row over 16 threads: every per-row sum of the search is then a
shuffle tree, and each row's scalar work (its candidate's step, the refit's quotient, the
comparison) is repeated in each of those threads. Gluon lets the layout be chosen: here a
thread holds a whole row (``size_per_thread = [1, C / TPR]``), so the search's sums are chains
of fused multiply-adds in one thread (``TPR = 2``: one shuffle), and each thread also holds
the weights of its columns. Same candidates, same formulas and order of operations as the
flush's window search (``flush_math.unbiased_clip_search``) but for the order of each sum's
terms; like ``columns`` it returns each row's winning clipping range (a negative step marks
min/max).

Gluon kernels do not run under the Triton interpreter; the probe checks this variant's rows
against the reference on the GPU (``rows as reference``) and a CPU test compiles it for
sm_90a and sm_120a.

The normalization (``_norm_rows_kernel``): the flush's ``flush_math.normalize_tile`` with the
tile held twice, once a row per thread (its row statistics in one thread) and once a column
per thread (two threads per column for 128-row tiles: its column statistics the same way),
the second copy made once through shared memory (``convert_layout``); only the line scales
(R and C values) cross between the two each iteration.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvarn_ops.kernels._common import CLIP_COUNT_BY_LEVELS, CLIP_RATIOS

_RATIOS = gl.constexpr(tuple(float(r) for r in CLIP_RATIOS))
_MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2**23: the fp32 add rounds to an integer, ties to even


@gluon.jit
def _clip_ratio(i, COUNT: gl.constexpr):
    ratio = 0.0
    for j in gl.static_range(COUNT):
        ratio = gl.where(i == j, _RATIOS[j], ratio)
    return ratio


@gluon.jit
def _codes(b, z, inv, LEVELS: gl.constexpr):
    q = (b - gl.expand_dims(z, 1)) * gl.expand_dims(inv, 1)
    q = (q + _MAGIC) - _MAGIC
    return gl.minimum(gl.maximum(q, 0.0), LEVELS * 1.0)


@gluon.jit
def _inverse(s):
    pos = s > 0.0
    return gl.where(
        pos, gl.div_rn(gl.full(s.shape, 1.0, gl.float32, s.type.layout), gl.where(pos, s, 1.0)), 0.0
    )


@gluon.jit
def _rows_kernel(
    b_ptr,
    lc_ptr,
    out_ptr,
    R: gl.constexpr,
    C: gl.constexpr,
    LEVELS: gl.constexpr,
    TPR: gl.constexpr,
    WARPS: gl.constexpr,
):
    L: gl.constexpr = gl.BlockedLayout([1, C // TPR], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    LR: gl.constexpr = gl.SliceLayout(1, L)
    LC: gl.constexpr = gl.SliceLayout(0, L)
    t = gl.program_id(0)
    r = gl.arange(0, R, layout=LR)
    c = gl.arange(0, C, layout=LC)
    b = gl.load(b_ptr + t * R * C + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0))
    lc = gl.load(lc_ptr + t * C + c)
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
    rsw = gl.div_rn(1.0, swt)
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * rng
    err = b - (
        _codes(b, lo0, _inverse(step0), LEVELS) * gl.expand_dims(step0, 1) + gl.expand_dims(lo0, 1)
    )
    best_e = gl.where(rng > 0.0, gl.sum(err * err * w, axis=1), -1.0)
    code_z = lo0
    code_s = -step0
    COUNT: gl.constexpr = CLIP_COUNT_BY_LEVELS[LEVELS]
    for i in range(COUNT):
        ratio = _clip_ratio(i, COUNT)
        z = mid - ratio * half
        s = half * gl.div_rn(2.0 * ratio, LEVELS * 1.0)
        q = _codes(b, z, _inverse(s), LEVELS)
        mq = gl.sum(w * q, axis=1) * rsw
        cov = gl.sum((w * (q - gl.expand_dims(mq, 1))) * db, axis=1) * rsw
        ok = cov > 0.0
        s_u = gl.where(ok, gl.div_rn(vb, gl.where(ok, cov, 1.0)), s)
        z_u = gl.where(ok, mb - s_u * mq, z)
        e = b - (q * gl.expand_dims(s_u, 1) + gl.expand_dims(z_u, 1))
        e = gl.sum(e * e * w, axis=1)
        better = e < best_e
        best_e = gl.where(better, e, best_e)
        code_z = gl.where(better, z, code_z)
        code_s = gl.where(better, s, code_s)
    gl.store(out_ptr + t * 2 * R + r, code_s)
    gl.store(out_ptr + t * 2 * R + R + r, code_z)


@gluon.jit
def _moments(u, AXIS: gl.constexpr, N: gl.constexpr):
    """Population variance (two-pass) and mean square of every line of ``u`` along AXIS (the
    flush's ``_line_moments``)."""
    mean = gl.sum(u, axis=AXIS) / N
    dev = u - gl.expand_dims(mean, AXIS)
    var = gl.sum(dev * dev, axis=AXIS) / N
    return var, var + mean * mean


@gluon.jit
def _log_spread(var, ms, FLOOR2: gl.constexpr):
    """The flush's ``_log_spread(_half_log(var, ms))``: ``log max(std, floor * rms)`` of each
    line, zero lines filled with the mean of the others' logs."""
    v = gl.maximum(var, FLOOR2 * ms)
    pos = v > 0.0
    hl = 0.5 * gl.log(gl.where(pos, v, 1.0))
    count = gl.sum(pos.to(gl.int32), axis=0)
    fill = gl.sum(gl.where(pos, hl, 0.0), axis=0) / gl.maximum(count, 1).to(gl.float32)
    return gl.where(pos, hl, fill)


@gluon.jit
def _spread_ratio(log_spread):
    return gl.exp(gl.max(log_spread, axis=0) - gl.min(log_spread, axis=0))


@gluon.jit
def _norm_rows_kernel(
    x_ptr,
    out_ptr,
    R: gl.constexpr,
    C: gl.constexpr,
    ITERS: gl.constexpr,
    STD_FLOOR: gl.constexpr,
    TPR: gl.constexpr,
    TPC: gl.constexpr,
    WARPS: gl.constexpr,
):
    """Log scales ``(lr [R], lc [C])`` of the best-balanced iterate of each prescaled tile
    ``x [N, R, C]`` into ``out [N, R + C]``, as ``flush_math.normalize_tile``."""
    L: gl.constexpr = gl.BlockedLayout([1, C // TPR], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([R // TPC, 1], [TPC, 32 // TPC], [1, WARPS], [0, 1])
    FLOOR2: gl.constexpr = STD_FLOOR * STD_FLOOR
    t = gl.program_id(0)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
    xp = gl.load(x_ptr + t * R * C + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0))
    xt = gl.convert_layout(xp, LT)
    lr = gl.zeros([R], gl.float32, gl.SliceLayout(1, L))
    lc = gl.zeros([C], gl.float32, gl.SliceLayout(0, LT))
    var_c, ms_c = _moments(xt, 0, R)
    lcs = _log_spread(var_c, ms_c, FLOOR2)
    var_r, ms_r = _moments(xp, 1, C)
    best = _spread_ratio(lcs) + _spread_ratio(_log_spread(var_r, ms_r, FLOOR2))
    best_lr = lr
    best_lc = lc
    for _ in range(ITERS):
        lc = lc + lcs
        b = gl.exp(-lc)
        y = (xp * gl.expand_dims(gl.exp(-lr), 1)) * gl.expand_dims(
            gl.convert_layout(b, gl.SliceLayout(0, L)), 0
        )
        var_r, ms_r = _moments(y, 1, C)
        lr = lr + _log_spread(var_r, ms_r, FLOOR2)
        lr_t = gl.convert_layout(lr, gl.SliceLayout(1, LT))
        y = (xt * gl.expand_dims(gl.exp(-lr_t), 1)) * gl.expand_dims(b, 0)
        var_c, ms_c = _moments(y, 0, R)
        lcs = _log_spread(var_c, ms_c, FLOOR2)
        imb = _spread_ratio(lcs) + 1.0
        better = imb < best
        best = gl.where(better, imb, best)
        best_lr = gl.where(better, lr, best_lr)
        best_lc = gl.where(better, lc, best_lc)
    gl.store(out_ptr + t * (R + C) + r, best_lr)
    ct = gl.arange(0, C, layout=gl.SliceLayout(0, LT))
    gl.store(out_ptr + t * (R + C) + R + ct, best_lc)


def geometry(r: int, c: int) -> tuple[int, int]:
    """``(threads per row, warps)`` of an ``[r, c]`` tile: a row per thread up to 64 columns."""
    tpr = max(1, c // 64)
    warps = r * tpr // 32
    if warps < 1 or r * tpr % 32:
        raise ValueError(f"tile: {r} x {c} does not fill whole warps at {tpr} threads a row")
    return tpr, warps


def search_consts(r: int, c: int, bits: int) -> dict:
    """Constexprs of ``_rows_kernel`` for ``[r, c]`` tiles of ``bits``-bit codes (``WARPS``
    is also the launch's ``num_warps``)."""
    tpr, warps = geometry(r, c)
    return dict(R=r, C=c, LEVELS=(1 << bits) - 1, TPR=tpr, WARPS=warps)


def norm_consts(r: int, c: int, iters: int, std_floor: float) -> dict:
    """Constexprs of ``_norm_rows_kernel`` for ``[r, c]`` tiles."""
    tpr, warps = geometry(r, c)
    tpc = max(1, r // 64)  # threads per column
    if (32 // tpc) * warps != c:
        raise ValueError(f"tile: {r} x {c} has no column layout at {warps} warps")
    return dict(R=r, C=c, ITERS=iters, STD_FLOOR=std_floor, TPR=tpr, TPC=tpc, WARPS=warps)


def compile_offline(kernel, consts: dict, arch: int):
    """Compile ``_rows_kernel`` or ``_norm_rows_kernel`` for ``sm_{arch}`` without a GPU (every
    pointer fp32); returns triton's compiled kernel (``.asm["cubin"]``, ``.asm["ptx"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else "*fp32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options=dict(num_warps=consts["WARPS"]))


def launch_norm_rows(x: torch.Tensor, out: torch.Tensor, iters: int, std_floor: float) -> None:
    """The normalization of every prescaled tile ``x [N, R, C]`` (fp32, contiguous): log
    scales into ``out [N, R + C]``."""
    n, r, c = x.shape
    k = norm_consts(r, c, iters, std_floor)
    _norm_rows_kernel[(n,)](x, out, **k, num_warps=k["WARPS"])


def launch_rows(b: torch.Tensor, lc: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """The search of every tile ``b [N, R, C]`` (fp32, contiguous) with log column scales
    ``lc [N, C]``; each row's winning ``(step, lo)`` into ``out [N, 2R]``."""
    n, r, c = b.shape
    k = search_consts(r, c, bits)
    _rows_kernel[(n,)](b, lc, out, **k, num_warps=k["WARPS"])
