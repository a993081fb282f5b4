"""MLA ops: every Triton kernel against ``kvarn_ops.reference.mla`` under the interpreter, on
fresh random inputs (seed printed by the ``seed`` fixture), poisoned outputs, bad inputs.

Tolerance table (kernel vs reference):

- stage_fp8: nothing. Bound: byte-exact (same fp32 dequant (code*scale is exact), RNE
  bf16/e4m3).
- rehydrate: nothing. Bound: byte-exact (same dequant and pool rounding, no reduction in the
  value).
- pack codes: flips where exp/log/sum order moves a value across a rounding boundary. Bound: <
  0.5% of codes, by 1 (measured: 0 in most runs).
- pack scales: the best iterate can change where two iterates' imbalances tie to float noise;
  near convergence they differ by a factor traded between channel and token scales. Bound:
  dequant within 2% of the tile rms (the product is what decodes).
- scatter bf16: the Hadamard sums run in another order (last fp32 bit). Bound: 1 bf16 ulp (a
  flip of the bf16 rounding).
- scatter fp8: amax (hence the scale) by a few fp32 ulps, which can flip the e4m3 rounding of a
  value near a tie. Bound: scale rel 1e-6, dequant within 1 e4m3 step (2^-3 relative for
  normals, 2^-9 of the scale for subnormals).
- materialize: the rotation back runs as two small products, summed in another order than
  the reference's transform. Bound: 1 bf16 ulp (rounding of the bf16 output) + 4 fp32
  epsilons of the row's largest magnitude (the order of the fp32 sums; gpu_parity allows 8).
  Measured over 41 seeds x 2 pools: at most 0.75 epsilon beyond the bf16 ulp. The former
  1e-6 * rms was exceeded once in those 82 runs (4.05e-6 against 3.7e-6, at an output of
  -2.0e-5 in a row of rms 3.7; seed 1722413089, fp8 pool).
- decode, sparse path: fp32 dots and online softmax vs the fp64 oracle. Bound: 2e-4 * max
  abs(out) (interpreter fp32) (GPU tf32 needs more; gpu_parity).
- decode, full context: packed blocks feed the dots 16-bit operands (q times the channel
  scales, the softmax weights times the row scales; codes exact). Yardstick:
  ``fp16_operand_decode`` below, the oracle with exactly those two roundings (fp64
  otherwise). Kernel vs yardstick: 2e-4 * max abs(out), the fp32 allowance above (plus an
  isolated fp16 rounding flip, ``assert_near_yardstick``). Kernel vs oracle: the yardstick's
  own error on the same input plus that allowance; the yardstick itself must stay within
  8 * 2**-10 * max abs(out) of the oracle, a guard on the operand design (measured over 900
  seeds of ``test_decode_blocks_per_split``'s geometry, k2-k5, bf16/fp8 pools: mean 7e-4,
  p99 2.5e-3, max 3.3e-3 = 3.4 * 2**-10; a fixed 2 * 2**-10 was exceeded by the yardstick on
  1-5% of seeds; bf16 operands would be 8x).
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from kvarn_ops.kernels import mla_decode as kdec  # noqa: E402
from kvarn_ops.kernels import mla_gather as kgat  # noqa: E402
from kvarn_ops.kernels import mla_pack as kpack  # noqa: E402
from kvarn_ops.kernels import mla_scatter as kscat  # noqa: E402
from kvarn_ops.reference import mla as ref  # noqa: E402
from kvarn_ops.reference.hadamard import hadamard  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def realistic_latent(gen, n: int) -> torch.Tensor:
    """Latent-like rows ``[n, 512]`` (model frame): low-rank structure plus noise, log-normal
    channel scales, a few outlier channels, varying token norms."""
    basis = torch.randn(16, 512, generator=gen)
    x = torch.randn(n, 16, generator=gen) @ basis * 0.5 + torch.randn(n, 512, generator=gen)
    x = x * torch.exp(0.6 * torch.randn(512, generator=gen))
    out_ch = torch.randint(0, 512, (4,), generator=gen)
    x[:, out_ch] *= 8.0
    return x * torch.exp(0.3 * torch.randn(n, 1, generator=gen))


def make_pool(p: int, dtype, poison: bool = True):
    lat = torch.full((p, 64, 512), 3.0).to(dtype)
    rope = torch.full((p, 64, 64), float("nan"), dtype=BF16)
    scale = torch.full((p, 64), float("nan")) if dtype == FP8 else None
    return lat, scale, rope


def pool_bits(pool):
    lat, scale, rope = pool
    return (lat.view(torch.uint8), None if scale is None else scale.clone(), rope.view(torch.int16))


def filled_pool(gen, p: int, dtype):
    pool = make_pool(p, dtype)
    lat = realistic_latent(gen, p * 64)
    ref.mla_exact_scatter(
        lat, torch.randn(p * 64, 64, generator=gen), torch.arange(p * 64), pool[0], pool[2], pool[1]
    )
    return pool, lat


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


# ------------------------------------------------------------------------------------- scatter


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_scatter_matches_reference(gen, dtype):
    t, p = 37, 2
    lat = realistic_latent(gen, t).to(torch.float32)
    rope = torch.randn(t, 64, generator=gen)
    slots = torch.randperm(p * 64, generator=gen)[:t]
    slots[[3, 20]] = -1
    a, b = make_pool(p, dtype), make_pool(p, dtype)
    ref.mla_exact_scatter(lat, rope, slots, a[0], a[2], a[1])
    kscat.mla_exact_scatter(lat, rope, slots, b[0], b[2], b[1])
    written = torch.zeros(p * 64, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    # rows without a slot stay poisoned (3.0 latent, NaN rope) in both
    assert torch.equal(
        a[2].view(-1, 64)[~written].view(torch.int16), b[2].view(-1, 64)[~written].view(torch.int16)
    )
    assert torch.equal(a[2], b[2]) or torch.equal(
        a[2][~torch.isnan(a[2])], b[2][~torch.isnan(b[2])]
    )
    va = a[0].view(-1, 512)[written].float()
    vb = b[0].view(-1, 512)[written].float()
    if dtype == BF16:
        # 1 bf16 ulp, plus 8 fp32 epsilons of the row's largest magnitude for results near zero
        # (their fp32 sums carry the rounding error of the largest terms).
        ulp = va.abs().clamp_min(1e-30) * 2.0**-7
        near0 = 8 * torch.finfo(torch.float32).eps * va.abs().amax(dim=-1, keepdim=True)
        assert bool(((va - vb).abs() <= ulp + near0).all())
    else:
        sa, sb = a[1].view(-1)[written], b[1].view(-1)[written]
        assert bool(((sa - sb).abs() <= 1e-6 * sa).all())
        da, db = va * sa[:, None], vb * sb[:, None]
        # One e4m3 step: 2^-3 relative for normals, 2^-9 * scale absolute for subnormals.
        step = torch.maximum(da.abs() * 2.0**-3, sa[:, None] * 2.0**-9)
        assert bool(((da - db).abs() <= step * 1.01).all())
    assert bool(torch.isfinite(b[2].view(-1, 64)[written].float()).all())


# ------------------------------------------------------------------------------- pack/rehydrate


def _check_pack(a, b, dst, layout, flip_tiles=()):
    """Records ``b`` (kernel) against ``a`` (reference) at blocks ``dst``: RoPE bit-exact,
    codes at most 1 apart; < 0.5% differing and decoded latents within 2% of the tile rms plus
    one step where a code differs, except in the tiles at ``flip_tiles`` (the caller checks
    their accuracy)."""
    fa = ref.record_tensors(a[dst.long()], layout)
    fb = ref.record_tensors(b[dst.long()], layout)
    assert torch.equal(fa["rope"].view(torch.int16), fb["rope"].view(torch.int16))
    code_diff = (fa["codes"].int() - fb["codes"].int()).abs()
    assert int(code_diff.max()) <= 1
    strict = [i for i in range(len(dst)) if i not in flip_tiles]
    assert float((code_diff[strict] > 0).float().mean()) < 5e-3
    la, _ = ref.decode_mla_records(a[dst.long()], layout)
    lb, _ = ref.decode_mla_records(b[dst.long()], layout)
    rms = la.pow(2).mean(dim=(1, 2)).sqrt()[:, None, None]
    # Where a code differs (allowed above), the value differs by one step of its channel:
    # |col_scale[d] * row_scale[t]| (latent [t, d]); at 2 bits that is far above 2% of the rms.
    lsb = (fa["col_scale"].float()[:, None, :] * fa["row_scale"].float()[:, :, None]).abs()
    allowed = 0.02 * rms + code_diff.transpose(1, 2).float() * lsb * 1.01
    assert bool(((la - lb).abs() <= allowed)[strict].all())


@pytest.mark.parametrize("bits,dtype", [(5, BF16), (2, FP8), (3, BF16)])
def test_pack_matches_reference(gen, bits, dtype):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 3, dtype)
    src, dst = i32(2, 0), i32(1, 3)
    a = torch.full((4, layout.record_bytes), 0xEE, dtype=torch.uint8)
    b = a.clone()
    ref.mla_pack(pool[0], pool[1], pool[2], src, dst, a, layout)
    kpack.mla_pack(pool[0], pool[1], pool[2], src, dst, b, layout)
    assert bool((b[[0, 2]] == 0xEE).all()), "pack wrote outside dst_blocks"
    _check_pack(a, b, dst, layout)


SPLIT = importlib.import_module("kvarn_ops.kernels.mla_pack_split")


@pytest.fixture
def force_parts():
    def force(parts):
        SPLIT.FORCE_PARTS = parts

    yield force
    SPLIT.FORCE_PARTS = None


@pytest.mark.parametrize("bits,dtype,parts", [(4, BF16, 16), (2, FP8, 4), (5, BF16, 8)])
def test_pack_split_matches_reference(gen, force_parts, bits, dtype, parts):
    """A decode step's pack: each tile's channels split over ``parts`` programs (the tokens'
    statistics exchanged, the last program storing the scale fields), with a non-finite token,
    tokens whose mean over the channels dwarfs their spread (bf16: the slices' variances are
    combined around very different means) and an all-zero block among the tiles: against the
    reference and against one program per tile."""
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 4, dtype)
    if dtype == FP8:
        pool[1][0, 17] = float("inf")  # a token's scale: the whole token is non-finite
    else:
        pool[0][0, 17, 300] = float("nan")  # one channel: another part than channel 0's
        pool[0][2, :8] += 200.0  # 8 tokens: mean 200, spread a few units
    pool[0][3] = 0.0  # an all-zero tile
    src, dst = i32(0, 2, 3), i32(1, 4, 0)
    a = torch.full((5, layout.record_bytes), 0xEE, dtype=torch.uint8)
    b, single = a.clone(), a.clone()
    ref.mla_pack(pool[0], pool[1], pool[2], src, dst, a, layout)
    force_parts(parts)
    kpack.mla_pack(pool[0], pool[1], pool[2], src, dst, b, layout)
    force_parts(1)
    kpack.mla_pack(pool[0], pool[1], pool[2], src, dst, single, layout)
    assert bool((b[[2, 3]] == 0xEE).all()), "pack wrote outside dst_blocks"
    # the bf16 tile of tokens at mean 200 (tile 1): the split's combined token statistics
    # differ from one program's in the last fp32 bits, which can tip the normalization to
    # another iterate and flip a few % of its codes (seen at 5 bits, seed 2194960350: 2.9%,
    # with the same error); there the split must be as accurate instead
    flip = (1,) if dtype == BF16 else ()
    _check_pack(a, b, dst, layout, flip)
    _check_pack(single, b, dst, layout, flip)
    if flip:
        x = pool[0][2].float()  # the tile's source latents [64 tokens, 512]
        err = [
            float((ref.decode_mla_records(r[4:5], layout)[0][0].float() - x).pow(2).mean().sqrt())
            for r in (single, b)
        ]
        assert err[1] <= 1.02 * err[0], f"split pack error {err[1]:.4g} vs {err[0]:.4g}"


@pytest.mark.parametrize(
    ("tiles", "sms", "parts"),
    [(1, 132, 32), (4, 132, 32), (5, 132, 16), (8, 132, 16), (9, 132, 8), (33, 132, 4)]
    + [(34, 132, 1), (1, 8, 8), (3, 8, 1)],
)
def test_pack_split_parts_for(tiles, sms, parts):
    assert SPLIT.parts_for(tiles, sms) == parts


@pytest.mark.parametrize("bits,dtype", [(4, BF16), (5, FP8)])
def test_rehydrate_exact_and_round_trip(gen, bits, dtype):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 2, dtype)
    packed = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    ref.mla_pack(pool[0], pool[1], pool[2], i32(0, 1), i32(2, 0), packed, layout)
    a, b = make_pool(2, dtype), make_pool(2, dtype)
    ref.mla_rehydrate(packed, i32(2, 0), i32(1, 0), a[0], a[1], a[2], layout)
    kpack.mla_rehydrate(packed, i32(2, 0), i32(1, 0), b[0], b[1], b[2], layout)
    for x, y in zip(pool_bits(a), pool_bits(b), strict=True):
        if x is not None:
            assert torch.equal(x, y), "rehydrate is not byte-exact"
    # round trip: pack(rehydrate(pack(x))) against pack(x)
    packed2 = torch.zeros_like(packed)
    kpack.mla_pack(b[0], b[1], b[2], i32(1, 0), i32(2, 0), packed2, layout)
    f1 = ref.record_tensors(packed[[2, 0]], layout)
    f2 = ref.record_tensors(packed2[[2, 0]], layout)
    assert torch.equal(f1["rope"].view(torch.int16), f2["rope"].view(torch.int16))
    l1, _ = ref.decode_mla_records(packed[[2, 0]], layout)
    l2, _ = ref.decode_mla_records(packed2[[2, 0]], layout)
    x = ref.read_pool_latent(pool[0], pool[1], i32(0, 1))
    q_err = (l1 - x).pow(2).mean().sqrt()
    drift = (l2 - l1).pow(2).mean().sqrt()
    changed = float((f1["codes"] != f2["codes"]).float().mean())
    print(
        f"round trip k{bits} {dtype}: codes changed {changed:.4f}, drift/quant error "
        f"{float(drift / q_err):.3f}"
    )
    # Documented bound (docs/contracts.md): the second pack moves the tile by at most 0.5x its
    # first quantization error (bf16 pool) / 0.9x (fp8 pool: e4m3 re-rounding adds error).
    assert float(drift / q_err) <= (0.5 if dtype == BF16 else 0.9)


def test_recycled_pool_slot_reads_own_values(gen):
    """The port's prefix-hit defect, at op level: block A's pool slot is recycled by block B;
    A later re-enters the pool in that slot through rehydrate and must read its own values."""
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pool, lat = filled_pool(gen, 2, BF16)
    packed = torch.zeros(2, layout.record_bytes, dtype=torch.uint8)
    kpack.mla_pack(pool[0], pool[1], pool[2], i32(0), i32(0), packed, layout)  # block A -> rec 0
    # the slot is recycled: block B's rows overwrite pool block 0
    kscat.mla_exact_scatter(
        realistic_latent(gen, 64),
        torch.randn(64, 64, generator=gen),
        torch.arange(64),
        pool[0],
        pool[2],
        pool[1],
    )
    kpack.mla_rehydrate(packed, i32(0), i32(0), pool[0], pool[1], pool[2], layout)
    bmap_pool, bmap_rec = i32(0, -1), i32(-1, -1)
    slots = torch.arange(64, dtype=torch.int64)
    from_pool = torch.empty(64, 576, dtype=BF16)
    from_rec = torch.empty(64, 576, dtype=BF16)
    kgat.mla_materialize(packed, bmap_pool, pool[0], pool[1], pool[2], slots, layout, from_pool)
    kgat.mla_materialize(packed, bmap_rec, pool[0], pool[1], pool[2], slots, layout, from_rec)
    own = lat[:64]
    err_pool = (from_pool[:, :512].float() - own).pow(2).mean().sqrt()
    err_rec = (from_rec[:, :512].float() - own).pow(2).mean().sqrt()
    assert float(err_pool) <= 1.05 * float(err_rec) + 1e-3 * float(own.pow(2).mean().sqrt())
    assert float(err_pool) < 0.2 * float(own.pow(2).mean().sqrt())


# ----------------------------------------------------------------------------- gather / stage


def gather_setup(gen, dtype, bits=5):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 3, dtype)
    packed = torch.zeros(5, layout.record_bytes, dtype=torch.uint8)
    ref.mla_pack(pool[0], pool[1], pool[2], i32(0, 1, 2), i32(0, 3, 4), packed, layout)
    bmap = i32(-1, 2, -1, -1, 1)  # blocks 1, 4 live in the pool
    n = 29
    slots = torch.randint(0, 5 * 64, (n,), generator=gen)
    slots[[2, 17]] = -1
    return layout, pool, packed, bmap, slots


@pytest.mark.parametrize("dtype,bits", [(BF16, 5), (FP8, 2), (BF16, 7)])
def test_stage_fp8_byte_exact(gen, dtype, bits):
    layout, pool, packed, bmap, slots = gather_setup(gen, dtype, bits)
    a = torch.full((slots.shape[0], 656), 0xA5, dtype=torch.uint8)
    b = a.clone()
    ref.mla_stage_fp8(packed, bmap, pool[0], pool[1], pool[2], slots, layout, a)
    kgat.mla_stage_fp8(packed, bmap, pool[0], pool[1], pool[2], slots, layout, b)
    assert torch.equal(a, b)
    assert bool((b[[2, 17]] == 0xA5).all()), "an invalid slot's row must stay untouched"
    assert not bool((b[slots >= 0] == 0xA5).all(dim=1).any())


def test_stage_zero_token_scale_is_one():
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pool = make_pool(1, BF16)
    pool[0].zero_()
    pool[2].zero_()
    packed = torch.zeros(1, layout.record_bytes, dtype=torch.uint8)
    out = torch.full((2, 656), 0xA5, dtype=torch.uint8)
    kgat.mla_stage_fp8(packed, i32(0), pool[0], pool[1], pool[2], torch.tensor([0, 5]), layout, out)
    assert torch.equal(out[:, 512:528].contiguous().view(torch.float32), torch.ones(2, 4))
    assert bool((out[:, :512] == 0).all()) and bool((out[:, 528:] == 0).all())


def check_materialize(layout, pool, packed, bmap, slots):
    """Kernel vs reference materialize into NaN-poisoned rows: invalid slots untouched, RoPE
    bit-exact, the rotated latent within one bf16 ulp plus 4 fp32 epsilons of the row's
    largest magnitude (the order of the fp32 sums, which matters near zero)."""
    a = torch.full((slots.shape[0], 576), float("nan"), dtype=BF16)
    b = a.clone()
    ref.mla_materialize(packed, bmap, pool[0], pool[1], pool[2], slots, layout, a)
    kgat.mla_materialize(packed, bmap, pool[0], pool[1], pool[2], slots, layout, b)
    ok = slots >= 0
    assert bool(b[~ok].isnan().all())
    assert not bool(b[ok].isnan().any())
    assert torch.equal(a[ok, 512:].view(torch.int16), b[ok, 512:].view(torch.int16))
    x, y = a[ok, :512].float(), b[ok, :512].float()
    row_max = x.abs().amax(dim=1, keepdim=True)
    assert bool(((x - y).abs() <= x.abs() * 2.0**-7 + 4 * 2.0**-23 * row_max).all())


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_materialize_matches_reference(gen, dtype):
    layout, pool, packed, bmap, slots = gather_setup(gen, dtype)
    check_materialize(layout, pool, packed, bmap, slots)


def test_remap_indices(gen):
    bt = torch.randint(0, 50, (3, 6), generator=gen, dtype=torch.int32)
    idx = torch.randint(-1, 6 * 64, (5, 11), generator=gen, dtype=torch.int32)
    req = i32(0, 2, 1, 1, 0)
    a = torch.full((5, 11), 12345, dtype=torch.int64)
    b = a.clone()
    ref.mla_remap_indices(idx, req, bt, a)
    kgat.mla_remap_indices(idx, req, bt, b)
    assert torch.equal(a, b)
    j = int((idx[1] >= 0).nonzero()[0])
    v = int(idx[1, j])
    assert int(b[1, j]) == int(bt[2, v // 64]) * 64 + v % 64


# ----------------------------------------------------------------------------------- decode


def fp16_operand_decode(q, packed, bt, seq, bmap, pool, layout, scale):
    """Full-context decode with the Triton kernel's 16-bit operands, fp64 otherwise
    (``[B, H, 512]`` fp64, model frame). Per packed block (x[d, t] = (code * cs[d] + zp[d]) *
    rs[t], centered codes c = code - 2^(b-1), zpc = zp + 2^(b-1) * cs):
    ``score = rs * (cmax * (fp16x2(q * cs / cmax) @ c) + q @ zpc) + q_rope @ rope`` (cmax =
    max |cs|), and with the block's max score m_b and largest row scale rmax, ``pw =
    fp16(exp(score - m_b) * rs / rmax)`` enters ``out += exp(m_b - M) * rmax * (cs * (pw @ c^T)
    + zpc * sum(pw))``, ``l += exp(m_b - M) * sum(exp(score - m_b))``. Pool blocks: exact."""

    def f16(x):
        return x.to(torch.float16).to(torch.float64)

    def f16x2(x):  # two fp16 parts, as the kernel feeds q * cs / cmax
        hi = f16(x)
        return hi + f16(x - hi)

    f = ref.record_tensors(packed, layout)
    center = 2 ** (layout.field("codes").bits - 1)
    q_rot = hadamard(q[..., :512].to(torch.float64))
    q_rope = q[..., 512:].to(torch.float64)
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for r in range(q.shape[0]):
        n = int(seq[r])
        parts = []  # (scores [H, v], kind, data)
        for i in range(-(-n // 64)):
            blk, v = int(bt[r, i]), min(64, n - 64 * i)
            qr, qe = q_rot[r], q_rope[r]
            if int(bmap[blk]) >= 0:
                lat = ref.read_pool_latent(pool[0], pool[1], bmap[blk : blk + 1])[0, :v]
                lat = lat.to(torch.float64)
                rope = pool[2][int(bmap[blk]), :v].to(torch.float64)
                parts.append(((qr @ lat.T + qe @ rope.T) * scale, lat, None))
                continue
            cs = f["col_scale"][blk].to(torch.float64)
            zpc = f["zero_point"][blk].to(torch.float64) + center * cs
            rs = f["row_scale"][blk, :v].to(torch.float64)
            c = f["codes"][blk, :, :v].to(torch.float64) - center
            rope = f["rope"][blk, :v].to(torch.float64)
            cmax = cs.abs().max()
            qs = f16x2(qr * (cs / cmax))
            s = ((qs @ c) * cmax + (qr @ zpc)[:, None]) * rs + qe @ rope.T
            parts.append((s * scale, c, (cs, zpc, rs)))
        m_all = torch.stack([s.amax(dim=1) for s, _, _ in parts], dim=1).amax(dim=1)
        acc = torch.zeros(q.shape[1], 512, dtype=torch.float64)
        den = torch.zeros(q.shape[1], dtype=torch.float64)
        for s, x, sc in parts:
            if sc is None:
                p = torch.exp(s - m_all[:, None])
                acc += p @ x
                den += p.sum(dim=1)
                continue
            cs, zpc, rs = sc
            m_b = s.amax(dim=1)
            p = torch.exp(s - m_b[:, None])
            rmax = rs.max()
            pw = f16(p * (rs / rmax))
            beta = torch.exp(m_b - m_all)[:, None]
            acc += beta * rmax * ((pw @ x.T) * cs + pw.sum(dim=1, keepdim=True) * zpc)
            den += beta[:, 0] * p.sum(dim=1)
        out[r] = hadamard(acc / den[:, None])
    return out


@pytest.mark.parametrize(
    "sparse,dtype,splits,bits",
    [
        (False, BF16, 3, 4),
        (True, FP8, 2, 4),
        (True, BF16, 1, 5),
        (True, FP8, 3, 3),
        (False, FP8, 1, 4),
    ],
)
def test_decode_matches_oracle(gen, sparse, dtype, splits, bits):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 3, dtype)
    packed = torch.zeros(6, layout.record_bytes, dtype=torch.uint8)
    ref.mla_pack(
        pool[0], pool[1], pool[2], i32(0, 1, 2, 0, 1, 2), torch.arange(6).int(), packed, layout
    )
    bmap = i32(-1, -1, 2, -1, -1, 1)
    bt = i32(0, 1, 2, 5, 4, 3, 5, 0).view(2, 4)
    seq = i32(201, 129)
    b, h = 2, 18
    q = torch.randn(b, h, 576, generator=gen)
    idx = None
    if sparse:
        idx = torch.stack([torch.randint(-1, 129, (23,), generator=gen) for _ in range(2)]).int()
        idx[1] = -1  # an empty selection gives zeros
        idx[1, :3] = torch.tensor([0, 128, 64])
    o_ref = torch.empty(b, h, 512)
    ref.mla_decode(
        q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.04, o_ref, indices=idx
    )
    o = torch.full((b, h, 512), float("nan"))
    ws = ref.mla_decode_workspace(b, h, splits)
    kdec.mla_decode(
        q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.04, o, ws, indices=idx
    )
    assert not bool(o.isnan().any())
    top = float(o_ref.abs().max())
    if sparse:
        assert float((o - o_ref).abs().max()) <= 2e-4 * top
    else:
        model = fp16_operand_decode(q, packed, bt, seq, bmap, pool, layout, 0.04)
        print(f"fp16 yardstick vs oracle: {float((model - o_ref).abs().max()) / top:.2e} * max")
        assert_near_yardstick(o, model, top)
        assert_near_oracle(o, model, o_ref, top)


def assert_near_yardstick(o, model, top):
    """Kernel vs the fp16-operand yardstick: within the fp32 allowance (2e-4 * max), except
    where a value the two compute in fp32 in another order lands on the other side of an fp16
    rounding boundary (the scaled query, a softmax weight): that operand moves by one fp16 ulp
    (at most 2^-10 of itself), and the outputs it feeds by at most about 2^-10 * max. Seen on
    one seed (k5, fp8 pool, one split): one output of 2 x 18 x 512 at 2.3e-4 * max, the others
    under 8e-5 * max as on every other seed tried."""
    err = (o - model).abs()
    assert float(err.max()) <= (2e-4 + 2**-10) * top
    assert float((err > 2e-4 * top).double().mean()) <= 1e-3


YARDSTICK_ORACLE_BOUND = 8 * 2**-10
"""Largest error of the fp16-operand yardstick vs the fp64 oracle, relative to max abs(out)."""


def assert_near_oracle(o, model, o_ref, top):
    """Kernel vs the oracle: within the yardstick's own error on this input plus the
    kernel-vs-yardstick allowance; the yardstick within YARDSTICK_ORACLE_BOUND (module doc)."""
    own = float((model - o_ref).abs().max())
    assert own <= YARDSTICK_ORACLE_BOUND * top, f"yardstick vs oracle {own / top:.2e} * max"
    assert float((o - o_ref).abs().max()) <= own + (2e-4 + 2**-10) * top


def make_ill_conditioned(gen, packed, layout, blocks):
    """Rewrite the records ``blocks`` of ``packed`` into ones like those of tokens with
    outsized latents: a quarter of the channels with steps of 15..25 (over 15 codes), codes
    at the top of the range and zero points that cancel them but for fp16 rounding, the other
    channels' scales and zero points divided by 10, row scales 10..30. The code term and the
    zero-point term then cancel, and one fp16 rounding of ``q * cs / cmax`` shifts a block's
    scores by about a log2 unit, differently per block."""
    bits = layout.field("codes").bits
    top = (1 << bits) - 1
    per = 64 * bits // 8  # code bytes of one channel (dim-major)
    co, cso = layout.field("codes").offset, layout.field("col_scale").offset
    zpo, rso = layout.field("zero_point").offset, layout.field("row_scale").offset
    for blk in blocks:
        rec = packed[blk]
        cs = rec[cso : cso + 1024].view(torch.float16).double()
        zp = rec[zpo : zpo + 1024].view(torch.float16).double()
        big = torch.randperm(512, generator=gen)[:128]
        step = (torch.rand(128, generator=gen, dtype=torch.float64) * 10 + 15) * 15 / top
        cs, zp = cs / 10, zp / 10
        cs[big] = step.to(torch.float16).double()
        zp[big] = -cs[big] * top
        for d in big.tolist():
            rec[co + d * per : co + (d + 1) * per] = 255
        rs = torch.rand(64, generator=gen, dtype=torch.float64) * 20 + 10
        rec[cso : cso + 1024] = cs.to(torch.float16).view(torch.uint8)
        rec[zpo : zpo + 1024] = zp.to(torch.float16).view(torch.uint8)
        rec[rso : rso + 128] = rs.to(torch.float16).view(torch.uint8)


@pytest.mark.parametrize("bits", [4, 5])
def test_decode_ill_conditioned_latents(gen, bits):
    """Latent records whose zero-point term nearly cancels the code term: the kernel keeps
    ``q * cs / cmax`` to about 2^-22 (two fp16 operands), as its yardstick does; one fp16
    operand fails this test (measured: far over the yardstick allowance)."""
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 3, BF16)
    packed = torch.zeros(6, layout.record_bytes, dtype=torch.uint8)
    ref.mla_pack(
        pool[0], pool[1], pool[2], i32(0, 1, 2, 0, 1, 2), torch.arange(6).int(), packed, layout
    )
    make_ill_conditioned(gen, packed, layout, [0, 1, 3, 4, 5])
    bmap = i32(-1, -1, 2, -1, -1, -1)
    bt = i32(0, 1, 2, 5, 4, 3, 5, 0).view(2, 4)
    seq = i32(201, 256)
    b, h = 2, 18
    q = torch.randn(b, h, 576, generator=gen)
    o_ref = torch.empty(b, h, 512)
    ref.mla_decode(q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.04, o_ref)
    o = torch.full((b, h, 512), float("nan"))
    kdec.mla_decode(
        q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.04, o,
        ref.mla_decode_workspace(b, h, 2),
    )  # fmt: skip
    top = float(o_ref.abs().max())
    model = fp16_operand_decode(q, packed, bt, seq, bmap, pool, layout, 0.04)
    assert_near_yardstick(o, model, top)
    assert_near_oracle(o, model, o_ref, top)


@pytest.mark.parametrize(
    "bits,dtype,splits", [(2, BF16, 2), (4, FP8, 3), (5, BF16, 2), (5, FP8, 1), (3, FP8, 2)]
)
def test_decode_blocks_per_split(gen, bits, dtype, splits):
    """Full context over several blocks per split: a sink and the filling tail block in the
    pool, a partial packed block, two head groups (the second partial), splits that get
    several blocks or none."""
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 4, dtype)
    nrec = 12
    packed = torch.zeros(nrec, layout.record_bytes, dtype=torch.uint8)
    src = torch.arange(nrec).int() % 4
    ref.mla_pack(pool[0], pool[1], pool[2], src, torch.arange(nrec).int(), packed, layout)
    bmap = torch.full((nrec,), -1, dtype=torch.int32)
    bmap[7], bmap[2] = 3, 0  # block 7: request 0's sink; block 2: its filling tail
    bt = torch.tensor(
        [[7, 0, 5, 9, 1, 3, 10, 4, 2], [6, 11, 8, 0, 0, 0, 0, 0, 0]], dtype=torch.int32
    )
    seq = i32(8 * 64 + 37, 2 * 64 + 5)  # request 1 ends in a partial packed block
    b, h = 2, 18
    q = torch.randn(b, h, 576, generator=gen)
    o_ref = torch.empty(b, h, 512)
    ref.mla_decode(q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.05, o_ref)
    o = torch.full((b, h, 512), float("nan"))
    ws = ref.mla_decode_workspace(b, h, splits)
    ws.part_out.fill_(float("nan"))  # rows of splits that read nothing must not be read
    kdec.mla_decode(q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.05, o, ws)
    assert not bool(o.isnan().any())
    top = float(o_ref.abs().max())
    model = fp16_operand_decode(q, packed, bt, seq, bmap, pool, layout, 0.05)
    print(f"fp16 yardstick vs oracle: {float((model - o_ref).abs().max()) / top:.2e} * max")
    assert_near_yardstick(o, model, top)
    assert_near_oracle(o, model, o_ref, top)


@pytest.mark.parametrize("rows", [2, 4, 16])
def test_decode_combine_rows_per_program(gen, monkeypatch, rows):
    """The combine merging 2, 4 or 16 rows per program (the launcher picks 1 on this 132-SM
    default for these 36 rows; the last program of 16 is partial)."""
    monkeypatch.setattr(kdec, "combine_rows", lambda n, device: rows)
    test_decode_blocks_per_split(gen, 4, FP8, 3)


def test_combine_rows_fill_the_sms(monkeypatch):
    """16 rows per program once there are 16 per SM, else the largest power of two that
    still gives every SM a program."""
    monkeypatch.setattr(kdec, "_sm_count", lambda device: 132)
    want = {1: 1, 131: 1, 264: 2, 527: 2, 528: 4, 1056: 8, 2112: 16, 100000: 16}
    assert {n: kdec.combine_rows(n, "cpu") for n in want} == want


@pytest.mark.parametrize("chunk", [256, 512])
def test_decode_latent_chunk_knob(gen, monkeypatch, chunk):
    """The full-context loop and the sparse gather with fewer, wider latent chunks (CHUNK
    launch knob)."""
    monkeypatch.setattr(kdec, "CHUNK", chunk)
    test_decode_blocks_per_split(gen, 4, BF16, 2)
    test_decode_matches_oracle(gen, True, FP8, 2, 5)


def test_decode_latent_chunk_knob_is_checked(monkeypatch):
    monkeypatch.setattr(kdec, "CHUNK", 64)
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pool = make_pool(2, BF16)
    packed = torch.zeros(2, layout.record_bytes, dtype=torch.uint8)
    q = torch.zeros(1, 16, 576)
    ws = ref.mla_decode_workspace(1, 16, 1)
    with pytest.raises(ValueError, match="CHUNK"):
        kdec.mla_decode(
            q, packed, i32(0, 1).view(1, 2), i32(70), i32(-1, -1), *pool, layout, 0.1,
            torch.empty(1, 16, 512), ws,
        )  # fmt: skip


def test_wide_kernel_choice(monkeypatch):
    """The 64-head sm_90 kernel takes the calls the 16-head ``wgmma`` kernel would serve with at
    least ``WGMMA64_MIN_HEADS`` query heads, at every width that kernel serves; None or
    ``KVARN_MLA_WGMMA64=0`` leaves them to the 16-head kernel, and nothing the 16-head kernel
    would not serve (another GPU, sparse decode) goes to it. (Which kernel runs on an sm_90 GPU
    is checked there by ``gpu/test_mla_parity.py``.)"""
    if kdec._wgmma64_module() is None:
        pytest.skip("this Triton has no Gluon: the Triton kernels serve every call")
    served = {}
    monkeypatch.setattr(kdec, "_use_wgmma_kernel", lambda bits, q, sparse: served[(bits, sparse)])
    for heads, want in [(16, False), (32, False), (63, False), (64, True), (96, True), (128, True)]:
        q = torch.zeros(2, heads, 576)
        for bits in (2, 4, 5):
            served.update({(bits, False): True, (bits, True): False})
            assert kdec._use_wgmma64_kernel(bits, q, False) == want, (heads, bits)
            assert not kdec._use_wgmma64_kernel(bits, q, True)
            served[(bits, False)] = False  # e.g. not an sm_90 device
            assert not kdec._use_wgmma64_kernel(bits, q, False)
    q = torch.zeros(1, 128, 576)
    served[(4, False)] = True
    monkeypatch.setenv("KVARN_MLA_WGMMA64", "0")
    assert not kdec._use_wgmma64_kernel(4, q, False)
    monkeypatch.delenv("KVARN_MLA_WGMMA64")
    assert kdec._use_wgmma64_kernel(4, q, False)
    monkeypatch.setattr(kdec, "WGMMA64_MIN_HEADS", None)
    assert not kdec._use_wgmma64_kernel(4, q, False)


def test_workspace_picks_enough_splits_to_fill_the_gpu(monkeypatch):
    """``num_splits=None``: enough for one program per SM at this batch and head count (in
    groups of 64 heads from ``WGMMA64_MIN_HEADS`` heads, the head groups of the 64-head sm_90
    kernel), at most ``MAX_AUTO_SPLITS``, and no fewer than the launcher runs where it may
    run up to 32 (two 16-head programs or one 64-head one per SM): the launched split count
    is what it was with a floor of 32, the workspace no larger than it needs (batch 256 at
    128 heads: 1 split, not 32, which took 2 GiB); an explicit count is kept."""
    monkeypatch.setattr(kdec, "_sm_count", lambda device: 132)
    want = {(1, 16): 132, (1, 128): 66, (4, 128): 17, (1, 64): 132, (2, 16): 66, (1, 40): 44,
            (8, 16): 32, (64, 16): 4, (256, 128): 1, (0, 16): 132}  # fmt: skip
    for (b, h), splits in want.items():
        ws = kdec.mla_decode_workspace(b, h)
        assert ws.num_splits == splits, (b, h, ws.num_splits)
        assert ws.part_out.shape == (b, h, splits, 512)
    # against a floor of 32 splits: never fewer launched (16- and 64-head kernels), never a
    # larger workspace
    for b, h in [(1, 16), (2, 16), (8, 16), (64, 16), (1, 128), (4, 128), (32, 128), (256, 128),
                 (3, 64), (16, 96), (1, 40), (12, 40)]:  # fmt: skip
        n = kdec.mla_decode_workspace(b, h).num_splits
        per_wide = kdec.WIDE_HEADS if h >= 64 else kdec.BLOCK_H
        old = min(kdec.MAX_AUTO_SPLITS, max(32, -(-132 // (b * -(-h // per_wide)))))
        assert n <= old, (b, h)
        kernels = [(kdec.BLOCK_H, kdec.CTAS_PER_SM)] + [(kdec.WIDE_HEADS, 1)] * (h >= 64)
        for per, ctas in kernels:
            launched = kdec.live_splits(b, h, n, "cpu", per, ctas)
            assert launched == kdec.live_splits(b, h, old, "cpu", per, ctas), (b, h, per)
    assert kdec.live_splits(1, 128, 66, "cpu", kdec.WIDE_HEADS, 1) == 66
    assert kdec.live_splits(32, 128, 32, "cpu", kdec.WIDE_HEADS, 1) == 2
    assert kdec.live_splits(32, 128, 32, "cpu") == 1
    assert kdec.live_splits(1, 128, 66, "cpu") == 33
    monkeypatch.setattr(kdec, "WGMMA64_MIN_HEADS", None)
    assert kdec.mla_decode_workspace(1, 128).num_splits == 32
    monkeypatch.setattr(kdec, "_sm_count", lambda device: 600)
    assert kdec.mla_decode_workspace(1, 16).num_splits == kdec.MAX_AUTO_SPLITS
    assert kdec.mla_decode_workspace(1, 16, 4).num_splits == 4
    with pytest.raises(ValueError, match="batch"):
        kdec.mla_decode_workspace(-1, 16)
    with pytest.raises(ValueError, match="num_splits"):
        kdec.mla_decode_workspace(1, 16, 0)


# ---------------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_naming_the_argument():
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pool = make_pool(2, BF16)
    packed = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    bmap = i32(-1, 0, -1)
    slots = torch.tensor([0, 5])

    def raises(name, fn, *args):
        with pytest.raises(ValueError, match=f"^{name}"):
            fn(*args)

    bad_stride = torch.zeros(3, layout.record_bytes + 16, dtype=torch.uint8)
    raises("packed", kpack.mla_pack, *pool, i32(0), i32(0), bad_stride, layout)
    raises(
        "packed",
        kgat.mla_stage_fp8,
        bad_stride,
        bmap,
        *pool,
        slots,
        layout,
        torch.zeros(2, 656, dtype=torch.uint8),
    )
    raises(
        "out",
        kgat.mla_stage_fp8,
        packed,
        bmap,
        *pool,
        slots,
        layout,
        torch.zeros(2, 640, dtype=torch.uint8),
    )
    raises(
        "slots",
        kgat.mla_materialize,
        packed,
        bmap,
        *pool,
        torch.tensor([0, 3 * 64]),
        layout,
        torch.zeros(2, 576, dtype=BF16),
    )
    raises(
        "slots",
        kgat.mla_materialize,
        packed,
        bmap,
        *pool,
        slots.int(),
        layout,
        torch.zeros(2, 576, dtype=BF16),
    )
    raises(
        "block_pool_map",
        kgat.mla_materialize,
        packed,
        i32(-1, 2, -1),
        *pool,
        slots,
        layout,
        torch.zeros(2, 576, dtype=BF16),
    )
    raises(
        "pool_latent",
        kscat.mla_exact_scatter,
        torch.zeros(2, 512),
        torch.zeros(2, 64),
        slots,
        pool[0].half(),
        pool[2],
        None,
    )
    raises(
        "pool_scale",
        kscat.mla_exact_scatter,
        torch.zeros(2, 512),
        torch.zeros(2, 64),
        slots,
        pool[0].to(FP8),
        pool[2],
        None,
    )
    raises(
        "latent",
        kscat.mla_exact_scatter,
        torch.zeros(2, 512).t().contiguous().t()[:, :2],
        torch.zeros(2, 64),
        slots,
        pool[0],
        pool[2],
        None,
    )
    raises(
        "slots",
        kscat.mla_exact_scatter,
        torch.zeros(2, 512),
        torch.zeros(2, 64),
        torch.tensor([0, 128]),
        pool[0],
        pool[2],
        None,
    )
    raises("dst_blocks", kpack.mla_pack, *pool, i32(0), i32(3), packed, layout)
    raises(
        "src_blocks", kpack.mla_rehydrate, packed, i32(5), i32(0), pool[0], pool[1], pool[2], layout
    )
    raises(
        "layout",
        kpack.mla_pack,
        *pool,
        i32(0),
        i32(0),
        packed,
        kf.dense_layout("kvarn_k4v4_g64", head_dim=128),
    )
    raises(
        "indices",
        kgat.mla_remap_indices,
        i32(0, 6 * 64).view(1, 2),
        i32(0),
        torch.zeros(1, 6, dtype=torch.int32),
        torch.zeros(1, 2, dtype=torch.int64),
    )
    q = torch.zeros(1, 16, 576)
    ws = ref.mla_decode_workspace(1, 16, 2)
    raises(
        "workspace",
        kdec.mla_decode,
        q,
        packed,
        i32(0, 1).view(1, 2),
        i32(70),
        bmap,
        *pool,
        layout,
        0.1,
        torch.zeros(1, 16, 512),
    )
    raises(
        "block_table",
        kdec.mla_decode,
        q,
        packed,
        i32(0, 7).view(1, 2),
        i32(70),
        bmap,
        *pool,
        layout,
        0.1,
        torch.zeros(1, 16, 512),
        ws,
    )
    raises(
        "q",
        kdec.mla_decode,
        torch.zeros(1, 16, 512),
        packed,
        i32(0, 1).view(1, 2),
        i32(70),
        bmap,
        *pool,
        layout,
        0.1,
        torch.zeros(1, 16, 512),
        ws,
    )


# ------------------------------------------------------------------- gather tiles (launch knobs)


def tile_slots(gen, layout, dtype):
    """A gather over ``gather_setup``'s cache (blocks 1 and 4 in the pool) whose slots cover
    what the token tiles meet: a run of adjacent offsets sharing code words that crosses from a
    packed block into a pooled one, every offset of packed block 3 in random order (every bit
    position of a code within its 32-bit word, straddling ones included), offsets 0 and 63 of
    other blocks, random slots, and -1 at the first, last and inner positions. Pool row 5 of
    block 1 has an all-zero second 128-column chunk (its fp8 scale must be 1.0)."""
    pool, _ = filled_pool(gen, 3, dtype)
    pool[0][2, 5, 128:256] = 0.0  # block 1 maps to pool block 2
    packed = torch.zeros(5, layout.record_bytes, dtype=torch.uint8)
    ref.mla_pack(pool[0], pool[1], pool[2], i32(0, 1, 2), i32(0, 3, 4), packed, layout)
    bmap = i32(-1, 2, -1, -1, 1)
    run = torch.arange(50, 75)
    whole = 3 * 64 + torch.randperm(64, generator=gen)
    edges = torch.tensor([0, 63, 4 * 64 + 63, 5 * 64 - 1])
    rand = torch.randint(0, 5 * 64, (14,), generator=gen)
    slots = torch.cat((torch.tensor([-1]), run, whole, edges, rand, torch.tensor([-1, 7, -1])))
    slots[30] = -1
    return pool, packed, bmap, slots


@pytest.mark.parametrize(
    "bits,dtype,block_t",
    [(2, FP8, 8), (4, BF16, 16), (4, FP8, 32), (5, BF16, 16), (5, FP8, 8), (3, BF16, 1)],
)
def test_stage_fp8_tiles_byte_exact(gen, monkeypatch, bits, dtype, block_t):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, packed, bmap, slots = tile_slots(gen, layout, dtype)
    assert slots.shape[0] % 16 and slots.shape[0] % 32
    monkeypatch.setattr(kgat, "STAGE_TOKENS", block_t)
    a = torch.full((slots.shape[0], 656), 0xA5, dtype=torch.uint8)
    b = a.clone()
    ref.mla_stage_fp8(packed, bmap, pool[0], pool[1], pool[2], slots, layout, a)
    kgat.mla_stage_fp8(packed, bmap, pool[0], pool[1], pool[2], slots, layout, b)
    bad = (a != b).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ (slots {slots[bad].tolist()})"
    ok = slots >= 0
    assert bool((b[~ok] == 0xA5).all()), "an invalid slot's row must stay untouched"
    zero_row = int((slots == 64 + 5).nonzero()[0])
    scales = b[zero_row, 512:528].contiguous().view(torch.float32)
    assert float(scales[1]) == 1.0 and bool((scales[[0, 2, 3]] != 1.0).all())


@pytest.mark.parametrize("bits,dtype,block_t", [(4, FP8, 16), (5, BF16, 32), (2, BF16, 16)])
def test_materialize_tiles_match_reference(gen, monkeypatch, bits, dtype, block_t):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, packed, bmap, slots = tile_slots(gen, layout, dtype)
    monkeypatch.setattr(kgat, "MATERIALIZE_TOKENS", block_t)
    check_materialize(layout, pool, packed, bmap, slots)


def test_gather_launch_knobs_are_checked(monkeypatch):
    monkeypatch.setattr(kgat, "STAGE_TOKENS", 12)
    with pytest.raises(ValueError, match="^STAGE_TOKENS"):
        kgat.launch_config(True)
    monkeypatch.setattr(kgat, "MATERIALIZE_TOKENS", 8)
    with pytest.raises(ValueError, match="^MATERIALIZE_TOKENS"):
        kgat.launch_config(False)
    monkeypatch.setattr(kgat, "MATERIALIZE_TOKENS", 16)
    monkeypatch.setattr(kgat, "MATERIALIZE_WARPS", 3)
    with pytest.raises(ValueError, match="^MATERIALIZE_WARPS"):
        kgat.launch_config(False)
