"""The attention-sink token's value row, reconstructed almost exactly from the same record.

Most attention heads put a large share of every query's weight on the sequence's first token
(the attention sink) and read a small value vector from it. The rounding error of that one V
row is then a bias shared by every later query, which does not average out the way the
independent errors of ordinary tokens do. On SmolLM2-135M (ACCURACY.md) the first token's V
row carries most of the 2-bit V penalty of a cache without an exact first tile: keeping that
single row exact (an oracle) takes k4v2 on the license text from +4.6% to +1.6%.

A record has one free scale per V channel (the column scale), shared by the tile's tokens, so
one row can be reconstructed almost exactly without a byte more: round the sink row on a
symmetric grid (levels ``+-(j + 0.5) * s``), pick for every channel the level nearest in
log-ratio to the value's magnitude, and move the remaining ratio ``r[c] = |b| / level`` into
the column scale, clamped to ``[1 / SINK_RHO, SINK_RHO]``. With ``SINK_RHO = sqrt(3)``
(the ratio between the grid's two smallest magnitudes is 3, so the geometric midpoints of
every gap lie within the clamp) every value of magnitude ``>= s / (2 sqrt(3))`` is
reconstructed exactly, up to the fp16 rounding of the scales; smaller ones round to
``+- s / (2 sqrt(3))``. The step ``s`` is chosen from ``SINK_RATIOS`` (the top level at
that fraction of the row's largest magnitude), the first of least weighted residual. The
other tokens of the tile are then rounded as usual on the balanced tile divided by ``r``
(the normalization scales absorb ``log r``), so they adapt to the perturbed column scales;
their error grows by about a quarter at 2 bits, in that one tile only.

A guard leaves the tile as it is where the grid does not beat min/max RTN on the sink row by
more than a tie tolerance (rows the grid cannot follow, such as one large value among tiny
ones, and rows RTN fits exactly).

Which row is the sink is the caller's knowledge (its position), not the quantizer's: only
tiles given a row in ``sink_rows`` change, and a serving engine marks row 0 of each
request's first block. Everything is relative to the row, so the result stays scale
invariant. Measured on SmolLM2-135M without an exact first tile (ACCURACY.md): k4v2 +4.62%
-> +0.94% on the license text, pooled over six more texts +1.78% -> +1.21%.
"""

from __future__ import annotations

import math

import torch

from kvarn_ops._validate import check_index_range, check_tensor
from kvarn_ops.reference.rounding import column_weights, round_rows, weighted_row_error

__all__ = ["SINK_RATIOS", "SINK_RHO", "SINK_TIE", "apply_sink", "check_sink_rows", "sink_row_grid"]

SINK_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6)
"""Top level of the sink row's grid as a fraction of its largest magnitude, in search order."""
SINK_RHO = math.sqrt(3.0)
"""Largest factor by which a column scale moves to absorb the sink row's residual."""
SINK_TIE = 1e-6
"""Residuals closer than this fraction of the row's weighted energy are a tie (the earlier
candidate, or no sink step, is kept). At 3 bits and more several steps fit the row exactly
and their residuals are fp32 noise (about 1e-13 of the energy); without a tolerance a
kernel's summation order would pick another step and every other row would move."""


def check_sink_rows(
    sink_rows: torch.Tensor | None,
    n: int,
    rows: int,
    device: torch.device,
    name: str = "sink_rows",
) -> None:
    """``sink_rows``: None or int32/int64 ``[n]`` on ``device`` with values in ``[-1, rows)``
    (-1: none); ValueError naming ``name`` otherwise (values checked on the CPU)."""
    if sink_rows is None:
        return
    check_tensor(
        name,
        sink_rows,
        dtypes=(torch.int32, torch.int64),
        shape=(n,),
        device=torch.device(device),
        contiguous=False,
    )
    check_index_range(name, sink_rows, rows, sentinel=-1)


def sink_row_grid(
    b: torch.Tensor, lc: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, step and zero point of sink rows ``b [M, C]`` (balanced frame) on the symmetric
    grid, and the column factors ``r [M, C]`` that make them (almost) exact.

    ``lc [M, C]``: the tiles' natural-log column scales (the residual is weighed by
    ``exp(2 * lc)``, as the clipping search weighs errors). Returns codes uint8 ``[M, C]``,
    step and lo float32 ``[M]`` (``lo = -levels / 2 * step``), ``r`` float32 ``[M, C]`` in
    ``[1 / SINK_RHO, SINK_RHO]``, with ``(codes * step + lo) * r ~= b``, and the weighted
    residual ``sum exp(2 lc) (|b| - level * r)**2`` (relative to the largest column weight)
    ``[M]``, and the tie tolerance ``SINK_TIE * sum exp(2 lc) b**2`` ``[M]``. A zero row
    gets step 0, codes 0, ``r = 1`` and residual 0. Candidates are kept in order unless one
    lowers the residual by more than the tolerance.
    """
    levels = (1 << bits) - 1
    top = float((levels - 1) // 2)  # largest j: magnitudes (j + 0.5) * step
    weight = column_weights(lc)
    a = b.abs()
    tie = SINK_TIE * (weight * b * b).sum(dim=-1)
    amax = a.amax(dim=-1)
    live = amax > 0
    safe_amax = torch.where(live, amax, 1.0)
    best = None
    for ratio in SINK_RATIOS:
        s = safe_amax * (2.0 * ratio / levels)
        u = a / s[:, None]
        j0 = torch.floor(u - 0.5).clamp(0.0, top)
        j1 = torch.clamp(j0 + 1.0, max=top)
        m0, m1 = j0 + 0.5, j1 + 0.5
        j = torch.where(u * u > m0 * m1, j1, j0)  # nearest in log-ratio (geometric midpoint)
        m = j + 0.5
        r = (u / m).clamp(1.0 / SINK_RHO, SINK_RHO)
        res = a - m * s[:, None] * r
        err = (weight * res * res).sum(dim=-1)
        if best is None:
            best = [err, j, s, r]
        else:
            better = err < best[0] - tie
            best = [
                torch.where(better, err, best[0]),
                torch.where(better[:, None], j, best[1]),
                torch.where(better, s, best[2]),
                torch.where(better[:, None], r, best[3]),
            ]
    assert best is not None
    err, j, s, r = best
    half_up = float((levels + 1) // 2)
    codes = torch.where(b >= 0, half_up + j, half_up - 1.0 - j)
    codes = torch.where(live[:, None], codes, 0.0)
    step = torch.where(live, s, 0.0)
    lo = -0.5 * levels * step
    r = torch.where(live[:, None], r, 1.0)
    return codes.to(torch.uint8), step, lo, r, torch.where(live, err, 0.0), tie


def apply_sink(
    balanced: torch.Tensor, lc: torch.Tensor, sink_rows: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """The sink step on balanced tiles ``[N, R, C]`` with log column scales ``lc [N, C]``.

    Each tile with a row in ``sink_rows`` (int [N], -1: none) whose grid residual is below
    that row's min/max RTN error by more than the tie tolerance (a guard for rows the grid
    cannot follow, such as one huge value among tiny ones, and for rows RTN fits exactly:
    then the tile is left as it is) gets ``lc += log r`` and ``balanced /= r``.
    Returns the tiles and ``lc`` to round, and ``(tiles, rows, codes, step, lo)`` for the rows
    whose rounding the grid's replaces (None if none).
    """
    tiles = (sink_rows >= 0).nonzero()[:, 0]
    if tiles.numel() == 0:
        return balanced, lc, None
    rows = sink_rows[tiles].long()
    bp = balanced[tiles, rows]
    lct = lc[tiles]
    codes, step, lo, r, err, tie = sink_row_grid(bp, lct, bits)
    c0, step0, lo0 = round_rows(bp[:, None, :], lct, bits, "rtn")
    rtn_err = weighted_row_error(bp[:, None, :], c0.float(), step0, lo0, column_weights(lct))
    keep = err < rtn_err[:, 0] - tie
    if not bool(keep.any()):
        return balanced, lc, None
    tiles, rows, codes, step, lo, r = (t[keep] for t in (tiles, rows, codes, step, lo, r))
    lc = lc.clone()
    lc[tiles] = lc[tiles] + torch.log(r)
    balanced = balanced.clone()
    balanced[tiles] = balanced[tiles] / r[:, None, :]
    return balanced, lc, (tiles, rows, codes, step, lo)
