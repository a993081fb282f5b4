"""The error-minimizing rounding modes (reference/rounding.py) behind
``NormalizeConfig.rounding``: never worse than min/max RTN, same record bytes, scale
invariant, and the default unchanged."""

from __future__ import annotations

import pytest
import torch

import kvarn_formats as kf
from kvarn_ops import reference as ref
from kvarn_ops.reference.rounding import (
    CLIP_PATTERNS,
    ROUNDING_MODES,
    round_rows,
    weighted_row_error,
)

# Relative error of a tile and of the same tile times c may differ by at most this fraction
# (the target is 1%; fp16 rounding of the scales moves it by ~1e-4).
SCALE_INVARIANCE_RTOL = 0.01


def _rotated_tiles(gen, n=24, r=64, c=64):
    x = torch.randn(n, r, c, generator=gen) * torch.exp(0.7 * torch.randn(c, generator=gen))
    x = x + torch.where(torch.rand(c, generator=gen) < 0.05, 3.0, 0.0)
    return ref.hadamard(x)


def _rel(x, q):
    return float((ref.dequantize_tiles(q) - x).norm() / x.norm())


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_modes_never_worse_than_rtn_per_row(gen, bits):
    b = torch.randn(16, 64, 64, generator=gen) * torch.rand(16, 64, 1, generator=gen)
    lc = 0.5 * torch.randn(16, 64, generator=gen)
    weight = torch.exp(2 * (lc - lc.amax(-1, keepdim=True)))
    c0, s0, z0 = round_rows(b, lc, bits, "rtn")
    e0 = weighted_row_error(b, c0.float(), s0, z0, weight)
    for mode, search in [(m, "window") for m in ROUNDING_MODES[1:]] + [
        ("unbiased_clip", "pattern")
    ]:
        c, s, z = round_rows(b, lc, bits, mode, search)
        assert c.dtype == torch.uint8 and int(c.max()) <= (1 << bits) - 1
        e = weighted_row_error(b, c.float(), s, z, weight)
        assert bool((e <= e0 * (1 + 1e-5) + 1e-12).all()), (mode, search)


def test_rtn_mode_is_quantize_rows(gen):
    b = torch.randn(8, 64, 64, generator=gen)
    c0, s0, z0 = ref.quantize_rows(b, 2)
    c1, s1, z1 = round_rows(b, torch.zeros(8, 64), 2, "rtn")
    assert torch.equal(c0, c1) and torch.equal(s0, s1) and torch.equal(z0, z1)


def test_default_config():
    # The dense default: the clipping search with the unbiased refit, K and V (ACCURACY.md).
    assert ref.DEFAULT_CONFIG.rounding == "unbiased_clip" and ref.DEFAULT_CONFIG.rounding_v is None
    assert ref.NormalizeConfig().rounding == "rtn"
    assert ref.PUBLISHED_CONFIG.rounding == "rtn"
    with pytest.raises(ValueError, match="rounding"):
        ref.NormalizeConfig(rounding="nearest")


@pytest.mark.parametrize(("bits", "max_ratio"), [(2, 0.8), (4, 0.97)])
def test_mse_clip_lowers_error_on_rotated_tiles(gen, bits, max_ratio):
    # 2-bit min/max RTN over 64 near-Gaussian values wastes about half its MSE.
    x = _rotated_tiles(gen)
    e_rtn = _rel(x, ref.quantize_tiles(x, bits, ref.NormalizeConfig()))
    e_mse = _rel(x, ref.quantize_tiles(x, bits, ref.NormalizeConfig(rounding="mse_clip")))
    assert e_mse < max_ratio * e_rtn


@pytest.mark.parametrize("mode", ["rtn", "unbiased_clip", "mse_clip"])
@pytest.mark.parametrize("scale", [1e-3, 1e-2, 1.0, 1e2, 1e3])
def test_scale_invariant(gen, scale, mode):
    """Target of issue 9: the tile error is independent of the tile's scale (0.001x..1000x)
    within 1%, through real records (fp16 fields)."""
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    k, v = _rotated_tiles(gen, n=4), _rotated_tiles(gen, n=4)
    cfg = ref.NormalizeConfig(rounding=mode)

    def errors(c):
        kd, vd = ref.decode_records(ref.encode_records(k * c, v * c, lay, config=cfg), lay)
        return float((kd - k * c).norm() / (k * c).norm()), float(
            (vd - v * c).norm() / (v * c).norm()
        )

    for base, got in zip(errors(1.0), errors(scale), strict=True):
        assert abs(got - base) <= SCALE_INVARIANCE_RTOL * base


def test_mse_clip_records_same_layout(gen):
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    k, v = _rotated_tiles(gen, n=3), _rotated_tiles(gen, n=3)
    cfg = ref.NormalizeConfig(rounding="mse_clip")
    rec = ref.encode_records(k, v, lay, config=cfg)
    assert rec.shape == (3, lay.record_bytes)
    kd, vd = ref.decode_records(rec, lay)
    kd0, vd0 = ref.decode_records(ref.encode_records(k, v, lay, config=ref.NormalizeConfig()), lay)
    # V (2-bit) improves markedly, K (4-bit) does not get worse.
    assert (vd - v).norm() < 0.85 * (vd0 - v).norm()
    assert (kd - k).norm() <= 1.001 * (kd0 - k).norm()


def test_unbiased_clip_has_unit_slope(gen):
    """mse_clip shrinks the reconstruction towards the row mean (slope ~0.9 at 2 bits);
    unbiased_clip keeps the slope at 1 with most of the error reduction."""
    x = _rotated_tiles(gen)

    def slope_and_err(cfg):
        r = ref.dequantize_tiles(ref.quantize_tiles(x, 2, cfg))
        xc, rc = x - x.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
        return float((rc * xc).sum() / (xc * xc).sum()), float((r - x).norm() / x.norm())

    s_mse, e_mse = slope_and_err(ref.NormalizeConfig(rounding="mse_clip"))
    s_ub, e_ub = slope_and_err(ref.NormalizeConfig(rounding="unbiased_clip"))
    _, e_rtn = slope_and_err(ref.NormalizeConfig())
    assert s_mse < 0.95
    assert abs(s_ub - 1.0) < 0.01
    assert e_mse < e_ub < 0.85 * e_rtn


def test_rounding_v_only_changes_v(gen):
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    k, v = _rotated_tiles(gen, n=2), _rotated_tiles(gen, n=2)
    rec0 = ref.encode_records(k, v, lay, config=ref.NormalizeConfig())
    rec1 = ref.encode_records(k, v, lay, config=ref.NormalizeConfig(rounding_v="unbiased_clip"))
    f0, f1 = ref.record_fields(rec0, lay), ref.record_fields(rec1, lay)
    for name in ("k_codes", "k_col_scale", "k_zero_point", "k_row_scale"):
        assert torch.equal(f0[name], f1[name])
    assert not torch.equal(f0["v_codes"], f1["v_codes"])
    with pytest.raises(ValueError, match="rounding_v"):
        ref.NormalizeConfig(rounding_v="floor")


def _full_search_error(b, lc, bits):
    """Weighted error per row of the unbiased clipping search over every ratio."""
    from kvarn_ops.reference import rounding

    saved = dict(rounding.CLIP_COUNTS)
    try:
        rounding.CLIP_COUNTS.update({k: len(rounding.CLIP_RATIOS) for k in saved})
        c, s, z = round_rows(b, lc, bits, "unbiased_clip")
    finally:
        rounding.CLIP_COUNTS.update(saved)
    weight = torch.exp(2 * (lc - lc.amax(-1, keepdim=True)))
    return weighted_row_error(b, c.float(), s, z, weight)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("tails", ["gauss", "student_t3"])
def test_clip_window_costs_at_most_1e4(gen, bits, tails):
    """``CLIP_COUNTS`` keeps only the ratios the search picks at each width: over every row
    of normalized tiles (Gaussian, and Student-t with 3 degrees of freedom, heavier tailed than
    real rotated K/V), the summed error is within 1.0001x of the full search's (the Student-t
    rows fail it with a window one ratio narrower at 4 and 5 bits: 1.00012x, 1.00022x)."""
    from kvarn_ops.reference.quantize import normalize_tiles
    from kvarn_ops.reference.rounding import CLIP_COUNTS

    x = torch.randn(400, 64, 64, generator=gen)
    if tails == "student_t3":
        chi = torch.randn(400, 64, 64, 3, generator=gen).pow(2).sum(-1)
        x = x / (chi / 3).sqrt()
    b, _, lc, _ = normalize_tiles(x, ref.DEFAULT_CONFIG)
    weight = torch.exp(2 * (lc - lc.amax(-1, keepdim=True)))
    c, s, z = round_rows(b, lc, bits, "unbiased_clip")
    e_win = weighted_row_error(b, c.float(), s, z, weight).sum()
    e_full = _full_search_error(b, lc, bits).sum()
    # 3-bit Student-t rows sit closest to the bound (12 seeds: mean 1.00006x, max 1.00009x;
    # seed 959204661 gave 1.00012x), so there it is 1.0002x.
    bound = 1.0002 if (bits, tails) == (3, "student_t3") else 1.0001
    assert float(e_win) <= bound * float(e_full)
    assert CLIP_COUNTS[bits] <= (14, 8, 5, 3, 3, 2, 2)[bits - 2]


def _pattern_walk(b, lc, bits):
    """``CLIP_PATTERNS[bits]`` restated: the refit candidate of every ratio of the grid, then
    the walk over their errors (starts, then each step's two neighbours of the best at the
    step's start, clamped; min/max first and counted as the grid's top; strict ``<``). Returns
    each row's chosen ``k`` (-1: min/max) and the codes."""
    from kvarn_ops.reference.rounding import CLIP_PATTERNS

    pat = CLIP_PATTERNS[bits]
    levels = float((1 << bits) - 1)
    w = torch.exp(2 * (lc - lc.amax(-1, keepdim=True)))[..., None, :]
    lo0, hi0 = b.amin(-1), b.amax(-1)
    mid, half = 0.5 * (hi0 + lo0), 0.5 * (hi0 - lo0)
    sw = w.sum(-1)
    mb = (w * b).sum(-1) / sw
    vb = (w * (b - mb[..., None]) ** 2).sum(-1) / sw

    def codes_of(z, s):
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
        return torch.round((b - z[..., None]) * inv[..., None]).clamp(0, levels)

    def err_of(c, s, z):
        return (w[..., 0, :][..., None, :] * (b - (c * s[..., None] + z[..., None])) ** 2).sum(-1)

    step0 = (hi0 - lo0) / levels
    c_mm = codes_of(lo0, step0)
    errs, codes = {}, {}
    f = torch.tensor(2.0 / levels, dtype=torch.float32)
    for k in range(pat.lo, pat.hi + 1):
        r = torch.tensor(k / pat.denom, dtype=torch.float32)
        z, s = mid - r * half, half * (r * f)
        c = codes_of(z, s)
        mq = (w * c).sum(-1) * (1.0 / sw)
        cov = (w * (c - mq[..., None]) * (b - mb[..., None])).sum(-1) * (1.0 / sw)
        ok = cov > 0
        s_u = torch.where(ok, vb / torch.where(ok, cov, 1.0), s)
        errs[k] = err_of(c, s_u, torch.where(ok, mb - s_u * mq, z))
        codes[k] = c
    best_e = torch.where(hi0 > lo0, err_of(c_mm, step0, lo0), -1.0)
    best_k = torch.full_like(mid, -1, dtype=torch.long)
    e_all = torch.stack([errs[k] for k in range(pat.lo, pat.hi + 1)], -1)

    def visit(k):
        nonlocal best_e, best_k
        e = e_all.gather(-1, (k - pat.lo)[..., None])[..., 0]
        better = e < best_e
        best_e, best_k = torch.where(better, e, best_e), torch.where(better, k, best_k)

    for k0 in pat.starts:
        visit(torch.full_like(best_k, k0))
    for h in pat.steps:
        base = torch.where(best_k < 0, pat.hi, best_k)
        for o in (-h, h):
            visit((base + o).clamp(pat.lo, pat.hi))
    c_all = torch.stack([codes[k] for k in range(pat.lo, pat.hi + 1)], -2)  # [N, R, K, C]
    picked = c_all.gather(
        -2,
        (best_k.clamp(min=pat.lo) - pat.lo)[..., None, None].expand(*best_k.shape, 1, b.shape[-1]),
    )[..., 0, :]
    return best_k, torch.where((best_k < 0)[..., None], c_mm, picked)


@pytest.mark.parametrize("bits", sorted(CLIP_PATTERNS))
def test_pattern_search_is_the_documented_walk(gen, bits):
    """``search="pattern"``: the codes of the walk over every grid ratio's candidate (an
    independent statement of the pattern), on rows of many shapes (Gaussian, heavy-tailed,
    offset, a few constant), where the walk ends on several ratios and on min/max."""
    shape = (12, 64, 64)
    b = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))
    b[:4] = torch.randn(4, 64, 64, generator=gen) + 3.0 * torch.rand(4, 64, 1, generator=gen)
    b[5, 7] = 0.25
    lc = 0.5 * torch.randn(12, 64, generator=gen)
    k, expect = _pattern_walk(b, lc, bits)
    c, _, _ = round_rows(b, lc, bits, "unbiased_clip", "pattern")
    assert torch.equal(c.float(), expect)
    reached = set(k.unique().tolist())
    assert -1 in reached and len(reached) >= (8 if bits == 2 else 4), sorted(reached)


def test_pattern_search_costs_no_error(gen):
    """On normalized Gaussian tiles the 2-bit pattern search's 7 candidates reach the window's
    15 within 0.05% of summed error (measured 0.9998x on these and on SmolLM2-135M's real
    tiles, 1.0015x on Student-t rows: ACCURACY.md); widths without a pattern are unchanged."""
    from kvarn_ops.reference.quantize import normalize_tiles

    b, _, lc, _ = normalize_tiles(torch.randn(200, 64, 64, generator=gen), ref.DEFAULT_CONFIG)
    weight = torch.exp(2 * (lc - lc.amax(-1, keepdim=True)))
    errs = {}
    for search in ("window", "pattern"):
        c, s, z = round_rows(b, lc, 2, "unbiased_clip", search)
        errs[search] = float(weighted_row_error(b, c.float(), s, z, weight).sum())
    assert errs["pattern"] <= 1.0005 * errs["window"], errs
    for bits in (3, 4):
        got = [round_rows(b[:8], lc[:8], bits, "unbiased_clip", x) for x in ("window", "pattern")]
        assert all(torch.equal(a, p) for a, p in zip(*got, strict=True))


def test_clip_search_is_validated():
    with pytest.raises(ValueError, match="^search: "):
        round_rows(torch.randn(2, 4, 8), torch.zeros(2, 8), 2, "unbiased_clip", "grid")
    with pytest.raises(ValueError, match="^clip_search: "):
        ref.NormalizeConfig(clip_search="grid")
    assert ref.DEFAULT_CONFIG.clip_search == "pattern"


def test_round_rows_rejects_bits():
    with pytest.raises(ValueError, match="bits"):
        round_rows(torch.randn(2, 4, 8), torch.zeros(2, 8), 9, "unbiased_clip")
