"""Triton flush vs ``kvarn_ops.reference.flush`` under the Triton interpreter, and the bit
packing helpers of ``kvarn_ops.kernels._common``.

What must hold, and why:

- bit packing, fp16 fields, padding: bit-exact (the kernel's records equal the reference
  writer's records built from the kernel's own decoded fields): packing and stores are exact.
- codes: >= 99.9% identical to the reference (CODE_AGREEMENT), the rest 1 LSB apart: same
  algorithm in the same order; only a float reduction order or an exp/log ulp flips a rounding.
  Where the clipping search's two best candidates of a row are within rounding of each
  other, the kernel may keep the other one and that row's codes move together (1 LSB each);
  so the bound applies to the codes outside the ROW_FLIPS rounding rows with the most
  differing codes (seen in CI: one 64-code V row at k3v5 g32, 22 codes of 16,384; and in a
  marked fp8-pool k2v4 tile one V row of 25 codes beside 5 single-code flips in three other
  rows, 30 of 24,576), and the decoded error check below still holds.
- fp16 scale fields: not compared bit for bit, the decoded tile is. Near convergence successive
  iterates have almost equal imbalance, so an ulp can pick a neighbouring iterate whose
  row/column split differs by a near-constant factor (codes and products unchanged).
- decoded tile: rms error vs the input <= 1.02 x the reference's (ERR_RATIO) + 1e-6 x max abs:
  same quantizer; a 1-LSB code flip moves the error by well under 2%.
- records not in dst_blocks: untouched (poison 0xAB kept).
- special tiles (a lone 1e4 element, constant rows and channels): error ratio 1.25 plus the
  rms change one fp16 ulp on every scale field can make: there the fields, not the codes,
  limit the decoded error, and the kernel's fp32 moments may round a field the other way.
- rounding="unbiased_clip" (K and V, or V only): the same checks against the reference under
  the same config; the candidate search needs no wider bound. Measured over 15 seeds (2 blocks,
  2 KV heads) of each of k4v2 g64 D128 bf16, k2v2 g64 D128 fp8, k3v5 g32 fp8 and k7v6 g32
  fp16: at most one code per 160k differed (1 LSB), no row chose another candidate (that
  would move a whole row of codes) and the decoded error was within 0.3% of the reference's.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from conftest import realistic_kv  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from kvarn_ops.kernels import _common, flush  # noqa: E402

CODE_AGREEMENT = 0.999
ROW_FLIPS = 1
ERR_RATIO = 1.02
POISON = 0xAB
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------- bit packing helpers


@triton.jit
def _pack_kernel(
    codes_ptr,
    out_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    _common.pack_codes_store(out_ptr, tl.load(codes_ptr + offs), R, C, BITS, L, NB, NBP)


@triton.jit
def _unpack_kernel(
    packed_ptr,
    out_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    BITS: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
):
    codes = _common.unpack_codes_load(packed_ptr, R, C, ROW_STRIDE, BITS, L, NB, NBP)
    tl.store(out_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], codes)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    r, c = codes.shape
    nbytes = r * c * bits // 8
    buf = torch.full((nbytes + 32,), POISON, dtype=torch.uint8)
    _pack_kernel[(1,)](
        codes.to(torch.int32).contiguous(), buf[16:], r, c, bits, *_common.pack_geometry(bits)
    )
    assert bool((buf[:16] == POISON).all()) and bool((buf[16 + nbytes :] == POISON).all())
    return buf[16 : 16 + nbytes]


@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_and_unpack_are_bit_exact(bits, gen):
    r, c = 4, 32
    codes = torch.randint(0, 1 << bits, (r, c), generator=gen, dtype=torch.int32)
    packed = _pack(codes, bits)
    expect = ref.pack_codes(codes.reshape(-1), bits)
    assert torch.equal(packed, expect)
    # Unpack a window of columns [8, 24) of every row (row stride C codes).
    out = torch.full((r, 16), -1, dtype=torch.int32)
    _unpack_kernel[(1,)](packed[8 * bits // 8 :], out, r, 16, c, bits, *_common.pack_geometry(bits))
    assert torch.equal(out, codes[:, 8:24])


@pytest.mark.parametrize(
    ("bits", "codes", "expect"),
    [
        (2, [0, 1, 2, 3, 0, 1, 2, 3], [228, 228]),
        (4, [0, 1, 2, 3, 4, 5, 6, 7], [16, 50, 84, 118]),
        (5, [0, 1, 2, 3, 4, 5, 6, 7], [32, 136, 65, 138, 57]),
    ],
)
def test_pack_published_vectors(bits, codes, expect):
    tile = torch.tensor([codes, codes], dtype=torch.int32)
    assert _pack(tile, bits).tolist() == expect + expect


# ---------------------------------------------------------------- flush vs reference


def _fill_pool(gen, p, g, hkv, d, dtype):
    """A pool whose every slot holds a realistic rotated token (written by reference.store)."""
    ek = torch.empty(p, g, hkv, d, dtype=dtype)
    ev = torch.empty_like(ek)
    ks = torch.empty(p, g, hkv) if dtype == FP8 else None
    vs = torch.empty(p, g, hkv) if dtype == FP8 else None
    k = realistic_kv(gen, p * g, hkv, d)
    v = realistic_kv(gen, p * g, hkv, d)
    ref.store(k, v, torch.arange(p * g), ek, ev, ks, vs)
    return ek, ev, ks, vs


def _fp16_ulp(f: torch.Tensor) -> torch.Tensor:
    """The fp16 spacing at each |f| (float64): the step above, or below at the largest finite."""
    a = f.abs()
    up = torch.nextafter(a, torch.full_like(a, float("inf")))
    down = torch.nextafter(a, torch.zeros_like(a))
    return torch.where(up.isfinite(), up.double() - a.double(), a.double() - down.double())


def _field_ulp_slack(fields: dict, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of the decoded (K, V) tiles, float64: the most that moving every fp16 scale
    and zero-point field by one of its ulps can change it (first order, summed over fields;
    the decode is bilinear, so the second-order rest is below 2**-10 of this)."""
    base = (ref.dequantize_k(fields, torch.float64), ref.dequantize_v(fields, torch.float64))
    slack = [torch.zeros_like(t) for t in base]
    for name, val in fields.items():
        if val.dtype != torch.float16:
            continue
        moved = dict(fields)
        moved[name] = (val.double() + _fp16_ulp(val)).to(torch.float64)
        dec = (ref.dequantize_k(moved, torch.float64), ref.dequantize_v(moved, torch.float64))
        for s, got, want in zip(slack, dec, base, strict=True):
            s += (got - want).abs()
    return slack[0] * (1 + 2.0**-10), slack[1] * (1 + 2.0**-10)


def _compare(packed, packed_ref, dst, layout, pool_tiles, err_ratio=ERR_RATIO, ulp_slack=False):
    """Checks of the table above for records ``dst``; returns (code agreement, byte-identical
    record fraction). ``ulp_slack``: the decoded error may also exceed ``err_ratio`` times the
    reference's by what one fp16 ulp on every scale field can move it (rms over the tile); for
    tiles whose weighted refit is ill-conditioned (see test_flush_special_tiles)."""
    r = layout.record_bytes
    written = torch.zeros(packed.shape[0], dtype=torch.bool)
    written[dst.long()] = True
    assert bool((packed[~written] == POISON).all()), "a record outside dst_blocks was written"
    recs = packed[dst.long()].reshape(-1, r)
    recs_ref = packed_ref[dst.long()].reshape(-1, r)
    fields = ref.record_fields(recs, layout)
    # Packing, fp16 stores and zero padding are exact: re-writing the kernel's fields with the
    # reference writer gives the kernel's bytes back.
    assert torch.equal(ref.fields_to_records(fields, layout), recs)
    fields_ref = ref.record_fields(recs_ref, layout)
    same = total = 0
    per_row = []
    for name in ("k_codes", "v_codes"):
        diff = (fields[name].int() - fields_ref[name].int()).abs()
        assert int(diff.max()) <= 1, f"{name}: codes differ by {int(diff.max())}"
        same += int((diff == 0).sum())
        total += diff.numel()
        per_row.append((diff > 0).sum(-1).flatten())  # rounding rows (K: channels, V: tokens)
    agreement = same / total
    flipped = int(torch.cat(per_row).sort(descending=True).values[:ROW_FLIPS].sum())
    assert (same + flipped) / total >= CODE_AGREEMENT, (
        f"code agreement {agreement:.5f}, {(same + flipped) / total:.5f} outside the "
        f"{ROW_FLIPS} row(s) with the most differing codes"
    )
    slacks = _field_ulp_slack(fields_ref, layout) if ulp_slack else (None, None)
    for got, want, x, slack in zip(
        ref.decode_records(recs, layout),
        ref.decode_records(recs_ref, layout),
        pool_tiles,
        slacks,
        strict=True,
    ):
        x = x.reshape(-1, layout.block_size, layout.head_dim)
        err = ((got - x) ** 2).mean(dim=(1, 2)).sqrt()
        err_ref = ((want - x) ** 2).mean(dim=(1, 2)).sqrt()
        amax = x.abs().amax(dim=(1, 2))
        bound = err_ratio * err_ref + 1e-6 * amax
        if slack is not None:
            bound = bound + (slack**2).mean(dim=(1, 2)).sqrt().float()
        assert bool((err <= bound).all()), (err / err_ref).tolist()
    identical = float((recs == recs_ref).all(dim=1).float().mean())
    return agreement, identical


CASES = [
    # (format, D, pool dtype, Hkv, N blocks flushed, P pool blocks, packed blocks)
    ("kvarn_k4v2_g32", 64, torch.bfloat16, 2, 2, 5, 7),
    ("kvarn_k3v5_g32", 64, FP8, 1, 2, 3, 4),
    ("kvarn_k7v6_g32", 64, torch.float16, 1, 2, 2, 3),
    ("kvarn_k4v2_g64", 128, torch.bfloat16, 1, 1, 2, 3),
    ("kvarn_k8v2_g32", 128, torch.float16, 1, 1, 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[2])[6:]}")
def test_flush_matches_reference(case, gen):
    fmt, d, pdt, hkv, n, p, nb = case
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    ek, ev, ks, vs = _fill_pool(gen, p, g, hkv, d, pdt)
    src = torch.randperm(p, generator=gen)[:n].to(torch.int32)
    dst = torch.randperm(nb, generator=gen)[:n].to(torch.int32)
    packed = torch.full((nb, hkv, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    flush(ek, ev, ks, vs, src, dst, packed, lay)
    ref.flush(ek, ev, ks, vs, src, dst, packed_ref, lay)
    tiles = [
        ref.read_pool_blocks(pool, sc, src).permute(0, 2, 1, 3) for pool, sc in ((ek, ks), (ev, vs))
    ]
    agreement, identical = _compare(packed, packed_ref, dst, lay, tiles)
    print(f"{fmt} d{d}: codes identical {agreement:.5f}, records byte-identical {identical:.3f}")


# ---------------------------------------------------------------- rounding modes

UNBIASED = ref.NormalizeConfig(rounding="unbiased_clip")
MIXED = ref.NormalizeConfig(rounding="rtn", rounding_v="unbiased_clip")
PATTERN = ref.NormalizeConfig(rounding="unbiased_clip", clip_search="pattern")
CONFIGS = {"unbiased": UNBIASED, "mixed": MIXED, "pattern": PATTERN}

ROUNDING_CASES = [
    # (config, format, D, pool dtype, Hkv, N blocks flushed, P pool blocks, packed blocks)
    ("unbiased", "kvarn_k4v2_g64", 128, torch.bfloat16, 2, 2, 3, 4),
    ("unbiased", "kvarn_k4v2_g64", 128, FP8, 1, 2, 2, 3),
    ("unbiased", "kvarn_k2v2_g64", 128, torch.bfloat16, 1, 2, 3, 3),
    ("unbiased", "kvarn_k2v2_g64", 128, FP8, 2, 2, 2, 4),
    ("unbiased", "kvarn_k3v5_g32", 64, FP8, 2, 2, 3, 4),
    ("unbiased", "kvarn_k7v6_g32", 64, torch.float16, 1, 2, 2, 3),
    ("mixed", "kvarn_k4v2_g64", 128, FP8, 2, 1, 2, 3),
    ("mixed", "kvarn_k2v2_g64", 128, torch.bfloat16, 2, 2, 3, 3),
    ("mixed", "kvarn_k3v5_g32", 64, torch.bfloat16, 2, 2, 2, 3),
    ("pattern", "kvarn_k2v2_g64", 128, torch.bfloat16, 2, 2, 3, 3),
    ("pattern", "kvarn_k2v4_g64", 64, FP8, 1, 2, 2, 4),
    ("pattern", "kvarn_k4v4_g64", 128, torch.bfloat16, 2, 2, 3, 3),
]


def _ref_records(ek, ev, ks, vs, src, lay, config):
    """Reference records ``[N, Hkv, R]`` of pool blocks ``src`` under ``config`` (what
    ``reference.flush`` writes, with the config made explicit), and the K and V tiles."""
    n, hkv = src.shape[0], ek.shape[2]
    g, d = lay.block_size, lay.head_dim
    kt, vt = (
        ref.read_pool_blocks(pool, sc, src).permute(0, 2, 1, 3) for pool, sc in ((ek, ks), (ev, vs))
    )
    rec = ref.encode_records(
        kt.reshape(n * hkv, g, d).contiguous(),
        vt.reshape(n * hkv, g, d).contiguous(),
        lay,
        config=config,
    )
    return rec.view(n, hkv, -1), [kt, vt]


@pytest.mark.parametrize(
    "case", ROUNDING_CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{str(c[3])[6:]}"
)
def test_flush_rounding_matches_reference(case, gen):
    """``config`` with unbiased_clip for K and V, or for V only: the kernel's records against
    the reference's under the same config, with the checks of the table above."""
    name, fmt, d, pdt, hkv, n, p, nb = case
    cfg = CONFIGS[name]
    lay = kf.dense_layout(fmt, d)
    ek, ev, ks, vs = _fill_pool(gen, p, lay.block_size, hkv, d, pdt)
    src = torch.randperm(p, generator=gen)[:n].to(torch.int32)
    dst = torch.randperm(nb, generator=gen)[:n].to(torch.int32)
    packed = torch.full((nb, hkv, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    flush(ek, ev, ks, vs, src, dst, packed, lay, config=cfg)
    rec, tiles = _ref_records(ek, ev, ks, vs, src, lay, cfg)
    packed_ref[dst.long()] = rec
    agreement, identical = _compare(packed, packed_ref, dst, lay, tiles)
    print(f"{name} {fmt} d{d}: codes identical {agreement:.5f}, records identical {identical:.3f}")


@pytest.mark.parametrize("search", ["window", "pattern"])
def test_flush_unbiased_clip_heavy_tails(search, gen):
    """Heavy-tailed 2-bit tiles (Gaussian times a log-normal factor per value), where every
    candidate wins somewhere: measured with the reference on 64 such tiles, min/max and each
    clip ratio (0.35 included) are kept for 0.9-12% of the rows of K and V tiles alike. On
    realistic tiles the extreme ratios almost never win (0.35: 1 row in 8192 K rows at 2 bits),
    so only here does a skipped, shifted or misvalued candidate show. Another candidate kept
    changes several codes of its row: measured over 12 seeds (9216 rows), the kernel had no such
    row (one single-code flip in all), while leaving out the 0.35 candidate gives about 2.7% of
    rows (some 20 per run), which the code agreement alone (0.9978) can miss; hence the bound
    of at most 2 such rows of the 768 here. The same for the pattern search (``search``), whose
    candidates depend on the row: a wrong step, offset or clamp moves whole rows too."""
    cfg = UNBIASED if search == "window" else PATTERN
    lay = kf.dense_layout("kvarn_k2v2_g64", 128)
    shape = (2, 64, 2, 128)
    ek, ev = (
        (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))).to(
            torch.bfloat16
        )
        for _ in range(2)
    )
    src = torch.tensor([1, 0], dtype=torch.int32)
    dst = torch.tensor([0, 2], dtype=torch.int32)
    packed = torch.full((3, 2, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    flush(ek, ev, None, None, src, dst, packed, lay, config=cfg)
    rec, tiles = _ref_records(ek, ev, None, None, src, lay, cfg)
    packed_ref[dst.long()] = rec
    agreement, _ = _compare(packed, packed_ref, dst, lay, tiles)
    fields, fields_ref = (
        ref.record_fields(p[dst.long()].reshape(4, -1), lay) for p in (packed, packed_ref)
    )
    multi = 0
    for name in ("k_codes", "v_codes"):
        per_row = (fields[name] != fields_ref[name]).sum(-1)
        multi += int((per_row > 1).sum())
    print(f"heavy tails: codes identical {agreement:.5f}, rows with several differences {multi}")
    assert multi <= 2, multi


def _code_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


def test_flush_rounding_is_applied_per_tile(gen):
    """Each of K and V follows its own rounding mode: the kernel's codes agree with the
    reference of the mode asked for and not with the other mode's, and unbiased_clip's decoded
    error is the reference's, below min/max RTN's (2-bit tiles, where the modes differ most;
    measured with the reference over 200 seeds of this geometry: the two modes share 75-82% of
    their codes, and unbiased_clip's rms error is 0.71-0.78x RTN's)."""
    lay = kf.dense_layout("kvarn_k2v2_g64", 128)
    hkv, n = 2, 2
    ek, ev, ks, vs = _fill_pool(gen, n, lay.block_size, hkv, 128, torch.bfloat16)
    src = torch.arange(n, dtype=torch.int32)
    configs = {
        ("rtn", "rtn"): ref.NormalizeConfig(rounding="rtn"),
        ("unbiased_clip", "unbiased_clip"): UNBIASED,
        ("rtn", "unbiased_clip"): MIXED,
        ("unbiased_clip", "rtn"): ref.NormalizeConfig(rounding="unbiased_clip", rounding_v="rtn"),
    }
    want = {}  # reference fields and decoded tiles per mode
    for mode in ("rtn", "unbiased_clip"):
        rec, tiles = _ref_records(ek, ev, ks, vs, src, lay, configs[(mode, mode)])
        rec = rec.reshape(n * hkv, -1)
        want[mode] = (ref.record_fields(rec, lay), ref.decode_records(rec, lay))
    x = [t.reshape(n * hkv, lay.block_size, 128) for t in tiles]

    def rms(a, b):
        return float(((a - b) ** 2).mean().sqrt())

    for (k_mode, v_mode), cfg in configs.items():
        packed = torch.full((n, hkv, lay.record_bytes), POISON, dtype=torch.uint8)
        flush(ek, ev, ks, vs, src, src, packed, lay, config=cfg)
        rec = packed.reshape(n * hkv, -1)
        fields = ref.record_fields(rec, lay)
        decoded = ref.decode_records(rec, lay)
        for i, (field, mode) in enumerate((("k_codes", k_mode), ("v_codes", v_mode))):
            other = "rtn" if mode == "unbiased_clip" else "unbiased_clip"
            same = _code_agreement(fields[field], want[mode][0][field])
            cross = _code_agreement(fields[field], want[other][0][field])
            assert same >= CODE_AGREEMENT, (k_mode, v_mode, field, same)
            assert cross < 0.9, (k_mode, v_mode, field, cross)
            err = rms(decoded[i], x[i])
            err_want = rms(want[mode][1][i], x[i])
            err_other = rms(want[other][1][i], x[i])
            assert abs(err - err_want) <= (ERR_RATIO - 1.0) * err_want, (field, err, err_want)
            if mode == "unbiased_clip":
                assert err < 0.85 * err_other, (field, err, err_other)
            else:
                assert err_other < 0.85 * err, (field, err, err_other)


def test_flush_passes_iters_and_std_floor_through(gen):
    """Non-default ``iters`` and ``std_floor`` reach the kernel (with unbiased_clip)."""
    cfg = ref.NormalizeConfig(iters=3, std_floor=0.05, rounding="unbiased_clip")
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    ek, ev, ks, vs = _fill_pool(gen, 2, 32, 2, 64, torch.float16)
    src = torch.tensor([1, 0], dtype=torch.int32)
    packed = torch.full((3, 2, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    dst = torch.tensor([2, 0], dtype=torch.int32)
    flush(ek, ev, ks, vs, src, dst, packed, lay, config=cfg)
    rec, tiles = _ref_records(ek, ev, ks, vs, src, lay, cfg)
    packed_ref[dst.long()] = rec
    _compare(packed, packed_ref, dst, lay, tiles)
    # The default iteration count gives other records.
    default = packed.clone()
    flush(ek, ev, ks, vs, src, dst, default, lay, config=UNBIASED)
    assert not torch.equal(default, packed)


UNSUPPORTED = {
    "rounding-mse_clip": ref.NormalizeConfig(rounding="mse_clip"),
    "rounding-rtn_refit": ref.NormalizeConfig(rounding="rtn_refit"),
    "rounding_v-mse_grid": ref.NormalizeConfig(rounding="unbiased_clip", rounding_v="mse_grid"),
    "no-prescale": ref.NormalizeConfig(prescale=False),
    "no-rebalance": ref.NormalizeConfig(rebalance_fp16=False, rounding="unbiased_clip"),
    "log-scale-clip": ref.NormalizeConfig(log_scale_clip=(-0.3, 10.0)),
    "published": ref.PUBLISHED_CONFIG,
}


@pytest.mark.parametrize("case", list(UNSUPPORTED), ids=list(UNSUPPORTED))
def test_flush_rejects_unsupported_config(case):
    args = _args()
    packed = args["packed"].clone()
    with pytest.raises(NotImplementedError, match="^config: "):
        flush(**args, config=UNSUPPORTED[case])
    assert torch.equal(args["packed"], packed)


def test_flush_rejects_a_config_of_the_wrong_type():
    with pytest.raises(ValueError, match="^config: "):
        flush(**_args(), config="unbiased_clip")


@pytest.mark.parametrize(
    ("k_rounding", "v_rounding", "error", "name"),
    [
        ("rtn", "mse_clip", NotImplementedError, "v_rounding"),
        ("nearest", "rtn", ValueError, "k_rounding"),
    ],
)
def test_flush_op_rejects_unknown_rounding(k_rounding, v_rounding, error, name):
    """The custom op takes the rounding modes as strings; unsupported ones are refused there
    too (for callers that bypass ``flush``)."""
    a = _args()
    with pytest.raises(error, match=f"^{name}: "):
        torch.ops.kvarn.flush(
            a["exact_k"],
            a["exact_v"],
            None,
            None,
            a["src_pool_blocks"],
            a["dst_blocks"],
            a["packed"],
            a["layout"].format_name,
            8,
            1e-3,
            k_rounding,
            v_rounding,
        )


EDGE_CONFIGS = {"default": ref.DEFAULT_CONFIG, "unbiased": UNBIASED}


@pytest.mark.parametrize("config", list(EDGE_CONFIGS))
def test_flush_special_tiles(config, gen):
    """Zero, constant, constant-row, outlier, tiny-scale and non-finite tiles (one per KV head)
    give the reference's codes and finite scale fields (zero-range rows keep min/max under
    unbiased_clip)."""
    cfg = EDGE_CONFIGS[config]
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    g, d, hkv = 32, 64, 6
    x = realistic_kv(gen, 1, g, hkv, d)
    x[..., 0, :] = 0.0  # all-zero tile
    x[..., 1, :] = 0.5  # constant tile
    x[0, :, 2, 5] = 3.0  # one constant channel
    x[0, 7, 2, :] = -1.25  # one constant token
    x[0, 3, 3, 9] = 1.0e4  # a single huge outlier
    x[..., 4, :] *= 1.0e-3  # a small tile (no clip: scaled like any other)
    x[0, 11, 5, 2] = float("nan")  # a non-finite token
    x[0, 20, 5, 0] = float("inf")
    ek = x.to(torch.float16)
    ev = x.flip(1).to(torch.float16)
    src = torch.zeros(1, dtype=torch.int32)
    packed = torch.full((1, hkv, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    flush(ek, ev, None, None, src, src, packed, lay, config=cfg)
    packed_ref[0] = _ref_records(ek, ev, None, None, src, lay, cfg)[0][0]
    fields = ref.record_fields(packed.reshape(hkv, -1), lay)
    for name, val in fields.items():
        if val.dtype == torch.float16:
            assert bool(val.isfinite().all()), name
    tiles = [ref.zero_nonfinite_tokens(t.float()).permute(0, 2, 1, 3) for t in (ek, ev)]
    # A tile with a constant channel and a constant token has many nearly tied iterates; the
    # kernel may keep another one than the reference (measured up to 1.15x the reference's
    # error over 12 seeds; 1.09x and 1.15x in the two seeds over 1.02x). In the outlier tile
    # one column carries almost all the error weight, so the unbiased refit's weighted moments
    # of the other columns cancel and the kernel's fp16 row fields may land one ulp from the
    # reference's; with row zero points in the thousands (normalized units) that ulp moves the
    # decoded error itself (seed 757067747: 7 of 32 V zero points one ulp apart, codes
    # identical, error 1.86x the reference's), hence the ulp slack.
    _compare(packed, packed_ref, src, lay, tiles, err_ratio=1.25, ulp_slack=True)


@pytest.mark.parametrize("config", list(EDGE_CONFIGS))
def test_flush_saturates_scales_beyond_fp16(config, gen):
    """Channels spanning 1e-12..1e12 do not fit fp16 on either side: fields saturate at
    +-65504 (never Inf), as the reference.

    Codes: identical, except under unbiased_clip in V rows where the heaviest channel dominates
    every candidate's error: candidates tie to the last ulp and a summation order picks one or
    the other (measured over 40 seeds: up to 37 of 2048 V codes, 1 LSB, mostly in channels of
    weight <= 2.3e-7; seed 2502968739: one code in a channel of weight 7.9e-4, its row's
    candidate differing, the row's error 1 + 1.9e-9 times the reference's). So differing V
    codes are 1 LSB apart and every row's decoded error (fp64, the tile's own frame, where the
    column weights are implicit) is the reference's to a relative 1e-6: ties only. That holds
    where the V scale fields equal the reference's; with the default's 2 iterations the V
    normalization of this tile has not converged either, and in 14 of 300 seeds its scales
    differ (as K's below): then codes move by up to 3 LSB in channels of negligible weight and
    each row's decoded error stays within 1 + 1e-4 of the reference's (measured at most 1 +
    1.0e-5; the tile's mean relative error within 1 + 2e-7).

    K codes: after 8 normalization iterations identical but for ties (seed 32: one code of
    2048; none in 59 other seeds), so at most 10 may differ. After the default's 4 the
    normalization of a tile spanning 24 decades has not converged, and its log scales depend
    on fp32 rounding: the reference's own differ from the same algorithm evaluated in fp64 by
    up to 0.11 (seeds 9, 23, 32 of this tile; 2e-5 after 8 iterations), so the kernel's other
    summation order may give other scales and codes (6 of 120 seeds, up to 471 of 2048 K
    codes). Where codes differ, the K error (mean over channels of the relative RMS error,
    fp64) must stay within 1.05x the reference's (measured 0.947-1.015x over those 120 seeds,
    0.98-1.005x at 8 iterations)."""
    cfg = EDGE_CONFIGS[config]
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    spread = torch.logspace(-12, 12, 64)
    x = torch.randn(1, 32, 1, 64, generator=gen) * spread
    ek = x.to(torch.bfloat16)
    src = torch.zeros(1, dtype=torch.int32)
    packed = torch.full((1, 1, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    flush(ek, ek.clone(), None, None, src, src, packed, lay, config=cfg)
    packed_ref[0] = _ref_records(ek, ek.clone(), None, None, src, lay, cfg)[0][0]
    fields = ref.record_fields(packed.reshape(1, -1), lay)
    fields_ref = ref.record_fields(packed_ref.reshape(1, -1), lay)
    for name, val in fields.items():
        if val.dtype == torch.float16:
            assert bool(val.isfinite().all()), name
            assert bool((val.abs() == 65504).any() == (fields_ref[name].abs() == 65504).any())
    k_moved = int((fields["k_codes"] != fields_ref["k_codes"]).sum())
    if cfg.iters >= 8:
        assert k_moved <= 10, k_moved
    if k_moved:
        xk = ek.double().reshape(1, 32, 64)
        rms = xk.pow(2).mean(1).sqrt()

        def k_error(f):
            return ((ref.dequantize_k(f, torch.float64) - xk).pow(2).mean(1).sqrt() / rms).mean()

        assert float(k_error(fields)) <= 1.05 * float(k_error(fields_ref))
    if cfg.rounding == "rtn":
        assert torch.equal(fields["v_codes"], fields_ref["v_codes"])
        return
    diff = (fields["v_codes"].int() - fields_ref["v_codes"].int()).abs()  # [1, G, D]
    x = ek.double().reshape(1, 32, 64)
    sse = ((ref.dequantize_v(fields, torch.float64) - x) ** 2).sum(-1)
    sse_ref = ((ref.dequantize_v(fields_ref, torch.float64) - x) ** 2).sum(-1)
    same_scales = all(torch.equal(fields[f], fields_ref[f]) for f in ("v_col_scale", "v_row_scale"))
    if same_scales:  # ties only
        assert int(diff.max()) <= 1
        assert bool((sse <= sse_ref * (1 + 1e-6)).all()), (sse / sse_ref).max().item()
    else:  # the unconverged normalization's scales, as K's above
        assert bool((sse <= sse_ref * (1 + 1e-4)).all()), (sse / sse_ref).max().item()


def test_flush_empty_is_a_no_op():
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    ek = torch.zeros(1, 32, 1, 64, dtype=torch.float16)
    packed = torch.full((1, 1, lay.record_bytes), POISON, dtype=torch.uint8)
    empty = torch.zeros(0, dtype=torch.int32)
    flush(ek, ek.clone(), None, None, empty, empty, packed, lay)
    assert bool((packed == POISON).all())


def test_flush_is_a_registered_custom_op():
    assert hasattr(torch.ops.kvarn, "flush")


def _args(**over):
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    args = dict(
        exact_k=torch.zeros(3, 32, 2, 64, dtype=torch.float16),
        exact_v=torch.zeros(3, 32, 2, 64, dtype=torch.float16),
        k_scale=None,
        v_scale=None,
        src_pool_blocks=torch.tensor([0, 2], dtype=torch.int32),
        dst_blocks=torch.tensor([1, 0], dtype=torch.int32),
        packed=torch.zeros(2, 2, lay.record_bytes, dtype=torch.uint8),
        layout=lay,
    )
    args.update(over)
    return args


BAD = {
    "src-range": ("src_pool_blocks", dict(src_pool_blocks=torch.tensor([0, 3], dtype=torch.int32))),
    "src-dtype": ("src_pool_blocks", dict(src_pool_blocks=torch.tensor([0, 1]))),
    "dst-range": ("dst_blocks", dict(dst_blocks=torch.tensor([-1, 0], dtype=torch.int32))),
    "dst-shape": ("dst_blocks", dict(dst_blocks=torch.tensor([0], dtype=torch.int32))),
    "packed-dtype": ("packed", dict(packed=torch.zeros(2, 2, 7296, dtype=torch.int8))),
    "packed-record": ("packed", dict(packed=torch.zeros(2, 2, 100, dtype=torch.uint8))),
    "packed-contiguity": (
        "packed",
        dict(
            packed=torch.zeros(
                2, 2, 2 * kf.dense_layout("kvarn_k4v2_g32", 64).record_bytes, dtype=torch.uint8
            )[..., ::2]
        ),
    ),
    "layout-mla": ("layout", dict(layout=kf.mla_layout("kvarn_mla_k4_g64"))),
    "layout-not-a-layout": ("layout", dict(layout="kvarn_k4v2_g32")),
    "layout-group": ("exact_k", dict(layout=kf.dense_layout("kvarn_k4v2_g64", 64))),
    "layout-head-dim": ("exact_k", dict(layout=kf.dense_layout("kvarn_k4v2_g32", 128))),
    "pool-dtype": ("exact_k", dict(exact_k=torch.zeros(3, 32, 2, 64))),
    "fp8-scale": (
        "k_scale",
        dict(
            exact_k=torch.zeros(3, 32, 2, 64, dtype=FP8),
            exact_v=torch.zeros(3, 32, 2, 64, dtype=FP8),
        ),
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_flush_rejects_bad_input(case):
    name, over = BAD[case]
    with pytest.raises(ValueError, match=f"^{name}"):
        flush(**_args(**over))


# ---------------------------------------------------------------- a decode step's flush


FLUSH_MOD = importlib.import_module("kvarn_ops.kernels.flush")
RTN = ref.NormalizeConfig(rounding="rtn")

SPLIT_CASES = [
    # (programs per tile, config, format, D, pool dtype, Hkv, N, P pool blocks, packed blocks)
    (2, UNBIASED, "kvarn_k4v2_g64", 128, torch.bfloat16, 1, 2, 3, 4),
    (8, UNBIASED, "kvarn_k2v2_g64", 128, FP8, 1, 1, 2, 3),
    (4, MIXED, "kvarn_k3v5_g32", 64, torch.bfloat16, 2, 1, 2, 3),
    (4, RTN, "kvarn_k8v2_g32", 128, torch.float16, 1, 2, 2, 3),
]


@pytest.fixture
def force_parts():
    def force(parts):
        FLUSH_MOD.FORCE_PARTS = parts

    yield force
    FLUSH_MOD.FORCE_PARTS = None


@pytest.mark.parametrize(
    "case",
    SPLIT_CASES,
    ids=lambda c: f"p{c[0]}-{c[1].rounding}-{c[1].rounding_v}-{c[2]}-{str(c[4])[6:]}",
)
def test_flush_split_tiles(case, gen, force_parts):
    """Tiles split over several programs (each rounds and packs its rows, the last one stores
    every scale field): against the reference with the checks above, and byte for byte
    against one program per tile (the interpreter's reductions of a row do not depend on how
    many rows the tensor holds)."""
    parts, cfg, fmt, d, pdt, hkv, n, p, nb = case
    lay = kf.dense_layout(fmt, d)
    ek, ev, ks, vs = _fill_pool(gen, p, lay.block_size, hkv, d, pdt)
    src = torch.randperm(p, generator=gen)[:n].to(torch.int32)
    dst = torch.randperm(nb, generator=gen)[:n].to(torch.int32)
    packed = torch.full((nb, hkv, lay.record_bytes), POISON, dtype=torch.uint8)
    single = packed.clone()
    force_parts(parts)
    flush(ek, ev, ks, vs, src, dst, packed, lay, config=cfg)
    force_parts(1)
    flush(ek, ev, ks, vs, src, dst, single, lay, config=cfg)
    assert torch.equal(packed, single)
    packed_ref = torch.full_like(packed, POISON)
    rec, tiles = _ref_records(ek, ev, ks, vs, src, lay, cfg)
    packed_ref[dst.long()] = rec
    _compare(packed, packed_ref, dst, lay, tiles)


def test_flush_split_special_tiles(gen, force_parts):
    """The special tiles of test_flush_special_tiles (zero, constant, outlier, tiny,
    non-finite; fields at the ends of fp16) split over 4 programs: the bytes of one program
    per tile."""
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    x = realistic_kv(gen, 1, 32, 4, 64)
    x[..., 0, :] = 0.0
    x[0, :, 1, 5] = 3.0
    x[0, 3, 2, 9] = 1.0e4
    x[0, 11, 3, 2] = float("nan")
    x[..., 3, :] *= torch.logspace(-12, 12, 64)
    ek, ev = x.to(torch.float16), x.flip(1).to(torch.bfloat16).to(torch.float16)
    src = torch.zeros(1, dtype=torch.int32)
    out = []
    for parts in (4, 1):
        force_parts(parts)
        packed = torch.full((1, 4, lay.record_bytes), POISON, dtype=torch.uint8)
        flush(ek, ev, None, None, src, src, packed, lay)
        out.append(packed)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize(
    ("tiles", "group", "head_dim", "sms", "parts"),
    [
        (16, 64, 128, 132, 8),  # one block, Hkv 8, H200: 128 programs
        (32, 64, 128, 132, 4),
        (64, 64, 128, 132, 2),
        (128, 64, 128, 132, 1),  # the tiles fill the SMs
        (16, 32, 64, 132, 4),  # 32-token blocks: at least 8 rows per program
        (4, 128, 512, 132, 16),
        (16, 64, 128, 8, 1),
    ],
)
def test_parts_for(tiles, group, head_dim, sms, parts):
    assert FLUSH_MOD.parts_for(tiles, group, head_dim, sms) == parts


@pytest.mark.parametrize(
    ("head_dim", "group", "parts", "warps"),
    [
        (128, 64, 1, 4),  # bulk: two 4-warp programs per SM beat one 8-warp one
        (128, 64, 4, 4),
        (128, 64, 8, 8),  # a step's one block: every program normalizes the whole tile
        (64, 64, 8, 8),
        (256, 64, 1, 8),
        (256, 64, 8, 8),
        (512, 64, 8, 16),
    ],
)
def test_warps_for(head_dim, group, parts, warps):
    assert FLUSH_MOD.warps_for(head_dim, group, parts) == warps
