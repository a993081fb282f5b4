"""Triton store vs ``kvarn_ops.reference.store`` under the Triton interpreter.

Tolerances (pool contents of kernel vs reference, compared as bits):

- float16, bfloat16: at most 1 ulp apart, on at most 2% of elements (ULP_FRACTION): the
  rotation's fp32 sum order differs from the reference's butterflies; the rounding to the pool
  dtype flips only near a tie. Results near zero (within 8 fp32 epsilons of the largest
  magnitude) may be further apart in ulps: they carry the rounding of the largest terms.
- float8_e4m3fn: values as above; scales within 1e-6 relative (SCALE_RTOL): the per-token
  scale is amax/448 of the fp32 rotated row, so it inherits fp32-ulp differences.

Untouched slots must keep their poison bytes (0xFF) exactly; every slot given a token must be
rewritten.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import realistic_kv  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from kvarn_ops.kernels import store  # noqa: E402

ULP_FRACTION = 0.02
SCALE_RTOL = 1e-6
FP8 = torch.float8_e4m3fn


def as_ordered_int(t: torch.Tensor) -> torch.Tensor:
    """Bits of a 1- or 2-byte float as integers consecutive for adjacent representable values."""
    if t.element_size() == 1:
        bits = t.view(torch.uint8).to(torch.int32)
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits)
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def make_pool(p, g, hkv, d, dtype):
    """Pool inside a buffer with one guard block on each side, all bytes 0xFF."""
    buf = torch.empty(p + 2, g, hkv, d, dtype=dtype)
    raw_bytes(buf).fill_(0xFF)
    sbuf = torch.full((p + 2, g, hkv), float("nan")) if dtype == FP8 else None
    pool = buf[1 : p + 1]
    scale = sbuf[1 : p + 1] if sbuf is not None else None
    return buf, sbuf, pool, scale


CASES = [
    # (T, Hkv, D, G, P, k/v dtype, pool dtype)
    (37, 3, 64, 16, 4, torch.bfloat16, torch.bfloat16),
    (21, 2, 64, 32, 2, torch.float32, torch.float16),
    (45, 2, 128, 16, 5, torch.float16, FP8),
    (19, 1, 128, 64, 1, torch.bfloat16, torch.float16),
    (17, 2, 256, 16, 3, torch.float32, FP8),
    (13, 1, 512, 32, 2, torch.bfloat16, torch.bfloat16),
    (9, 2, 512, 16, 2, torch.float16, FP8),
    # several token tiles per program (store.tiles_per_program), the last program partial
    (300, 2, 128, 64, 6, torch.float16, torch.float16),
    (300, 1, 64, 32, 10, torch.bfloat16, FP8),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"T{c[0]}-h{c[1]}-d{c[2]}-g{c[3]}-{str(c[5])[6:]}-{str(c[6])[6:]}"
)
def test_store_matches_reference(case, gen):
    t, hkv, d, g, p, xdt, pdt = case
    k = realistic_kv(gen, t, hkv, d).to(xdt)
    v = realistic_kv(gen, t, hkv, d).to(xdt)
    slots = torch.randperm(p * g, generator=gen)[:t].to(torch.int64)
    slots[torch.rand(t, generator=gen) < 0.2] = -1
    kbuf, ksbuf, ek, ks = make_pool(p, g, hkv, d, pdt)
    vbuf, vsbuf, ev, vs = make_pool(p, g, hkv, d, pdt)
    store(k, v, slots, ek, ev, ks, vs)

    _, _, ek_ref, ks_ref = make_pool(p, g, hkv, d, pdt)
    _, _, ev_ref, vs_ref = make_pool(p, g, hkv, d, pdt)
    ref.store(k, v, slots, ek_ref, ev_ref, ks_ref, vs_ref)

    for buf, sbuf in ((kbuf, ksbuf), (vbuf, vsbuf)):
        assert bool((raw_bytes(buf[0]) == 0xFF).all()), "guard block before the pool written"
        assert bool((raw_bytes(buf[-1]) == 0xFF).all()), "guard block after the pool written"
        if sbuf is not None:
            assert bool(sbuf[0].isnan().all()) and bool(sbuf[-1].isnan().all())
    used = torch.zeros(p * g, dtype=torch.bool)
    used[slots[slots >= 0]] = True
    for pool, pool_ref in ((ek, ek_ref), (ev, ev_ref)):
        flat = pool.reshape(p * g, hkv, d)
        flat_ref = pool_ref.reshape(p * g, hkv, d)
        assert bool((raw_bytes(flat[~used]) == 0xFF).all()), "a slot without a token was written"
        assert not bool(flat[used].float().isnan().any()), "a stored element was not written"
        diff = (as_ordered_int(flat[used]) - as_ordered_int(flat_ref[used])).abs()
        # More than 1 ulp only for results near zero, whose fp32 sums carry the rounding error
        # of their largest terms: then within 8 fp32 epsilons of the largest magnitude.
        a, b = flat[used].double(), flat_ref[used].double()
        near_zero = (a - b).abs() <= 8 * torch.finfo(torch.float32).eps * float(b.abs().max())
        worst = int(diff[~near_zero].max()) if bool((~near_zero).any()) else 0
        assert worst <= 1, f"max ulp difference {worst} away from zero"
        assert float((diff > 0).float().mean()) <= ULP_FRACTION
    if pdt == FP8:
        for s, s_ref in ((ks, ks_ref), (vs, vs_ref)):
            s, s_ref = s.reshape(p * g, hkv), s_ref.reshape(p * g, hkv)
            assert bool(s[~used].isnan().all()), "a scale without a token was written"
            rel = ((s[used] - s_ref[used]).abs() / s_ref[used]).max()
            assert float(rel) <= SCALE_RTOL


@pytest.mark.parametrize("pdt", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_store_reads_token_rows_at_any_stride(pdt, gen):
    """K and V as views into a fused QKV projection (token stride (Hq + 2 Hkv) D, rows
    packed): the same bytes as from contiguous copies, kernel and reference alike."""
    t, hq, hkv, d, g, p = 70, 4, 2, 64, 16, 6
    qkv = realistic_kv(gen, t, hq + 2 * hkv, d).to(torch.bfloat16).reshape(t, -1)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert not k.is_contiguous() and k.stride(0) == (hq + 2 * hkv) * d
    slots = torch.randperm(p * g, generator=gen)[:t].to(torch.int64)
    slots[torch.rand(t, generator=gen) < 0.2] = -1
    got = []
    for fn in (store, ref.store):
        for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
            _, ksb, ek, ks = make_pool(p, g, hkv, d, pdt)
            _, vsb, ev, vs = make_pool(p, g, hkv, d, pdt)
            fn(kk, vv, slots, ek, ev, ks, vs)
            got.append(
                (fn, [raw_bytes(x) for x in (ek, ev)], [x for x in (ksb, vsb) if x is not None])
            )
    for i in (0, 2):  # strided vs contiguous, kernel then reference
        (_, b1, s1), (_, b2, s2) = got[i], got[i + 1]
        assert all(torch.equal(x, y) for x, y in zip(b1, b2, strict=True))
        assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(s1, s2, strict=True))
    used = slots >= 0
    assert bool((got[0][1][0].view(p * g, -1)[slots[used]] != 0xFF).any())


def test_store_fp8_zero_token_has_unit_scale(gen):
    k = torch.zeros(3, 1, 64)
    k[1] = torch.randn(1, 64, generator=gen)
    v = k.clone()
    ek = torch.zeros(1, 16, 1, 64, dtype=FP8)
    ev = torch.zeros_like(ek)
    ks = torch.full((1, 16, 1), float("nan"))
    vs = ks.clone()
    store(k, v, torch.tensor([0, 1, 2]), ek, ev, ks, vs)
    assert ks[0, 0, 0] == 1.0 and ks[0, 2, 0] == 1.0
    assert bool((ek[0, 0].float() == 0).all())
    # The largest |value| of a token maps to +-448 exactly.
    assert float(ek[0, 1].float().abs().max()) == 448.0


def test_store_nonfinite_tokens_as_reference(gen):
    k = torch.randn(6, 2, 64, generator=gen)
    v = torch.randn(6, 2, 64, generator=gen)
    k[2, 1, 7] = float("inf")
    v[4, 0, 0] = float("nan")
    slots = torch.arange(6, dtype=torch.int64)
    ek = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    ev = torch.zeros_like(ek)
    store(k, v, slots, ek, ev)
    ek_ref, ev_ref = torch.zeros_like(ek), torch.zeros_like(ek)
    ref.store(k, v, slots, ek_ref, ev_ref)
    for a, b in ((ek, ek_ref), (ev, ev_ref)):
        assert bool((a.isnan() == b.isnan()).all()) and bool((a.isinf() == b.isinf()).all())


def test_store_is_a_registered_custom_op():
    assert hasattr(torch.ops.kvarn, "store")


def _args(**over):
    t, hkv, d, p, g = 5, 2, 64, 2, 16
    args = dict(
        k=torch.zeros(t, hkv, d),
        v=torch.zeros(t, hkv, d),
        pool_slots=torch.arange(t, dtype=torch.int64),
        exact_k=torch.zeros(p, g, hkv, d, dtype=torch.float16),
        exact_v=torch.zeros(p, g, hkv, d, dtype=torch.float16),
        k_scale=None,
        v_scale=None,
    )
    args.update(over)
    return args


BAD = {
    "k-dtype": ("k", dict(k=torch.zeros(5, 2, 64, dtype=torch.int32))),
    "k-shape": ("k", dict(k=torch.zeros(5, 3, 64))),
    "k-contiguity": ("k", dict(k=torch.zeros(5, 64, 2).transpose(1, 2))),
    "v-shape": ("v", dict(v=torch.zeros(4, 2, 64))),
    "v-device": ("v", dict(v=torch.zeros(5, 2, 64, device="meta"))),
    "slots-dtype": ("pool_slots", dict(pool_slots=torch.arange(5, dtype=torch.int32))),
    "slots-range": ("pool_slots", dict(pool_slots=torch.tensor([0, 1, 32, -1, 2]))),
    "slots-negative": ("pool_slots", dict(pool_slots=torch.tensor([0, 1, -2, 3, 4]))),
    "pool-dtype": ("exact_k", dict(exact_k=torch.zeros(2, 16, 2, 64))),
    "pool-head-dim": (
        "exact_k",
        dict(
            exact_k=torch.zeros(2, 16, 2, 96, dtype=torch.float16),
            exact_v=torch.zeros(2, 16, 2, 96, dtype=torch.float16),
        ),
    ),
    "pool-mismatch": ("exact_v", dict(exact_v=torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16))),
    "fp8-no-scale": (
        "k_scale",
        dict(
            exact_k=torch.zeros(2, 16, 2, 64, dtype=FP8),
            exact_v=torch.zeros(2, 16, 2, 64, dtype=FP8),
        ),
    ),
    "scale-not-fp8": (
        "k_scale",
        dict(k_scale=torch.zeros(2, 16, 2), v_scale=torch.zeros(2, 16, 2)),
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_store_rejects_bad_input(case):
    name, over = BAD[case]
    with pytest.raises(ValueError, match=f"^{name}"):
        store(**_args(**over))
