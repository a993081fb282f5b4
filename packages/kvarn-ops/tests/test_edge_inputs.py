"""Edge inputs on which the reference and the Triton launchers must agree: non-finite tokens
in fp8 pools, non-finite queries, bad softmax scales, empty batches, zero heads, aliased
outputs, bad workspaces and size arguments (interpreter on the CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
import kvarn_ops.kernels as K  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from kvarn_ops.kernels import mla_decode as kdec  # noqa: E402
from kvarn_ops.kernels import mla_gather as kgat  # noqa: E402
from kvarn_ops.kernels import mla_scatter as kscat  # noqa: E402
from kvarn_ops.reference import mla as rmla  # noqa: E402

FP8 = torch.float8_e4m3fn
BAD_SCALES = [0.0, -0.125, float("nan"), float("inf"), True, "0.04", None]


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def _bad_token(x: torch.Tensor, kind: str, gen) -> None:
    """Put a NaN or an Inf into one random element of ``x [D]`` (in place)."""
    j = int(torch.randint(0, x.numel(), (1,), generator=gen))
    x.view(-1)[j] = float("nan") if kind == "nan" else -float("inf")


# ------------------------------------------------------------------- non-finite fp8 pool tokens


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_store_fp8_keeps_a_nonfinite_token_nonfinite(gen, kind):
    """A K token holding NaN/Inf must stay non-finite in an fp8 pool (the flush then zeroes
    it); the interpreter's fp8 cast used to turn it into finite values (384)."""
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    k = torch.randn(64, 2, 64, generator=gen)
    v = torch.randn(64, 2, 64, generator=gen)
    bad = int(torch.randint(0, 64, (1,), generator=gen))
    _bad_token(k[bad, 1], kind, gen)
    pools = []
    for store in (ref.store, K.store):
        ek = torch.full((1, 64, 2, 64), 7.0).to(FP8)
        ev = ek.clone()
        ks = torch.full((1, 64, 2), -1.0)
        vs = ks.clone()
        store(k, v, torch.arange(64), ek, ev, ks, vs)
        pools.append((ek, ev, ks, vs))
    (rk, rv, rks, rvs), (kk, kv, kks, kvs) = pools
    assert not bool(torch.isfinite(rk[0, bad, 1].float()).all())
    assert not bool(torch.isfinite(kk[0, bad, 1].float()).all()), "the bad token came out finite"
    if kind == "nan":  # scale 1.0 (NaN is not > 0), as the reference
        assert float(kks[0, bad, 1]) == float(rks[0, bad, 1]) == 1.0
    good = torch.ones(64, 2, dtype=torch.bool)
    good[bad, 1] = False
    assert bool(torch.isfinite(kk[0][good].float()).all())
    rel = ((kks[0][good] - rks[0][good]).abs() / rks[0][good]).max()
    assert float(rel) <= 1e-6  # test_store's SCALE_RTOL
    # the flush zeroes the token: the same records as with zeros stored in its place
    zk, zks = kk.clone(), kks.clone()
    zk[0, bad, 1] = 0.0
    zks[0, bad, 1] = 1.0
    recs = []
    for ek, ks in ((kk, kks), (zk, zks)):
        packed = torch.zeros(1, 2, lay.record_bytes, dtype=torch.uint8)
        ref.flush(ek, kv, ks, kvs, i32(0), i32(0), packed, lay)
        recs.append(packed)
    assert torch.equal(recs[0], recs[1])


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_mla_scatter_fp8_keeps_a_nonfinite_token_nonfinite(gen, kind):
    lat = torch.randn(8, 512, generator=gen)
    rope = torch.randn(8, 64, generator=gen)
    bad = int(torch.randint(0, 8, (1,), generator=gen))
    _bad_token(lat[bad], kind, gen)
    got = []
    for scatter in (rmla.mla_exact_scatter, kscat.mla_exact_scatter):
        pl = torch.full((1, 64, 512), 3.0).to(FP8)
        ps = torch.full((1, 64), -1.0)
        pr = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
        scatter(lat, rope, torch.arange(8), pl, pr, ps)
        got.append((pl, ps))
    (rl, rs), (kl, ks) = got
    assert not bool(torch.isfinite(kl[0, bad].float()).all()), "the bad token came out finite"
    if kind == "nan":  # scale 1.0 (NaN is not > 0), as the reference
        assert float(ks[0, bad]) == float(rs[0, bad]) == 1.0
    keep = torch.arange(8) != bad
    assert bool(((rs[0, :8][keep] - ks[0, :8][keep]).abs() <= 1e-6 * rs[0, :8][keep]).all())
    assert bool(torch.isfinite(kl[0, :8][keep].float()).all())
    assert bool((ks[0, 8:] == -1.0).all()), "a row without a token must stay untouched"


def test_mla_stage_fp8_of_a_nan_pool_token_matches_reference(gen):
    """Staging a pool row that holds NaN: the reference's scale (1.0) and NaN where it has
    NaN, every other byte identical."""
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pl = (torch.randn(1, 64, 512, generator=gen)).to(torch.bfloat16)
    pr = torch.randn(1, 64, 64, generator=gen).to(torch.bfloat16)
    bad = int(torch.randint(0, 64, (1,), generator=gen))
    pl[0, bad, 7] = float("nan")
    packed = torch.zeros(1, layout.record_bytes, dtype=torch.uint8)
    slots = torch.tensor([bad, (bad + 1) % 64])
    a = torch.full((2, 656), 0xA5, dtype=torch.uint8)
    b = a.clone()
    rmla.mla_stage_fp8(packed, i32(0), pl, None, pr, slots, layout, a)
    kgat.mla_stage_fp8(packed, i32(0), pl, None, pr, slots, layout, b)
    va, vb = a[:, :512].view(FP8).float(), b[:, :512].view(FP8).float()
    assert torch.equal(va.isnan(), vb.isnan()) and bool(vb[0].isnan().any())
    assert torch.equal(va.nan_to_num(0.0), vb.nan_to_num(0.0))
    assert torch.equal(a[:, 512:], b[:, 512:])


# ----------------------------------------------------------------------- non-finite MLA query


def _mla_setup(gen):
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pl = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    pr = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    lat = torch.randn(64, 512, generator=gen)
    rmla.mla_exact_scatter(lat, torch.randn(64, 64, generator=gen), torch.arange(64), pl, pr)
    packed = torch.zeros(1, layout.record_bytes, dtype=torch.uint8)
    rmla.mla_pack(pl, None, pr, i32(0), i32(0), packed, layout)
    return layout, packed, pl, pr


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_mla_decode_propagates_a_nonfinite_query(gen, kind, sparse):
    """A head whose query holds NaN/Inf gets NaN, as the reference (the kernel used to return
    zeros, as for an empty selection); the other heads are unaffected."""
    layout, packed, pl, pr = _mla_setup(gen)
    q = torch.randn(1, 2, 576, generator=gen)
    _bad_token(q[0, 0], kind, gen)
    idx = torch.randint(0, 64, (1, 16), generator=gen, dtype=torch.int32) if sparse else None
    outs = []
    for dec, ws in (
        (rmla.mla_decode, None),
        (kdec.mla_decode, kdec.mla_decode_workspace(1, 2, 2)),
    ):
        out = torch.full((1, 2, 512), 5.0)
        dec(
            q, packed, i32(0).view(1, 1), i32(64), i32(-1), pl, None, pr, layout, 0.04, out, ws, idx
        )
        outs.append(out)
    for out in outs:
        assert bool(out[0, 0].isnan().all())
        assert bool(torch.isfinite(out[0, 1]).all())
    # the finite head against the oracle within test_mla_ops' bounds: sparse 2e-4 * max; full
    # context the fp16-operand yardstick's own bound (8 * 2**-10) plus the kernel's allowance
    top = float(outs[0][0, 1].abs().max())
    bound = 2e-4 if sparse else 8 * 2**-10 + 2e-4 + 2**-10
    assert float((outs[0][0, 1] - outs[1][0, 1]).abs().max()) <= bound * top


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_mla_decode_rejects_bad_softmax_scale(gen, scale):
    layout, packed, pl, pr = _mla_setup(gen)
    q = torch.randn(1, 2, 576, generator=gen)
    for dec, ws in (
        (rmla.mla_decode, None),
        (kdec.mla_decode, kdec.mla_decode_workspace(1, 2, 2)),
    ):
        out = torch.zeros(1, 2, 512)
        with pytest.raises(ValueError, match="^softmax_scale"):
            dec(
                q, packed, i32(0).view(1, 1), i32(64), i32(-1), pl, None, pr, layout, scale, out, ws
            )


def test_mla_decode_rejects_a_foreign_workspace(gen):
    layout, packed, pl, pr = _mla_setup(gen)
    q = torch.randn(1, 2, 576, generator=gen)
    for dec in (rmla.mla_decode, kdec.mla_decode):
        with pytest.raises(ValueError, match="^workspace"):
            dec(q, packed, i32(0).view(1, 1), i32(64), i32(-1), pl, None, pr, layout, 0.04,
                torch.zeros(1, 2, 512), torch.zeros(4))  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [
        lambda: rmla.mla_decode_workspace(-1, 2, 2),
        lambda: rmla.mla_decode_workspace(1, 2, 0),
        lambda: kdec.mla_decode_workspace(-1, 2, 2),
        lambda: kdec.mla_decode_workspace(1, -2),
        lambda: kdec.mla_decode_workspace(1.5, 2),
        lambda: K.decode_workspace(-1, 1, 2, 1, 64, 64, 64, device="cpu"),
        lambda: K.decode_workspace(1, 1, 2, 0, 64, 64, 64, device="cpu"),
        lambda: K.decode_workspace(1, 1, 2, 1, 64, 64, True, device="cpu"),
    ],
)
def test_workspace_sizes_are_checked(make):
    with pytest.raises(ValueError, match=r"^(batch|num_heads|num_splits|num_kv_heads|block_size)"):
        make()


# ---------------------------------------------------------------------------------- dense decode


def _dense(make_cache):
    c = make_cache("kvarn_k4v2_g64", 64, [70], 1)
    names = ["packed", "block_table", "seq_lens", "exact_k", "exact_v", "k_scale", "v_scale"]
    args = dict(zip([*names, "tail_pool_block", "layout"], c.context_args(), strict=True))
    return c, args


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_decode_rejects_bad_softmax_scale_like_the_reference(make_cache, gen, scale):
    _, args = _dense(make_cache)
    q = torch.randn(1, 1, 2, 64, generator=gen)
    ws = K.decode_workspace(1, 1, 2, 1, 64, 70, 64, device="cpu")
    for dec, w in ((ref.decode, None), (K.decode, ws)):
        with pytest.raises(ValueError, match="^softmax_scale"):
            dec(q, **args, softmax_scale=scale, out=torch.empty_like(q), workspace=w)


def test_decode_of_an_empty_batch_is_a_no_op(make_cache):
    c, _ = _dense(make_cache)
    q = torch.zeros(0, 1, 2, 64)
    kw = dict(
        packed=c.packed, block_table=torch.zeros(0, 2, dtype=torch.int32), seq_lens=i32(),
        exact_k=c.exact_k, exact_v=c.exact_v, k_scale=None, v_scale=None,
        tail_pool_block=i32(), layout=c.layout, softmax_scale=0.125,
    )  # fmt: skip
    ref.decode(q, **kw, out=torch.empty_like(q), workspace=None)
    K.decode(q, **kw, out=torch.empty_like(q),
             workspace=K.decode_workspace(0, 1, 2, 1, 64, 1, 64, device="cpu"))  # fmt: skip


def test_decode_rejects_zero_query_heads_like_the_reference(make_cache):
    _, args = _dense(make_cache)
    q = torch.zeros(1, 1, 0, 64)
    ws = K.decode_workspace(1, 1, 2, 1, 64, 70, 64, device="cpu")
    for dec, w in ((ref.decode, None), (K.decode, ws)):
        with pytest.raises(ValueError, match="^q"):
            dec(q, **args, softmax_scale=0.1, out=q.clone(), workspace=w)


def test_pool_without_kv_heads_is_refused():
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    ek = torch.zeros(1, 64, 0, 64, dtype=torch.float16)
    packed = torch.zeros(1, 0, lay.record_bytes, dtype=torch.uint8)
    for flush in (ref.flush, K.flush):
        with pytest.raises(ValueError, match="^exact_k"):
            flush(ek, ek.clone(), None, None, i32(0), i32(0), packed, lay)
    for store in (ref.store, K.store):
        with pytest.raises(ValueError, match="^exact_k"):
            store(torch.zeros(1, 0, 64), torch.zeros(1, 0, 64), torch.zeros(1, dtype=torch.int64),
                  ek, ek.clone())  # fmt: skip
    with pytest.raises(ValueError, match="^(exact_k|packed)"):
        ref.decode(
            torch.zeros(1, 1, 2, 64), packed, torch.zeros(1, 1, dtype=torch.int32), i32(5), ek,
            ek.clone(), None, None, i32(0), lay, 0.1, torch.zeros(1, 1, 2, 64), None,
        )  # fmt: skip


def test_flush_takes_sink_rows_by_position_like_the_reference(make_cache, gen):
    c = make_cache("kvarn_k4v2_g64", 64, [64], 1)
    sink = i32(int(torch.randint(0, 64, (1,), generator=gen)))
    a, b = c.packed.clone(), c.packed.clone()
    K.flush(c.exact_k, c.exact_v, None, None, i32(0), i32(0), a, c.layout, sink)
    K.flush(c.exact_k, c.exact_v, None, None, i32(0), i32(0), b, c.layout, sink_rows=sink)
    assert torch.equal(a, b)
    plain = c.packed.clone()
    K.flush(c.exact_k, c.exact_v, None, None, i32(0), i32(0), plain, c.layout)
    assert not torch.equal(a, plain), "the positional sink_rows was ignored"


# ------------------------------------------------------------------------------------ rotate


@pytest.mark.parametrize("rotate", [ref.rotate, K.rotate])
def test_rotate_refuses_a_partly_overlapping_output(gen, rotate):
    buf = torch.randn(9, 64, generator=gen)
    with pytest.raises(ValueError, match="^out"):
        rotate(buf[:8], buf[1:])
    with pytest.raises(ValueError, match="^out"):
        rotate(buf[:4].view(-1), buf.view(torch.float16)[:4].view(-1)[:256])
    x = torch.randn(8, 64, generator=gen)
    want = ref.hadamard(x)
    rotate(x, x)  # in place is allowed
    assert float((x - want).abs().max() / want.abs().max()) <= 4e-6  # test_rotate's fp32 bound
