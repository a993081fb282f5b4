"""The exact pool and packing: store, flush, materialize.

Tolerances:
- store into fp16 / bf16 pool: exact vs rotated-then-cast; why: the reference defines the
  rounding
- fp8 pool value * scale vs rotated token: 2**-4 * |x| + 2**-9 * scale; why: e4m3 has 3
  mantissa bits (half ulp 2**-4 relative); subnormals below 2**-6 step by 2**-9
- flush records: exact vs encode_records of the pool tiles; why: same reference code path,
  checked byte for byte
- materialize, exact-tail rows, per token: norm(err) <= (u_pool + 1.1 u_out) * norm(k) * 1.01;
  why: each rounding moves an element by <= u relative; the rotations are orthogonal, so
  per-token norms carry the bound over frames (u: fp16 2**-11, bf16 2**-8, e4m3 2**-4)
- materialize, packed rows (4-bit K): relative rms < 0.15; why: 4-bit RTN, realistic tiles
  (~0.09 measured)
"""

from __future__ import annotations

import pytest
import torch

import kvarn_formats as kf
from conftest import realistic_kv
from kvarn_ops import reference as ref

POOL_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]
UNIT_ROUNDOFF = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float8_e4m3fn: 2**-4}


def poison_pool(p, g, hkv, d, dtype):
    pool = torch.empty(p, g, hkv, d, dtype=dtype)
    pool.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).fill_(-1)  # NaN bit pattern
    scale = torch.full((p, g, hkv), float("nan")) if dtype == torch.float8_e4m3fn else None
    return pool, scale


def same_bits(a, b):
    view = torch.uint8 if a.dtype.itemsize == 1 else torch.int16
    return torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_writes_only_its_slots(gen, pool_dtype, in_dtype):
    p, g, hkv, d, t = 5, 32, 3, 64, 37
    k = realistic_kv(gen, t, hkv, d).to(in_dtype)
    v = realistic_kv(gen, t, hkv, d).to(in_dtype)
    k[4] = 0.0  # one all-zero token: its fp8 scale must be 1.0
    slots = torch.randperm(p * g, generator=gen)[:t].to(torch.int64)
    slots[torch.randperm(t, generator=gen)[:6]] = -1
    ek, ks = poison_pool(p, g, hkv, d, pool_dtype)
    ev, vs = poison_pool(p, g, hkv, d, pool_dtype)
    before_k = ek.clone()
    ref.store(k, v, slots, ek, ev, ks, vs)
    live = slots >= 0
    blk, off = slots[live] // g, slots[live] % g
    untouched = torch.ones(p, g, dtype=torch.bool)
    untouched[blk, off] = False
    assert same_bits(ek[untouched], before_k[untouched])
    for x, pool, scale in ((k, ek, ks), (v, ev, vs)):
        rot = ref.hadamard(x)[live]
        if pool_dtype == torch.float8_e4m3fn:
            amax = rot.abs().amax(-1)
            want_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            assert torch.equal(scale[blk, off], want_scale)
            assert torch.isnan(scale[untouched]).all()
            val = pool[blk, off].float() * scale[blk, off][..., None]
            assert ((val - rot).abs() <= 2**-4 * rot.abs() + 2**-9 * want_scale[..., None]).all()
        else:
            assert same_bits(pool[blk, off], rot.to(pool_dtype))
    if pool_dtype == torch.float8_e4m3fn and bool(live[4]):
        s = ks[slots[4] // g, slots[4] % g]
        assert (s == 1.0).all() and (ek[slots[4] // g, slots[4] % g].float() == 0).all()


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize(
    "fmt,d,hkv",
    [("kvarn_k4v2_g64", 128, 3), ("kvarn_k2v4_g32", 256, 1), ("kvarn_k5v5_g128", 64, 4)],
)
def test_flush_packs_every_head_into_its_block_only(gen, pool_dtype, fmt, d, hkv):
    lay = kf.dense_layout(fmt, d)
    g, p, nb = lay.block_size, 6, 9
    t = p * g
    ek, ks = poison_pool(p, g, hkv, d, pool_dtype)
    ev, vs = poison_pool(p, g, hkv, d, pool_dtype)
    ref.store(
        realistic_kv(gen, t, hkv, d),
        realistic_kv(gen, t, hkv, d),
        torch.arange(t, dtype=torch.int64),
        ek,
        ev,
        ks,
        vs,
    )
    packed = torch.full((nb, hkv, lay.record_bytes), 0xFF, dtype=torch.uint8)
    src = torch.tensor([4, 0, 2], dtype=torch.int32)
    dst = torch.tensor([8, 1, 5], dtype=torch.int32)
    ref.flush(ek, ev, ks, vs, src, dst, packed, lay)
    for s, dblk in zip(src.tolist(), dst.tolist(), strict=True):
        kt = ref.read_pool_blocks(ek, ks, torch.tensor([s]))[0].transpose(0, 1)  # [Hkv, G, D]
        vt = ref.read_pool_blocks(ev, vs, torch.tensor([s]))[0].transpose(0, 1)
        assert torch.equal(packed[dblk], ref.encode_records(kt.contiguous(), vt.contiguous(), lay))
    others = torch.ones(nb, dtype=torch.bool)
    others[dst.long()] = False
    assert (packed[others] == 0xFF).all()
    # An empty flush is a no-op.
    snapshot = packed.clone()
    empty = torch.empty(0, dtype=torch.int32)
    ref.flush(ek, ev, ks, vs, empty, empty, packed, lay)
    assert torch.equal(packed, snapshot)


@pytest.mark.parametrize("seq_lens", [[1, 64, 1000], [63, 65, 200]])
@pytest.mark.parametrize(
    "pool_dtype,out_dtype",
    [
        (torch.float16, torch.bfloat16),
        (torch.float8_e4m3fn, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_materialize(make_cache, seq_lens, pool_dtype, out_dtype):
    c = make_cache("kvarn_k4v4_g64", 128, seq_lens, 2, pool_dtype)
    gap = 5
    starts = [sum(seq_lens[:i]) + gap * (i + 1) for i in range(len(seq_lens))]
    total = starts[-1] + seq_lens[-1] + gap
    cu = torch.tensor(starts + [total], dtype=torch.int32)
    k_out = torch.full((total, 2, 128), float("nan"), dtype=out_dtype)
    v_out = torch.full_like(k_out, float("nan"))
    ref.materialize(*c.context_args(), k_out, v_out, cu)
    written = torch.zeros(total, dtype=torch.bool)
    for r, (start, n) in enumerate(zip(starts, seq_lens, strict=True)):
        written[start : start + n] = True
        kc, vc = ref.gather_context(*c.context_args(), r)
        assert torch.equal(k_out[start : start + n], ref.hadamard(kc).to(out_dtype))
        assert torch.equal(v_out[start : start + n], ref.hadamard(vc).to(out_dtype))
        n_full = n // 64 * 64
        u = UNIT_ROUNDOFF[pool_dtype] + UNIT_ROUNDOFF[out_dtype] * 1.1
        for got, want in (
            (k_out[start : start + n].float(), c.k[r]),
            (v_out[start : start + n].float(), c.v[r]),
        ):
            tail_err = (got[n_full:] - want[n_full:]).norm(dim=-1)
            assert (tail_err <= u * want[n_full:].norm(dim=-1) * 1.01 + 1e-6).all()
            if n_full:
                rel = (got[:n_full] - want[:n_full]).norm() / want[:n_full].norm()
                assert float(rel) < 0.15
    assert torch.isnan(k_out[~written].float()).all() and torch.isnan(v_out[~written].float()).all()


def _pool(dtype=torch.float16, p=4, g=64, hkv=2, d=128):
    ek = torch.zeros(p, g, hkv, d, dtype=dtype)
    scale = torch.ones(p, g, hkv) if dtype == torch.float8_e4m3fn else None
    return ek, ek.clone(), scale, None if scale is None else scale.clone()


def test_store_rejects_bad_input(gen):
    ek, ev, ks, vs = _pool()
    k = torch.randn(5, 2, 128, generator=gen)
    slots = torch.arange(5, dtype=torch.int64)
    f8 = _pool(torch.float8_e4m3fn)
    cases = [
        (lambda: ref.store(k.double(), k, slots, ek, ev), "k", "dtype"),
        (lambda: ref.store(k[:, :1].contiguous(), k, slots, ek, ev), "k", "shape"),
        (lambda: ref.store(k, k[:4], slots, ek, ev), "v", "shape"),
        (
            lambda: ref.store(k, k.transpose(0, 1).contiguous().transpose(0, 1), slots, ek, ev),
            "v",
            "contiguous",
        ),
        (lambda: ref.store(k, k, slots.int(), ek, ev), "pool_slots", "dtype"),
        (lambda: ref.store(k, k, slots[:4], ek, ev), "pool_slots", "shape"),
        (lambda: ref.store(k, k, slots + 4 * 64 - 2, ek, ev), "pool_slots", "out of range"),
        (lambda: ref.store(k, k, slots - 2, ek, ev), "pool_slots", "out of range"),
        (lambda: ref.store(k, k, slots, ek.float(), ev.float()), "exact_k", "dtype"),
        (lambda: ref.store(k, k, slots, ek, ev.bfloat16()), "exact_v", "dtype"),
        (lambda: ref.store(k, k, slots, ek, ev.to("meta")), "exact_v", "meta"),
        (lambda: ref.store(k, k, slots, ek, ev, torch.ones(4, 64, 2), None), "k_scale", "None"),
        (lambda: ref.store(k, k, slots, f8[0], f8[1], None, f8[3]), "k_scale", "required"),
        (lambda: ref.store(k, k, slots, f8[0], f8[1], f8[2], f8[3][:2]), "v_scale", "shape"),
        (
            lambda: ref.store(
                k[..., :96].contiguous(),
                k[..., :96].contiguous(),
                slots,
                ek[..., :96].contiguous(),
                ev[..., :96].contiguous(),
            ),
            "exact_k",
            "head_dim",
        ),
        (lambda: ref.store(k.to("meta"), k, slots, ek, ev), "k", "meta"),
    ]
    for fn, arg, match in cases:
        with pytest.raises(ValueError, match=rf"^{arg}:.*{match}"):
            fn()


def test_flush_rejects_bad_input():
    lay = kf.dense_layout("kvarn_k4v2_g64", 128)
    ek, ev, ks, vs = _pool()
    packed = torch.zeros(3, 2, lay.record_bytes, dtype=torch.uint8)
    src = torch.tensor([0, 1], dtype=torch.int32)
    dst = torch.tensor([2, 0], dtype=torch.int32)
    cases = [
        (
            lambda: ref.flush(ek, ev, ks, vs, src.long(), dst, packed, lay),
            "src_pool_blocks",
            "dtype",
        ),
        (lambda: ref.flush(ek, ev, ks, vs, src, dst[:1], packed, lay), "dst_blocks", "shape"),
        (
            lambda: ref.flush(ek, ev, ks, vs, src + 3, dst, packed, lay),
            "src_pool_blocks",
            "out of range",
        ),
        (
            lambda: ref.flush(ek, ev, ks, vs, src, dst + 2, packed, lay),
            "dst_blocks",
            "out of range",
        ),
        (
            lambda: ref.flush(ek, ev, ks, vs, src, dst, packed[:, :1].contiguous(), lay),
            "packed",
            "shape",
        ),
        (
            lambda: ref.flush(ek, ev, ks, vs, src, dst, packed[..., :-16].contiguous(), lay),
            "packed",
            "shape",
        ),
        (
            lambda: ref.flush(ek, ev, ks, vs, src, dst, packed.transpose(0, 1), lay),
            "packed",
            "contiguous",
        ),
        (lambda: ref.flush(ek, ev, ks, vs, src, dst, packed.float(), lay), "packed", "dtype"),
        (
            lambda: ref.flush(
                ek, ev, ks, vs, src, dst, packed, kf.dense_layout("kvarn_k4v2_g32", 128)
            ),
            "exact_k",
            "32 tokens",
        ),
        (
            lambda: ref.flush(
                ek, ev, ks, vs, src, dst, packed, kf.dense_layout("kvarn_k4v2_g64", 256)
            ),
            "exact_k",
            "head_dim",
        ),
        (
            lambda: ref.flush(ek, ev, ks, vs, src, dst, packed, kf.mla_layout("kvarn_mla_k4_g64")),
            "layout",
            "mla",
        ),
        (lambda: ref.flush(ek, ev, ks, vs, src, dst.to("meta"), packed, lay), "dst_blocks", "meta"),
    ]
    for fn, arg, match in cases:
        with pytest.raises(ValueError, match=rf"^{arg}:.*{match}"):
            fn()


def test_materialize_rejects_bad_input(make_cache):
    c = make_cache("kvarn_k4v2_g64", 128, [70, 5], 2)
    k_out = torch.empty(75, 2, 128, dtype=torch.bfloat16)
    v_out = torch.empty_like(k_out)
    cu = torch.tensor([0, 70, 75], dtype=torch.int32)
    args = list(c.context_args())
    bad_bt = c.block_table.clone()
    bad_bt[0, 0] = c.packed.shape[0]
    bad_tail = c.tail_pool_block.clone()
    bad_tail[1] = -1
    cases = [
        (dict(k_out=k_out.float()), "k_out", "dtype"),
        (dict(v_out=v_out.half()), "v_out", "dtype"),
        (dict(k_out=k_out[:, :1].contiguous()), "k_out", "shape"),
        (dict(cu=cu[:2].contiguous()), "cu_seqlens", "shape"),
        (dict(cu=cu.long()), "cu_seqlens", "dtype"),
        (dict(cu=torch.tensor([0, 71, 75], dtype=torch.int32)), "cu_seqlens", "rows"),
        (dict(i=1, val=bad_bt), "block_table", "out of range"),
        (dict(i=7, val=bad_tail), "tail_pool_block", "out of range"),
        (dict(i=2, val=torch.tensor([70, 5, 1], dtype=torch.int32)), "seq_lens", "shape"),
        (dict(i=2, val=torch.tensor([64 * 9, 5], dtype=torch.int32)), "seq_lens", "block_table"),
        (dict(i=1, val=c.block_table.long()), "block_table", "dtype"),
        (dict(i=0, val=c.packed.to("meta")), "packed", "meta"),
        (dict(i=8, val=kf.dense_layout("kvarn_k4v4_g64", 128)), "packed", "shape"),
    ]
    for change, arg, match in cases:
        a = list(args)
        if "i" in change:
            a[change["i"]] = change["val"]
        with pytest.raises(ValueError, match=rf"^{arg}:.*{match}"):
            ref.materialize(
                *a, change.get("k_out", k_out), change.get("v_out", v_out), change.get("cu", cu)
            )
