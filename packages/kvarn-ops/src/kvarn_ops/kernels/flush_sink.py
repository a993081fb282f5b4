"""The flush's sink-token step (Triton): the reference ``reference/sink.py`` for one V tile.

The reference puts the tile's sink row on a symmetric grid, moves the residual ratio of every
channel into the column scale (``lc += log r``, the balanced tile divided by ``r``), rounds
the other rows as usual and gives the sink row its grid codes. Here the grid search runs on
the one row (``[C]`` vectors, five candidates); the tile division is taken only in tiles
that have a sink row (and pass the guard against min/max RTN). Same fp32 expressions and
IEEE quotients as torch's; the candidates' error sums differ from the reference's by
summation order only, far below the tie tolerance ``SINK_TIE`` that decides between them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn_ops.kernels._common import clip_codes
from kvarn_ops.reference.sink import SINK_RATIOS, SINK_RHO, SINK_TIE

__all__ = ["apply_sink", "sink_grid", "sink_override"]

_SINK_RATIOS = tl.constexpr(SINK_RATIOS)
_NUM_SINK_RATIOS = tl.constexpr(len(SINK_RATIOS))
_RHO = tl.constexpr(SINK_RHO)
_INV_RHO = tl.constexpr(1.0 / SINK_RHO)
_TIE = tl.constexpr(SINK_TIE)


@triton.jit
def sink_grid(b, weight, LEVELS: tl.constexpr, C: tl.constexpr):
    """Reference ``sink_row_grid`` for one row ``b [C]`` (balanced frame) with the tile's
    column weights ``weight [C]`` (``exp(2 lc)`` relative to the largest): returns fp32
    integer codes ``[C]``, step, lo (scalars), the column factors ``r [C]`` (1 for a zero
    row), the weighted residual (0 for a zero row) and the tie tolerance ``SINK_TIE * sum w
    b**2``."""
    TOP: tl.constexpr = (LEVELS - 1) // 2
    HALF_UP: tl.constexpr = (LEVELS + 1) // 2
    a = tl.abs(b)
    tie = _TIE * tl.sum(weight * b * b, axis=0)
    amax = tl.max(a, axis=0)
    live = amax > 0.0
    safe = tl.where(live, amax, 1.0)
    zeros = tl.zeros([C], tl.float32)
    best_e = zeros
    best_j = zeros
    best_s = safe
    best_r = zeros
    for i in tl.static_range(_NUM_SINK_RATIOS):
        s = safe * (2.0 * _SINK_RATIOS[i] / LEVELS)
        u = tl.div_rn(a, zeros + s)
        j0 = tl.minimum(tl.maximum(tl.floor(u - 0.5), 0.0), TOP * 1.0)
        j1 = tl.minimum(j0 + 1.0, TOP * 1.0)
        j = tl.where(u * u > (j0 + 0.5) * (j1 + 0.5), j1, j0)
        m = j + 0.5
        r = tl.minimum(tl.maximum(tl.div_rn(u, m), _INV_RHO), _RHO)
        res = a - (m * s) * r
        e = tl.sum(weight * res * res, axis=0)
        if i == 0:
            best_e = zeros + e
            best_j = j
            best_s = s
            best_r = r
        else:
            better = e < tl.max(best_e, axis=0) - tie
            best_e = tl.where(better, zeros + e, best_e)
            best_j = tl.where(better, j, best_j)
            best_s = tl.where(better, s, best_s)
            best_r = tl.where(better, r, best_r)
    codes = tl.where(b >= 0.0, HALF_UP + best_j, (HALF_UP - 1.0) - best_j)
    codes = tl.where(live, codes, 0.0)
    step = tl.where(live, best_s, 0.0)
    lo = (-0.5 * LEVELS) * step
    r = tl.where(live, best_r, 1.0)
    return codes, step, lo, r, tl.where(live, tl.max(best_e, axis=0), 0.0), tie


@triton.jit
def _rtn_error(b, w, LEVELS: tl.constexpr):
    """The weighted error of min/max RTN on one row ``b [C]`` (the reference rounding's
    ``"rtn"`` codes and ``weighted_row_error``), the sink step's guard."""
    row = b[None, :]
    lo0 = tl.min(row, axis=1)
    rng = tl.max(row, axis=1) - lo0
    step0 = tl.div_rn(rng, tl.full([1], LEVELS, tl.float32))
    c0 = clip_codes(row, lo0, step0, LEVELS)
    err = row - (c0 * step0[:, None] + lo0[:, None])
    return tl.sum(tl.sum(err * err * w[None, :], axis=1), axis=0)


@triton.jit
def apply_sink(balanced, lc, sink_row, LEVELS: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The sink step on a balanced tile ``[R, C]`` (rows = tokens) whose sink is row
    ``sink_row`` (runtime; -1: none). Returns the tile and ``lc`` to round with, and the sink
    row's codes ``[C]`` (int32), step and lo, and the (possibly changed) sink row: -1 where
    the guard of the reference ``apply_sink`` leaves the tile as it is (the grid's residual
    not below the row's min/max RTN error). A tile without a sink row skips the step (a
    branch on the program's row index: the plugin passes ``sink_rows`` on every step, and
    most flushed blocks are not a request's first)."""
    codes = tl.zeros([C], tl.int32)
    step = tl.sum(tl.zeros([C], tl.float32), axis=0)
    lo = step
    if sink_row >= 0:
        rows = tl.arange(0, R)
        bp = tl.sum(tl.where(rows[:, None] == sink_row, balanced, 0.0), axis=0)
        weight = tl.exp(2.0 * (lc - tl.max(lc, axis=0)))
        grid_codes, grid_step, grid_lo, r, err, tie = sink_grid(bp, weight, LEVELS, C)
        sink_row = tl.where(err < _rtn_error(bp, weight, LEVELS) - tie, sink_row, -1)
        codes = grid_codes.to(tl.int32)
        step = grid_step
        lo = grid_lo
        if sink_row >= 0:
            lc = lc + tl.log(r)
            balanced = tl.div_rn(balanced, tl.zeros([R, C], tl.float32) + r[None, :])
    return balanced, lc, codes, step, lo, sink_row


@triton.jit
def sink_override(codes, step, lo, rows, sink_row, sink_codes, sink_step, sink_lo):
    """Give row ``sink_row`` (of the rows ``rows [RP]`` this program rounded) the sink grid's
    codes, step and zero point."""
    is_sink = rows == sink_row
    codes = tl.where(is_sink[:, None], sink_codes[None, :], codes)
    step = tl.where(is_sink, sink_step, step)
    lo = tl.where(is_sink, sink_lo, lo)
    return codes, step, lo
