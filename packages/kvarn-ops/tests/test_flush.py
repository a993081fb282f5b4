"""Triton flush vs ``kvarn_ops.reference.flush`` under the Triton interpreter, and the bit
packing helpers of ``kvarn_ops.kernels._common``.

What must hold, and why:

- bit packing, fp16 fields, padding: bit-exact (the kernel's records equal the reference
  writer's records built from the kernel's own decoded fields): packing and stores are exact.
- codes: >= 99.9% identical to the reference (CODE_AGREEMENT), the rest 1 LSB apart: same
  algorithm in the same order; only a float reduction order or an exp/log ulp flips a rounding.
- fp16 scale fields: not compared bit for bit, the decoded tile is. Near convergence successive
  iterates have almost equal imbalance, so an ulp can pick a neighbouring iterate whose
  row/column split differs by a near-constant factor (codes and products unchanged).
- decoded tile: rms error vs the input <= 1.02 x the reference's (ERR_RATIO) + 1e-6 x max abs:
  same quantizer; a 1-LSB code flip moves the error by well under 2%.
- records not in dst_blocks: untouched (poison 0xAB kept).
"""

from __future__ import annotations

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


def _compare(packed, packed_ref, dst, layout, pool_tiles, err_ratio=ERR_RATIO):
    """Checks of the table above for records ``dst``; returns (code agreement, byte-identical
    record fraction)."""
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
    for name in ("k_codes", "v_codes"):
        diff = (fields[name].int() - fields_ref[name].int()).abs()
        assert int(diff.max()) <= 1, f"{name}: codes differ by {int(diff.max())}"
        same += int((diff == 0).sum())
        total += diff.numel()
    agreement = same / total
    assert agreement >= CODE_AGREEMENT, f"code agreement {agreement:.5f}"
    for got, want, x in zip(
        ref.decode_records(recs, layout),
        ref.decode_records(recs_ref, layout),
        pool_tiles,
        strict=True,
    ):
        x = x.reshape(-1, layout.block_size, layout.head_dim)
        err = ((got - x) ** 2).mean(dim=(1, 2)).sqrt()
        err_ref = ((want - x) ** 2).mean(dim=(1, 2)).sqrt()
        amax = x.abs().amax(dim=(1, 2))
        assert bool((err <= err_ratio * err_ref + 1e-6 * amax).all()), (err / err_ref).tolist()
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


def test_flush_special_tiles(gen):
    """Zero, constant, constant-row, outlier, tiny-scale and non-finite tiles (one per KV head)
    give the reference's codes and finite scale fields."""
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
    flush(ek, ev, None, None, src, src, packed, lay)
    ref.flush(ek, ev, None, None, src, src, packed_ref, lay)
    fields = ref.record_fields(packed.reshape(hkv, -1), lay)
    for name, val in fields.items():
        if val.dtype == torch.float16:
            assert bool(val.isfinite().all()), name
    tiles = [ref.zero_nonfinite_tokens(t.float()).permute(0, 2, 1, 3) for t in (ek, ev)]
    # A tile with a constant channel and a constant token has many nearly tied iterates; the
    # kernel may keep another one than the reference (measured up to 1.15x the reference's
    # error over 12 seeds; 1.09x and 1.15x in the two seeds over 1.02x).
    _compare(packed, packed_ref, src, lay, tiles, err_ratio=1.25)


def test_flush_saturates_scales_beyond_fp16(gen):
    """Channels spanning 1e-12..1e12 do not fit fp16 on either side: fields saturate at
    +-65504 (never Inf), as the reference."""
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    spread = torch.logspace(-12, 12, 64)
    x = torch.randn(1, 32, 1, 64, generator=gen) * spread
    ek = x.to(torch.bfloat16)
    src = torch.zeros(1, dtype=torch.int32)
    packed = torch.full((1, 1, lay.record_bytes), POISON, dtype=torch.uint8)
    packed_ref = packed.clone()
    flush(ek, ek.clone(), None, None, src, src, packed, lay)
    ref.flush(ek, ek.clone(), None, None, src, src, packed_ref, lay)
    fields = ref.record_fields(packed.reshape(1, -1), lay)
    fields_ref = ref.record_fields(packed_ref.reshape(1, -1), lay)
    for name, val in fields.items():
        if val.dtype == torch.float16:
            assert bool(val.isfinite().all()), name
            assert bool((val.abs() == 65504).any() == (fields_ref[name].abs() == 65504).any())
    assert torch.equal(fields["k_codes"], fields_ref["k_codes"])
    assert torch.equal(fields["v_codes"], fields_ref["v_codes"])


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
