"""The flush's sink-key step (Triton): the reference ``reference/sink_key.py`` for the rows
of one 2-bit K tile ``[R, C]`` (rows = channels, columns = tokens) whose sink token is
column ``pin``: every row's grid passes through the sink's value. Same candidates in the
same order, the same fp32 expressions and IEEE quotients as torch's; the error sums differ
from the reference's by summation order only. Only the winner's step, zero point and sink
code are carried through the search; its codes are recomputed at the end."""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn_ops.kernels._common import CLIP_COUNT_BY_LEVELS, clip_codes, clip_ratio

__all__ = ["pin_search"]


@triton.jit
def _pinned_codes(b, at, z, st, j, LEVELS: tl.constexpr):
    return tl.where(at, j[:, None], clip_codes(b, z, st, LEVELS))


@triton.jit
def _keep(b, w, c, s, z, j, best_e, best_s, best_z, best_j):
    """Keep candidate ``(c, s, z, j)`` where its weighted error is below the best (strict)."""
    err = b - (c * s[:, None] + z[:, None])
    e = tl.sum((w * err) * err, axis=1)
    better = e < best_e
    return (
        tl.where(better, e, best_e),
        tl.where(better, s, best_s),
        tl.where(better, z, best_z),
        tl.where(better, j, best_j),
    )


@triton.jit
def pin_search(b, lc, pin, LEVELS: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """Codes (int32), step and zero point of the rows of the K tile ``b [R, C]`` (this
    program's rows) whose grids pass through column ``pin``'s values; run in place of the
    clipping search in a tile with a sink token (a constant row comes out as from the search:
    codes 0, step 0, its value)."""
    at = tl.arange(0, C)[None, :] == pin
    p = tl.sum(tl.where(at, b, 0.0), axis=1)
    lo0 = tl.min(b, axis=1)
    hi0 = tl.max(b, axis=1)
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * (hi0 - lo0)
    lv = tl.full([R], LEVELS, tl.float32)
    w = tl.exp(2.0 * (lc - tl.max(lc, axis=0)))[None, :]
    best_e = tl.full([R], float("inf"), tl.float32)
    best_s = tl.zeros([R], tl.float32)
    best_z = tl.zeros([R], tl.float32)
    best_j = tl.zeros([R], tl.float32)
    count: tl.constexpr = CLIP_COUNT_BY_LEVELS[LEVELS]
    for i in tl.range(0, count, loop_unroll_factor=1):
        ratio = clip_ratio(i, count)
        s = tl.div_rn((2.0 * ratio) * half, lv)
        j = tl.sum(clip_codes(p[:, None], mid - ratio * half, s, LEVELS), axis=1)
        c = _pinned_codes(b, at, p - j * s, s, j, LEVELS)
        cj = c - j[:, None]
        num = tl.sum((w * cj) * (b - p[:, None]), axis=1)
        den = tl.sum((w * cj) * cj, axis=1)
        ok = (num > 0.0) & (den > 0.0)
        s_ls = tl.where(ok, tl.div_rn(num, tl.where(ok, den, 1.0)), s)
        # Candidate 1: the clipped grid's step through the sink's point.
        best_e, best_s, best_z, best_j = _keep(
            b, w, c, s, p - j * s, j, best_e, best_s, best_z, best_j
        )
        # Candidate 2: the least-squares step through it, the codes re-rounded.
        z = p - j * s_ls
        cc = _pinned_codes(b, at, z, s_ls, j, LEVELS)
        best_e, best_s, best_z, best_j = _keep(b, w, cc, s_ls, z, j, best_e, best_s, best_z, best_j)
    codes = _pinned_codes(b, at, best_z, best_s, best_j, LEVELS)
    return codes.to(tl.int32), best_s, best_z
