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
- materialize: the rotation back runs as two small products. Bound: 1 bf16 ulp + 1e-6*rms
  (rounding of the bf16 output).
- decode: fp32 dots and online softmax vs the fp64 oracle. Bound: 2e-4 * max abs(out)
  (interpreter fp32) (GPU tf32 needs more; gpu_parity).
"""

from __future__ import annotations

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
    fa = ref.record_tensors(a[dst.long()], layout)
    fb = ref.record_tensors(b[dst.long()], layout)
    assert torch.equal(fa["rope"].view(torch.int16), fb["rope"].view(torch.int16))
    code_diff = (fa["codes"].int() - fb["codes"].int()).abs()
    assert int(code_diff.max()) <= 1
    assert float((code_diff > 0).float().mean()) < 5e-3
    la, _ = ref.decode_mla_records(a[dst.long()], layout)
    lb, _ = ref.decode_mla_records(b[dst.long()], layout)
    rms = la.pow(2).mean(dim=(1, 2)).sqrt()[:, None, None]
    # Where a code differs (allowed above), the value differs by one step of its channel:
    # |col_scale[d] * row_scale[t]| (latent [t, d]); at 2 bits that is far above 2% of the rms.
    lsb = (fa["col_scale"].float()[:, None, :] * fa["row_scale"].float()[:, :, None]).abs()
    allowed = 0.02 * rms + code_diff.transpose(1, 2).float() * lsb * 1.01
    assert bool(((la - lb).abs() <= allowed).all())


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


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_materialize_matches_reference(gen, dtype):
    layout, pool, packed, bmap, slots = gather_setup(gen, dtype)
    a = torch.full((slots.shape[0], 576), float("nan"), dtype=BF16)
    b = a.clone()
    ref.mla_materialize(packed, bmap, pool[0], pool[1], pool[2], slots, layout, a)
    kgat.mla_materialize(packed, bmap, pool[0], pool[1], pool[2], slots, layout, b)
    ok = slots >= 0
    assert bool(b[~ok].isnan().all())
    assert not bool(b[ok].isnan().any())
    assert torch.equal(a[ok, 512:].view(torch.int16), b[ok, 512:].view(torch.int16))
    x, y = a[ok, :512].float(), b[ok, :512].float()
    rms = x.pow(2).mean().sqrt()
    assert bool(((x - y).abs() <= x.abs() * 2.0**-7 + 1e-6 * rms).all())


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


@pytest.mark.parametrize("sparse,dtype,splits", [(False, BF16, 3), (True, FP8, 2), (False, FP8, 1)])
def test_decode_matches_oracle(gen, sparse, dtype, splits):
    layout = kf.mla_layout("kvarn_mla_k4_g64")
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
    assert float((o - o_ref).abs().max()) <= 2e-4 * float(o_ref.abs().max())


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
