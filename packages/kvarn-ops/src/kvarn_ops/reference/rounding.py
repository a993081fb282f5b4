"""Choosing codes and per-row (step, zero point) for the RTN step of tile quantization.

The record stores, per RTN row, an arbitrary step and zero point (folded into the row-side
scale and zero point fields) and per column a scale. Min/max RTN (``rounding="rtn"``, the
default of :class:`~kvarn_ops.reference.quantize.NormalizeConfig`) spends the 2**b levels on
the row's extremes; at 2 bits over 64 near-Gaussian values (what a Hadamard-rotated row looks
like) that is a step of about 1.6 sigma, twice the mean squared error of the best uniform
quantizer. The modes here keep the record layout and the dequantization formula and only
choose ``(codes, step, lo)`` better, minimizing the reconstruction error in the model's frame:

- ``"mse_clip"``: per row, try clipping ranges ``[mid - r*h, mid + r*h]`` (``mid``, ``h`` the
  centre and half-range of the row, r in ``CLIP_RATIOS``) and keep the one with the least
  error; then alternate a weighted least-squares refit of ``(step, lo)`` given the codes with
  re-rounding given ``(step, lo)`` (``REFIT_ITERS`` times), keeping the best iterate.
- ``"mse_grid"``: the clipping search only (no refit), for ablations.
- ``"rtn_refit"``: min/max codes, then the refit iterations only, for ablations.
- ``"unbiased_clip"``: the clipping search over the first ``CLIP_COUNTS[bits]`` ratios (the window
  where the search's choices fall at that width, below; ``search="pattern"`` tries 6 ratios
  chosen by a pattern search instead where :data:`CLIP_PATTERNS` has the width), but every
  candidate's ``(step, lo)`` is refit so that the reconstruction is unbiased along the row (the
  regression of ``Bhat`` on ``B`` has slope 1 and the weighted means agree: ``step = var(B) /
  cov(codes, B)``); the candidate with the least error is kept. Least-squares fits shrink the
  reconstruction towards the row mean (the error correlates with the value); attention sums V
  over many tokens and scores over many channels, where uncorrelated noise averages out but
  shrinkage does not: measured on SmolLM2-135M, ``mse_clip`` lowers the tile error and raises
  perplexity, this mode lowers both.

The error of row r is ``exp(2*lr[r]) * sum_c exp(2*lc[c]) * (B[r, c] - Bhat[r, c])**2`` in the
model frame (the Hadamard rotation is orthogonal), so rows are independent and each is
optimized with column weights ``exp(2*lc)``. Everything is relative to the row, so the result
stays scale invariant. Ties keep the earlier candidate (min/max first), so no mode is ever
worse than min/max RTN on the weighted error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "CLIP_COUNTS",
    "CLIP_PATTERNS",
    "CLIP_RATIOS",
    "CLIP_SEARCHES",
    "ClipPattern",
    "REFIT_ITERS",
    "ROUNDING_MODES",
    "column_weights",
    "round_rows",
    "weighted_row_error",
]

ROUNDING_MODES = ("rtn", "mse_clip", "mse_grid", "rtn_refit", "unbiased_clip")
"""Accepted values of ``NormalizeConfig.rounding``."""
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35)
"""Half-range fractions tried by the clipping search (1.0 = min/max)."""
CLIP_COUNTS = {2: 14, 3: 8, 4: 5, 5: 3, 6: 3, 7: 2, 8: 2}
"""How many of ``CLIP_RATIOS`` (from 1.0 down) the ``"unbiased_clip"`` search tries at each
bit width, after min/max. Wider codes pick ratios near 1: on the real K and V tiles of
SmolLM2-135M (license text and a pydoc text, every layer, after the default normalization) and
on rows of Gaussian, Laplace and Student-t (3 degrees of freedom) tiles, the weighted error
summed over all rows with these windows is within 1.0001x of the full search at every width
(ACCURACY.md, "The clipping search's window per bit width"); the flush's search, most of its
arithmetic, shrinks with it (4-bit K: 6 candidates instead of 15)."""
REFIT_ITERS = 6
"""Least-squares refit / re-round alternations after the clipping search."""
CLIP_SEARCHES = ("window", "pattern")
"""How ``"unbiased_clip"`` picks its candidates: ``"window"`` tries every ratio of the width's
window (``CLIP_COUNTS``); ``"pattern"`` runs the width's :data:`CLIP_PATTERNS` entry where
there is one (the window elsewhere)."""


@dataclass(frozen=True)
class ClipPattern:
    """A pattern search over the clipping ratios ``k / denom``, ``lo <= k <= hi``: after
    min/max, the ratios of ``starts`` in order, then for each ``h`` of ``steps`` the best
    candidate's ``k - h`` and ``k + h`` (clamped to ``[lo, hi]``; ``k`` is the best's at the start
    of the step, min/max counting as ``hi``). ``1 + len(starts) + 2 * len(steps)`` candidates,
    each refit as the window's are. The ratios are dyadic, so ``k / denom`` is exact in fp32 and a
    kernel computes every candidate's clipping range from its integer ``k`` without a table."""

    starts: tuple[int, ...]
    steps: tuple[int, ...]
    denom: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        """Candidates after min/max."""
        return len(self.starts) + 2 * len(self.steps)


CLIP_PATTERNS = {2: ClipPattern(starts=(24, 18), steps=(3, 1), denom=32, lo=8, hi=32)}
"""The pattern searches of ``search="pattern"`` by code width. At 2 bits: 0.75 and 0.5625, then
steps of 3/32 and 1/32 around the best: 7 candidates instead of the window's 15 (the V tile's
search was about half of a k4v2 flush's arithmetic), reaching ratios 0.4375 .. 0.875 on a 1/32
grid. On the real K and V tiles of SmolLM2-135M (every layer of the license text after the
default normalization) the weighted error summed over all rows is 0.9998x the window's
(ACCURACY.md, "A pattern search for the 2-bit clipping range")."""


def _codes(b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, levels: float) -> torch.Tensor:
    inv = torch.where(step > 0, 1.0 / torch.where(step > 0, step, 1.0), 0.0)
    return torch.round((b - lo[..., None]) * inv[..., None]).clamp_(0, levels)


def step_factor(ratio: float, levels: float) -> torch.Tensor:
    """``2 * ratio / levels`` as the fp32 quotient of fp32 operands (a 0-d tensor): the
    clipped step of a candidate is the row's half-range times it (``"unbiased_clip"``)."""
    f32 = torch.float32
    return torch.tensor(2.0 * ratio, dtype=f32) / torch.tensor(levels, dtype=f32)


def column_weights(lc: torch.Tensor) -> torch.Tensor:
    """Error weight of every column, ``exp(2 * lc)`` relative to the tile's largest (scale
    free, no overflow); ``lc [..., C]`` natural-log column scales."""
    return torch.exp(2.0 * (lc - lc.amax(dim=-1, keepdim=True)))


def weighted_row_error(
    b: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``sum_c weight[c] * (b - (codes * step + lo))**2`` per row; ``b [..., R, C]``,
    ``weight [..., C]``."""
    err = b - (codes * step[..., None] + lo[..., None])
    return (err * err * weight[..., None, :]).sum(-1)


def _refit(
    b: torch.Tensor, codes: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted least squares of ``b ~= step * codes + lo`` per row; ``ok`` is False where the
    system is degenerate (all codes equal) or the step would not be positive."""
    w = weight[..., None, :]
    sw = w.sum(-1).expand(codes.shape[:-1])
    sq = (w * codes).sum(-1)
    sqq = (w * codes * codes).sum(-1)
    sb = (w * b).sum(-1)
    sqb = (w * codes * b).sum(-1)
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * sw * sqq
    safe = torch.where(ok, det, 1.0)
    step = (sw * sqb - sq * sb) / safe
    lo = (sb - step * sq) / sw
    return step, lo, ok & (step > 0)


def round_rows(
    b: torch.Tensor, lc: torch.Tensor, bits: int, mode: str, search: str = "window"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and per-row ``(step, lo)`` for the balanced tiles ``b [N, R, C]`` (float32).

    Parameters
    ----------
    b : float32 [N, R, C], the balanced tiles (RTN runs over each row).
    lc : float32 [N, C], natural-log column scales: column c of the tile is multiplied by
        ``exp(lc[c])`` on dequantization, so its error weighs ``exp(2*lc[c])``.
    bits : 2..8.
    mode : one of :data:`ROUNDING_MODES`.
    search : one of :data:`CLIP_SEARCHES`: the candidates of ``"unbiased_clip"``.

    Returns
    -------
    codes uint8 [N, R, C], step float32 [N, R], lo float32 [N, R] with
    ``b ~= codes * step + lo`` (codes 0 and step 0 on a zero-range row, exactly as RTN).
    """
    if mode not in ROUNDING_MODES:
        raise ValueError(f"rounding: must be one of {ROUNDING_MODES}, got {mode!r}")
    if bits not in CLIP_COUNTS:
        raise ValueError(f"bits: must be from 2 to 8, got {bits!r}")
    if search not in CLIP_SEARCHES:
        raise ValueError(f"search: must be one of {CLIP_SEARCHES}, got {search!r}")
    levels = float((1 << bits) - 1)
    lo0 = b.amin(dim=-1)
    hi0 = b.amax(dim=-1)
    rng = hi0 - lo0
    step0 = rng / levels
    codes = _codes(b, lo0, step0, levels)
    if mode == "rtn":
        return codes.to(torch.uint8), step0, lo0
    weight = column_weights(lc)
    live = rng > 0
    best_err = weighted_row_error(b, codes, step0, lo0, weight)
    best_codes, best_step, best_lo = codes, step0, lo0
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * rng

    def keep(c: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Keep the candidate in the rows where it is better; returns those rows."""
        nonlocal best_err, best_codes, best_step, best_lo
        e = weighted_row_error(b, c, s, z, weight)
        better = (e < best_err) & live
        best_err = torch.where(better, e, best_err)
        best_codes = torch.where(better[..., None], c, best_codes)
        best_step = torch.where(better, s, best_step)
        best_lo = torch.where(better, z, best_lo)
        return better

    if mode in ("mse_clip", "mse_grid"):
        for r in CLIP_RATIOS[1:]:
            z = mid - r * half
            s = 2.0 * r * half / levels
            keep(_codes(b, z, s, levels), s, z)
    if mode == "unbiased_clip":
        # Per candidate and row one division (the refit's step) besides the codes' inverse
        # step: the means are sums times the tile's 1 / sum(w), and the clipped step is the
        # half-range times the candidate's fp32 factor 2 r / levels (the Triton flush takes
        # the same products; a division per row and candidate costs it about ten
        # instructions in a loop that is most of its time).
        w = weight[..., None, :]
        sw = w.sum(-1)
        rsw = 1.0 / sw
        mb = (w * b).sum(-1) / sw
        vb = (w * (b - mb[..., None]) ** 2).sum(-1) / sw

        def refit_and_keep(z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            c = _codes(b, z, s, levels)
            mq = (w * c).sum(-1) * rsw
            cov = (w * (c - mq[..., None]) * (b - mb[..., None])).sum(-1) * rsw
            ok = cov > 0
            s_u = torch.where(ok, vb / torch.where(ok, cov, 1.0), s)
            z_u = torch.where(ok, mb - s_u * mq, z)
            return keep(c, s_u, z_u)

        pattern = CLIP_PATTERNS.get(bits) if search == "pattern" else None
        if pattern is None:
            for r in CLIP_RATIOS[: CLIP_COUNTS[bits]]:
                refit_and_keep(mid - r * half, half * step_factor(r, levels))
        else:
            # k of the best candidate so far (-1: min/max); a step's candidates are around the
            # best at the step's start, min/max counting as the grid's top.
            best_k = torch.full_like(mid, -1.0)
            unit = 1.0 / pattern.denom
            f = torch.tensor(2.0 / levels, dtype=torch.float32)

            def try_k(k: torch.Tensor) -> None:
                nonlocal best_k
                r = k * unit  # exact: k and denom are small integers, denom a power of two
                won = refit_and_keep(mid - r * half, half * (r * f))
                best_k = torch.where(won, k, best_k)

            for k0 in pattern.starts:
                try_k(torch.full_like(mid, float(k0)))
            for h in pattern.steps:
                base = torch.where(best_k < 0, float(pattern.hi), best_k)
                for o in (-h, h):
                    try_k((base + o).clamp(pattern.lo, pattern.hi))
    if mode in ("mse_clip", "rtn_refit"):
        c = best_codes
        for _ in range(REFIT_ITERS):
            s, z, ok = _refit(b, c, weight)
            s = torch.where(ok, s, best_step)
            z = torch.where(ok, z, best_lo)
            keep(c, s, z)  # refit with the same codes
            c = _codes(b, z, s, levels)
            keep(c, s, z)  # re-rounded
    return best_codes.to(torch.uint8), best_step, best_lo
