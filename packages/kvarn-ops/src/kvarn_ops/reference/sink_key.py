"""The attention-sink token's key at 2 bits: its value on every channel's grid.

A K tile ``[D, G]`` is rounded per channel (row) over its tokens (columns), with a free step
and zero point per channel. So one token's key can be represented exactly, up to the fp16
rounding of the scales: move each channel's grid so that one of its levels is that token's
value. On SmolLM2-135M at k2v2 without an exact first tile (ACCURACY.md, "The first token's
key on every channel's grid") this is worth what keeping the sink's key exact is: pooled over
15 texts, about -2 points of perplexity; at 4 bits an exact sink key makes perplexity worse
(the clipped keys of the other tokens against an exact one), so only 2-bit K tiles take it
(``SINK_KEY_BITS``).

Per row, with ``p`` the sink's value,
``mid``/``half`` the row's centre and half range and the ``CLIP_COUNTS[bits]`` first ratios
``r`` of ``CLIP_RATIOS`` in order: the clipped grid's step ``s = 2 r half / L``, the sink's
code ``j`` = its code on the clipped range ``[mid - r half, mid + r half]``; two candidates,
the step ``s`` and the least-squares step through the sink's point (``sum w (c - j)(b - p) /
sum w (c - j)**2`` with the codes of the first, when both sums are positive), each with zero
point ``p - j step`` and the other tokens' codes re-rounded on it (the sink keeps ``j``). The
first candidate of least weighted error (column weights as the clipping search's) is kept.
A constant row comes out as from every rounding mode: codes 0, step 0, its value as zero
point.
"""

from __future__ import annotations

import torch

from kvarn_ops.reference.rounding import CLIP_COUNTS, CLIP_RATIOS, _codes, column_weights

__all__ = ["SINK_KEY_BITS", "pin_columns"]

SINK_KEY_BITS = (2,)
"""K code widths whose tiles put the sink token's key on every channel's grid."""


def pin_columns(
    b: torch.Tensor, lc: torch.Tensor, pins: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and per-row ``(step, lo)`` of balanced tiles ``b [N, R, C]`` (fp32) whose column
    ``pins[n]`` (0 <= pin < C) each row's grid passes through exactly.

    Returns ``(codes, step, lo)``: codes uint8 ``[N, R, C]``, step and lo fp32 ``[N, R]``.
    """
    levels = float((1 << bits) - 1)
    n, rows, _ = b.shape
    w = column_weights(lc)[:, None, :]
    at = pins.long()[:, None, None].expand(n, rows, 1)
    p = b.gather(2, at)[..., 0]
    lo0 = b.amin(-1)
    hi0 = b.amax(-1)
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * (hi0 - lo0)
    best_e = torch.full_like(p, float("inf"))
    best_c = torch.zeros_like(b)
    best_s = torch.zeros_like(p)
    best_z = torch.zeros_like(p)
    for r in CLIP_RATIOS[: CLIP_COUNTS[bits]]:
        s = 2.0 * r * half / levels
        j = _codes(p[..., None], mid - r * half, s, levels)[..., 0]
        c = _codes(b, p - j * s, s, levels).scatter_(2, at, j[..., None])
        cj = c - j[..., None]
        num = (w * cj * (b - p[..., None])).sum(-1)
        den = (w * cj * cj).sum(-1)
        ok = (num > 0) & (den > 0)
        s_ls = torch.where(ok, num / torch.where(ok, den, 1.0), s)
        for st in (s, s_ls):
            z = p - j * st
            cc = _codes(b, z, st, levels).scatter_(2, at, j[..., None])
            err = b - (cc * st[..., None] + z[..., None])
            e = (w * err * err).sum(-1)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_c = torch.where(better[..., None], cc, best_c)
            best_s = torch.where(better, st, best_s)
            best_z = torch.where(better, z, best_z)
    return best_c.to(torch.uint8), best_s, best_z
