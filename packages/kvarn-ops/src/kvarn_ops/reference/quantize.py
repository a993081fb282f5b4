"""Tile quantization: dual-axis variance normalization, asymmetric RTN, fold, fp16 scales.

A tile ``X [R, C]`` is quantized with round-to-nearest over each of its R rows after a
normalization ``X = 2**e * diag(exp(lr)) @ B @ diag(exp(lc))``. Orientation (method doc,
section 1): the K tile is ``[D, G]`` (rows = channels: keys are quantized per channel over
the G tokens), the V tile is ``[G, D]`` (rows = tokens).

Algorithm (fp32; every step is what a kernel must reproduce):

1. Non-finite tokens: a token (a K or V row of D values) holding any NaN or +-Inf is replaced
   by zeros before anything else, so the codes of every other token of the tile are those the
   caller would get by zeroing that token. Such a token decodes to (about) zero.
2. Prescale (default): ``e = floor(log2(max|X|))`` (0 for an all-zero tile) and
   ``Xp = X * 2**-e`` (exact). With step 3 this makes the result scale invariant: quantizing
   ``c * X`` gives ``c`` times the result for ``X`` (codes identical and scales bit for bit
   when c is a power of two and no stored field is subnormal; see step 6).
3. Normalization: log-scales ``lr [R] = 0``, ``lc [C] = 0``; the current tile is
   ``Y = (Xp * exp(-lr)[:, None]) * exp(-lc)[None, :]``. Each of ``iters`` iterations divides
   the columns by their spread (``lc += log(spread of each column of Y)``) and then the rows
   (``lr += log(spread of each row of Y)``). The spread of a line is
   ``max(std, std_floor * rms)`` (population std; the floor keeps near-constant lines finite);
   a line that is entirely zero takes the geometric mean of the positive spreads of its axis
   (1 if there are none). The iterate with the lowest imbalance
   ``max/min column spread + max/min row spread`` among iterates 0 (``lr = lc = 0``) .. iters
   is kept; ties keep the earlier one. The published variant also clamps ``lr``, ``lc`` to
   ``[-0.3, 10]`` after every update and has no prescale: that clip forbids amplifying small
   tiles, so it is not scale invariant.
4. Codes and per-row ``(step, lo)`` of each row r of the balanced tile ``B = Y(best)``, by
   ``config.rounding`` (``rounding_v`` for V tiles when set). Min/max RTN (``"rtn"``, the
   published rounding): ``lo = min``, ``hi = max``, ``step = (hi - lo) / (2**b - 1)``,
   ``code = clamp(rint((B - lo) * inv), 0, 2**b - 1)`` with ``inv = (2**b - 1) / (hi - lo)``
   (0 for a zero-range row, whose codes are 0); rint rounds half to even. The default
   (``"unbiased_clip"``, ``reference/rounding.py``) tries up to 14 clipping ranges (at 2
   bits the 6 of a pattern search, ``clip_search="pattern"``), refits each
   candidate's ``(step, lo)`` so the reconstruction is unbiased along the row, and keeps the
   candidate of least error in the model frame (min/max first, so never worse than RTN on
   that error); measured on SmolLM2-135M (ACCURACY.md) it cuts the perplexity cost of 2-bit V
   by more than half.
   Sink token (``config.sink_token``, tiles given a row in ``sink_rows``; V tiles in
   practice): that row is put on a symmetric grid and its residual moved into the column
   scales (``lc += log r``, ``B /= r``, ``r`` in ``[1/sqrt(3), sqrt(3)]``, ``reference/sink.py``)
   before the other rows are rounded; the row keeps its grid codes, step and zero point.
5. Fold: row-side scale ``s[r] = exp(lr[r]) * step[r]``, zero point ``z[r] = exp(lr[r]) * lo[r]``,
   column-side scale ``w[c] = exp(lc[c])``, so ``X[r, c] ~= 2**e * (code * s[r] + z[r]) * w[c]``.
6. fp16 storage (default rebalance): only the product of the two sides matters, so a power of
   two ``2**j`` moves from one side to the other: stored ``s, z <- (s, z) * 2**(e + j)``,
   ``w <- w * 2**-j``. With ``frexp`` exponents (``v = m * 2**E``, ``0.5 <= m < 1``) ``A_lo``,
   ``A_hi`` of the smallest and largest nonzero ``max(|s[r]|, |z[r]|)`` (plus e) and ``B_lo``,
   ``B_hi`` of ``w``: ``L = max(-13 - A_lo, B_hi - 15)``, ``U = min(15 - A_hi, B_lo + 13)``,
   ``j = floor((L + U) / 2)`` (integer maths; ``A`` terms dropped when every row is zero). Then
   every stored scale is a normal fp16 number (``2**-14 <= |v| < 2**15``) whenever the tile's
   dynamic range allows it (tiles of magnitude 1e-4..1e4 are tested). In every variant the
   fp16 cast saturates at +-65504 (never Inf); without rebalancing (the published variant)
   small tiles get subnormal scales. A zero point far below its row's step may still be
   subnormal (the rebalance bounds the row scales, not the zero points); it then rounds on
   fp16's subnormal grid, by at most 2**-25 times its column scale. A zero-range row decodes
   to ``z * w`` exactly (no code term); a constant tile decodes exactly to its value when that
   value is an fp16 number.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvarn_ops.reference.rounding import CLIP_SEARCHES, ROUNDING_MODES, round_rows
from kvarn_ops.reference.sink import apply_sink, check_sink_rows
from kvarn_ops.reference.sink_key import SINK_KEY_BITS, pin_columns

__all__ = [
    "DEFAULT_CONFIG",
    "PUBLISHED_CONFIG",
    "NormalizeConfig",
    "QuantizedTiles",
    "dequantize_k",
    "dequantize_tiles",
    "dequantize_v",
    "normalize_tiles",
    "quantize_k",
    "quantize_rows",
    "quantize_tiles",
    "quantize_v",
    "zero_nonfinite_tokens",
]


@dataclass(frozen=True)
class NormalizeConfig:
    """How tiles are normalized before RTN.

    Attributes
    ----------
    iters : int
        Column+row iterations (the best-balanced of iterates 0..iters is kept).
    log_scale_clip : (float, float) or None
        Clamp of the accumulated natural-log scales after each update; ``None`` (default) for
        none, ``(-0.3, 10.0)`` in the published implementation.
    prescale : bool
        Divide the tile by ``2**floor(log2(max|x|))`` first (makes the method scale invariant).
    rebalance_fp16 : bool
        Move a power of two between row and column scales so the fp16 fields stay normal.
    std_floor : float
        Spread of a line = ``max(std, std_floor * rms)``.
    rounding : str
        How codes and per-row (step, zero point) are chosen (``reference/rounding.py``):
        ``"rtn"`` (this field's default, the published rounding) is min/max RTN (step 4);
        ``"unbiased_clip"`` (what ``DEFAULT_CONFIG`` uses) and ``"mse_clip"`` choose the
        clipping range by error.
    rounding_v : str or None
        Overrides ``rounding`` for V tiles (``None``: same as K).
    clip_search : str
        The candidates of ``"unbiased_clip"`` (``reference.rounding.CLIP_SEARCHES``):
        ``"window"`` (this field's default) every ratio of the width's window, ``"pattern"``
        (what ``DEFAULT_CONFIG`` uses) the width's pattern search where there is one (2 bits:
        7 candidates instead of 15).
    sink_token : bool
        Reconstruct the attention-sink token's V row almost exactly in the tiles whose caller
        marks it (``sink_rows`` of :func:`quantize_v`; a serving engine marks the first token
        of each request), by moving its residual into the column scales
        (``reference/sink.py``). Tiles without a mark are unaffected.
    sink_key : bool
        With ``sink_token``, also put the marked token's key on every channel's grid in K
        tiles of the widths in ``SINK_KEY_BITS`` (2 bits; ``reference/sink_key.py``).
    """

    iters: int = 8
    log_scale_clip: tuple[float, float] | None = None
    prescale: bool = True
    rebalance_fp16: bool = True
    std_floor: float = 1e-3
    rounding: str = "rtn"
    rounding_v: str | None = None
    clip_search: str = "window"
    sink_token: bool = False
    sink_key: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"iters: must be an integer >= 0, got {self.iters!r}")
        if not self.std_floor > 0:
            raise ValueError(f"std_floor: must be > 0, got {self.std_floor!r}")
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding: must be one of {ROUNDING_MODES}, got {self.rounding!r}")
        if self.clip_search not in CLIP_SEARCHES:
            raise ValueError(
                f"clip_search: must be one of {CLIP_SEARCHES}, got {self.clip_search!r}"
            )
        if self.rounding_v is not None and self.rounding_v not in ROUNDING_MODES:
            raise ValueError(
                f"rounding_v: must be None or one of {ROUNDING_MODES}, got {self.rounding_v!r}"
            )


DEFAULT_CONFIG = NormalizeConfig(
    iters=2, rounding="unbiased_clip", clip_search="pattern", sink_token=True
)
"""What every dense op uses: scale-invariant normalization (2 iterations), then the clipping
search with the unbiased refit (``reference/rounding.py``) for K and V, and the sink token's
V row kept almost exact where the caller marks it (``reference/sink.py``; on SmolLM2-135M
k4v2 without an exact first tile: license text +4.6% -> +1.0%, ACCURACY.md). Two iterations
instead of the published eight (four from 2026-12-04, two since 2026-12-05): on SmolLM2-135M
the difference in perplexity was not measurable without an exact first tile (paired, pooled
over six texts and on the license text, k2v2 to k4v4; ACCURACY.md; with an exact first tile,
which the serving plugin does not keep, k2v2 pooled +0.64 +- 0.30), and the flush's time is
its arithmetic's (2 iterations against 4: 14% less time in bulk and 16% for a decode step's
one block on an H100; 4 against 8: 1.2x and 1.4x on an H200; BENCHMARKS.md)."""
PUBLISHED_CONFIG = NormalizeConfig(
    log_scale_clip=(-0.3, 10.0), prescale=False, rebalance_fp16=False
)
"""The published implementation's behaviour (log-scale clip, no prescale, plain fp16 cast),
for comparisons; not scale invariant."""

_FP16_EXP_MIN = -13  # frexp exponent of the smallest normal fp16 (2**-14 = 0.5 * 2**-13)
_FP16_EXP_MAX = 15  # values below 2**15 cannot round up to inf
_FP16_MAX = 65504.0


@dataclass
class QuantizedTiles:
    """RTN over the rows of N tiles ``[R, C]``, scales folded and stored as fp16.

    ``x[n, r, c] ~= (codes[n, r, c] * row_scale[n, r] + zero_point[n, r]) * col_scale[n, c]``
    (row = the RTN axis). Shapes: codes uint8 ``[N, R, C]``; row_scale, zero_point float16
    ``[N, R]``; col_scale float16 ``[N, C]``.
    """

    codes: torch.Tensor
    row_scale: torch.Tensor
    zero_point: torch.Tensor
    col_scale: torch.Tensor


def zero_nonfinite_tokens(x: torch.Tensor) -> torch.Tensor:
    """Replace every token (last-dim vector of ``x [..., G, D]``) holding a NaN/Inf by zeros."""
    bad = ~torch.isfinite(x).all(dim=-1, keepdim=True)
    return torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x)


def _spread(y: torch.Tensor, dim: int, std_floor: float) -> torch.Tensor:
    """Spread of every line of ``y [N, R, C]`` along ``dim``: max(std, floor * rms), zero lines
    filled with the geometric mean of the positive spreads of the same tile and axis."""
    mean = y.mean(dim=dim, keepdim=True)
    std = ((y - mean) ** 2).mean(dim=dim).sqrt()
    rms = (y * y).mean(dim=dim).sqrt()
    s = torch.maximum(std, std_floor * rms)
    pos = s > 0
    logs = torch.where(pos, s.clamp_min(torch.finfo(s.dtype).tiny).log(), torch.zeros_like(s))
    count = pos.sum(dim=-1, keepdim=True)
    fill = torch.where(
        count > 0,
        (logs.sum(-1, keepdim=True) / count.clamp_min(1)).exp(),
        torch.ones_like(logs[..., :1]),
    )
    return torch.where(pos, s, fill)


def _imbalance(y: torch.Tensor, std_floor: float) -> torch.Tensor:
    col = _spread(y, 1, std_floor)
    row = _spread(y, 2, std_floor)
    return col.amax(-1) / col.amin(-1) + row.amax(-1) / row.amin(-1)


def _apply(xp: torch.Tensor, lr: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    return (xp * torch.exp(-lr)[:, :, None]) * torch.exp(-lc)[:, None, :]


def normalize_tiles(
    x: torch.Tensor, config: NormalizeConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-axis normalization of finite tiles (steps 2-3 of the module docstring).

    Parameters
    ----------
    x : float32 [N, R, C], finite.

    Returns
    -------
    balanced : float32 [N, R, C]
    lr : float32 [N, R], lc : float32 [N, C]
        Natural-log scales of the best iterate.
    e : int32 [N]
        Prescale exponent: ``x = 2**e * exp(lr)[:, None] * balanced * exp(lc)[None, :]``.
    """
    n, r, c = x.shape
    x = x.to(torch.float32)
    if config.prescale:
        amax = x.abs().amax(dim=(1, 2))
        _, ex = torch.frexp(amax)  # amax = m * 2**ex, 0.5 <= m < 1
        e = torch.where(amax > 0, ex - 1, torch.zeros_like(ex)).to(torch.int32)
        xp = torch.ldexp(x, -e[:, None, None].to(torch.float32))
    else:
        e = torch.zeros(n, dtype=torch.int32, device=x.device)
        xp = x
    lr = torch.zeros(n, r, dtype=torch.float32, device=x.device)
    lc = torch.zeros(n, c, dtype=torch.float32, device=x.device)
    best_lr, best_lc = lr.clone(), lc.clone()
    best = _imbalance(xp, config.std_floor)
    clip = config.log_scale_clip
    for _ in range(config.iters):
        lc = lc + _spread(_apply(xp, lr, lc), 1, config.std_floor).log()
        if clip is not None:
            lc = lc.clamp(clip[0], clip[1])
        lr = lr + _spread(_apply(xp, lr, lc), 2, config.std_floor).log()
        if clip is not None:
            lr = lr.clamp(clip[0], clip[1])
        imb = _imbalance(_apply(xp, lr, lc), config.std_floor)
        better = imb < best
        best = torch.where(better, imb, best)
        best_lr = torch.where(better[:, None], lr, best_lr)
        best_lc = torch.where(better[:, None], lc, best_lc)
    return _apply(xp, best_lr, best_lc), best_lr, best_lc, e


def quantize_rows(b: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric RTN over each row of ``b [..., R, C]`` (step 4).

    Returns codes uint8 ``[..., R, C]``, step float32 ``[..., R]``, lo float32 ``[..., R]``;
    ``b ~= codes * step + lo`` (exact, with codes 0 and step 0, on a zero-range row).
    """
    levels = float((1 << bits) - 1)
    lo = b.amin(dim=-1)
    hi = b.amax(dim=-1)
    rng = hi - lo
    inv = torch.where(rng > 0, levels / torch.where(rng > 0, rng, 1.0), 0.0)
    codes = torch.round((b - lo[..., None]) * inv[..., None]).clamp_(0, levels)
    return codes.to(torch.uint8), rng / levels, lo


def _to_fp16(v: torch.Tensor) -> torch.Tensor:
    # Saturate: a tile whose dynamic range does not fit fp16 stays finite (never Inf).
    return v.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def _exponent(v: torch.Tensor) -> torch.Tensor:
    return torch.frexp(v)[1].to(torch.int32)


def quantize_tiles(
    x: torch.Tensor,
    bits: int,
    config: NormalizeConfig = DEFAULT_CONFIG,
    sink_rows: torch.Tensor | None = None,
    sink_cols: torch.Tensor | None = None,
) -> QuantizedTiles:
    """Normalize, RTN over rows, fold and store scales as fp16 (steps 2-6).

    Parameters
    ----------
    x : float32 [N, R, C], finite (zero non-finite tokens first, see
        :func:`zero_nonfinite_tokens`).
    bits : int, 2..8
    sink_rows : int [N] or None
        With ``config.sink_token``, the row of each tile to reconstruct almost exactly (-1:
        none; ``reference/sink.py``): after step 3 its residual moves into the column scales
        (``lc += log r``, the balanced tile divided by ``r``), every row is rounded (step 4),
        and that row takes its symmetric-grid codes, step and zero point.
    sink_cols : int [N] or None
        With ``config.sink_token`` and ``bits`` in ``SINK_KEY_BITS``, the column of each tile
        (K tiles: the sink token) that every row's grid passes through exactly (-1: none;
        ``reference/sink_key.py``); those tiles take the pinned codes, steps and zero points.
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits: must be from 2 to 8, got {bits}")
    check_sink_rows(sink_rows, x.shape[0], x.shape[1], x.device)
    check_sink_rows(sink_cols, x.shape[0], x.shape[2], x.device, name="sink_cols")
    balanced, lr, lc, e = normalize_tiles(x, config)
    sink = None
    if config.sink_token and sink_rows is not None:
        balanced, lc, sink = apply_sink(balanced, lc, sink_rows, bits)
    if config.rounding == "rtn":
        codes, step, lo = quantize_rows(balanced, bits)
    else:
        codes, step, lo = round_rows(balanced, lc, bits, config.rounding, config.clip_search)
    if config.sink_token and config.sink_key and sink_cols is not None and bits in SINK_KEY_BITS:
        t = (sink_cols >= 0).nonzero()[:, 0]
        if t.numel():
            codes[t], step[t], lo[t] = pin_columns(balanced[t], lc[t], sink_cols[t], bits)
    if sink is not None:
        tiles, rows, sink_codes, sink_step, sink_lo = sink
        codes[tiles, rows] = sink_codes
        step[tiles, rows] = sink_step
        lo[tiles, rows] = sink_lo
    row_mult = torch.exp(lr)
    s = row_mult * step
    z = row_mult * lo
    w = torch.exp(lc)
    if config.rebalance_fp16:
        mag = torch.maximum(s.abs(), z.abs())
        nz = mag > 0
        big = torch.iinfo(torch.int32).max // 4
        ea = _exponent(mag) + e[:, None]
        a_lo = torch.where(nz, ea, big).amin(-1)
        a_hi = torch.where(nz, ea, -big).amax(-1)
        eb = _exponent(w)
        b_lo, b_hi = eb.amin(-1), eb.amax(-1)
        has_a = nz.any(-1)
        lower = torch.where(
            has_a, torch.maximum(_FP16_EXP_MIN - a_lo, b_hi - _FP16_EXP_MAX), b_hi - _FP16_EXP_MAX
        )
        upper = torch.where(
            has_a, torch.minimum(_FP16_EXP_MAX - a_hi, b_lo - _FP16_EXP_MIN), b_lo - _FP16_EXP_MIN
        )
        j = torch.div(lower + upper, 2, rounding_mode="floor")
    else:
        j = torch.zeros_like(e)
    shift_a = (e + j).to(torch.float32)[:, None]
    shift_b = (-j).to(torch.float32)[:, None]
    return QuantizedTiles(
        codes=codes,
        row_scale=_to_fp16(torch.ldexp(s, shift_a)),
        zero_point=_to_fp16(torch.ldexp(z, shift_a)),
        col_scale=_to_fp16(torch.ldexp(w, shift_b)),
    )


def dequantize_tiles(q: QuantizedTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(codes * row_scale + zero_point) * col_scale`` computed in ``dtype`` (fp32 or fp64),
    ``[N, R, C]``."""
    s = q.row_scale.to(dtype)[:, :, None]
    z = q.zero_point.to(dtype)[:, :, None]
    w = q.col_scale.to(dtype)[:, None, :]
    return (q.codes.to(dtype) * s + z) * w


def quantize_k(
    k: torch.Tensor,
    bits: int,
    config: NormalizeConfig = DEFAULT_CONFIG,
    sink_rows: torch.Tensor | None = None,
) -> dict:
    """Quantize K tiles given token-major ``k [N, G, D]`` (rotated frame, any finite or not).
    ``sink_rows`` (int [N], -1 for none): the attention-sink token of each tile; with
    ``config.sink_token`` its key is on every channel's grid at the widths of
    ``SINK_KEY_BITS`` (:func:`quantize_tiles`'s ``sink_cols``).

    Returns the record fields: ``k_codes`` uint8 [N, D, G], ``k_col_scale`` [N, D],
    ``k_zero_point`` [N, D], ``k_row_scale`` [N, G] (float16).
    """
    check_sink_rows(sink_rows, k.shape[0], k.shape[1], k.device)
    tiles = zero_nonfinite_tokens(k.to(torch.float32)).transpose(1, 2)  # [N, D, G]
    q = quantize_tiles(tiles.contiguous(), bits, config, sink_cols=sink_rows)
    return {
        "k_codes": q.codes,
        "k_col_scale": q.row_scale,
        "k_zero_point": q.zero_point,
        "k_row_scale": q.col_scale,
    }


def quantize_v(
    v: torch.Tensor,
    bits: int,
    config: NormalizeConfig = DEFAULT_CONFIG,
    sink_rows: torch.Tensor | None = None,
) -> dict:
    """Quantize V tiles ``v [N, G, D]`` (rotated frame). ``sink_rows`` (int [N], -1 for
    none): the attention-sink token of each tile, kept almost exact with
    ``config.sink_token`` (:func:`quantize_tiles`).

    Returns ``v_codes`` uint8 [N, G, D], ``v_col_scale`` [N, D], ``v_row_scale`` [N, G],
    ``v_zero_point`` [N, G] (float16).
    """
    if config.rounding_v is not None:
        config = replace(config, rounding=config.rounding_v)
    q = quantize_tiles(zero_nonfinite_tokens(v.to(torch.float32)), bits, config, sink_rows)
    return {
        "v_codes": q.codes,
        "v_col_scale": q.col_scale,
        "v_row_scale": q.row_scale,
        "v_zero_point": q.zero_point,
    }


def dequantize_k(fields: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K ``[N, G, D]`` in ``dtype``: ``K[t, d] = (code[d, t] * s_col[d] + zp[d]) * s_row[t]``."""
    q = QuantizedTiles(
        fields["k_codes"], fields["k_col_scale"], fields["k_zero_point"], fields["k_row_scale"]
    )
    return dequantize_tiles(q, dtype).transpose(1, 2).contiguous()


def dequantize_v(fields: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """V ``[N, G, D]`` in ``dtype``: ``V[t, d] = (code[t, d] * s_row[t] + zp[t]) * s_col[d]``."""
    q = QuantizedTiles(
        fields["v_codes"], fields["v_row_scale"], fields["v_zero_point"], fields["v_col_scale"]
    )
    return dequantize_tiles(q, dtype)
