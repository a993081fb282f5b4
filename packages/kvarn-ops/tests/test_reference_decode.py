"""Paged decode against the dense softmax oracle on the dequantized context.

The oracle (``attention_oracle``, fp64) attends over K/V that are dequantized explicitly
(``gather_context``: full blocks via ``decode_records``, tail from the pool) and rotated back
to the model frame; ``decode`` instead folds the scales into its dot products on raw codes
and rotates q and the output. Agreement checks the folding algebra, paging, GQA and causality.

Tolerances (flash-attention rule):
- decode fp32 vs oracle fp64: <= 2 * err(oracle in fp32) + atol; why: the same maths in fp32
  by plain torch is the yardstick; the atol covers the folded form, whose score sum cancels a
  zero-point term of about the tile's range against the code term. Its terms grow with the
  key code range and the head dimension (the length of the sum), so atol = 5e-6 *
  max|oracle| * ((2^bK - 1) / 15) * max(1, D / 128): at 4-bit keys and D = 128 the excess
  over the yardstick measured up to 2.3e-6 * max|out|; at 5-bit keys and D = 256 (atol 2.1e-5
  * max) up to 8.6e-6 * max|out| (40 seeds, and one CI seed that exceeded the former fixed
  5e-6); at 4-bit keys and D = 64 up to 2.5e-6 * max|out| (a CI seed, 1949533875, over the
  former D / 128 scaling below 128: a shorter sum does not make it proportionally smaller).
  Kernels should use reference.decode in fp32 vs compute_dtype=float64 as their yardstick:
  it includes that cancellation.
- decode with compute_dtype=float64 (out fp32) vs oracle fp64: 2**-24 * |oracle| + 1e-10; why:
  only the final fp32 rounding remains
- out in bf16/fp16: + 2**-8 / 2**-11 * |oracle|; why: one rounding of the output
- block placement: exact; why: the same records and pool rows are read
"""

from __future__ import annotations

import math

import pytest
import torch

import kvarn_formats as kf
from kvarn_ops import reference as ref

OUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def oracle(c, q, scale, dtype=torch.float64):
    outs = []
    for r in range(q.shape[0]):
        kc, vc = ref.gather_context(*c.context_args(), r, dtype=torch.float64)
        outs.append(
            ref.attention_oracle(q[r], ref.hadamard(kc), ref.hadamard(vc), scale, dtype=dtype)
        )
    return torch.stack(outs)


CASES = [
    # fmt, D, Hkv, GQA group, T, seq_lens, pool dtype, q/out dtype
    ("kvarn_k4v2_g64", 128, 2, 4, 1, [1, 63, 1000], torch.float16, torch.bfloat16),
    ("kvarn_k4v4_g64", 64, 1, 3, 4, [64, 65, 200], torch.bfloat16, torch.float32),
    ("kvarn_k2v2_g128", 128, 3, 1, 8, [8, 129, 256], torch.float8_e4m3fn, torch.float16),
    ("kvarn_k5v5_g32", 256, 2, 3, 2, [33, 2, 95], torch.float16, torch.float32),
    ("kvarn_k8v3_g64", 512, 1, 4, 3, [3, 130, 64], torch.bfloat16, torch.bfloat16),
    ("kvarn_k4v2_g64", 128, 4, 1, 7, [71, 7, 128], torch.float8_e4m3fn, torch.float32),
]


@pytest.mark.parametrize("fmt,d,hkv,grp,t,seq_lens,pool_dtype,dtype", CASES)
def test_decode_matches_oracle(gen, make_cache, fmt, d, hkv, grp, t, seq_lens, pool_dtype, dtype):
    c = make_cache(fmt, d, seq_lens, hkv, pool_dtype)
    b, hq = len(seq_lens), hkv * grp
    q = (torch.randn(b, t, hq, d, generator=gen) * 1.5).to(dtype)
    scale = 1 / math.sqrt(d)
    out = torch.full((b, t, hq, d), float("nan"), dtype=dtype)
    workspace = torch.empty(64, dtype=torch.float32)
    ref.decode(q, *c.context_args(), scale, out, workspace)
    assert torch.isfinite(out.float()).all()
    want = oracle(c, q, scale)
    yard = (oracle(c, q, scale, torch.float32).double() - want).abs().max()
    err = (out.double() - want).abs()
    print("err", float(err.max()), "yard", float(yard), "max", float(want.abs().max()))
    bits_k = kf.parse_format(fmt).k_bits
    atol = 5e-6 * want.abs().max() * ((2**bits_k - 1) / 15) * max(1.0, d / 128)
    assert (err <= 2 * yard + atol + OUT_ROUNDING[dtype] * want.abs()).all(), (
        float(err.max()),
        float(yard),
    )
    out64 = torch.empty(b, t, hq, d, dtype=torch.float32)
    ref.decode(q, *c.context_args(), scale, out64, None, compute_dtype=torch.float64)
    # fp64 compute, stored in fp32: only the final rounding remains.
    assert ((out64.double() - want).abs() <= 2**-24 * want.abs() + 1e-10).all()


def test_decode_is_causal_and_reads_only_the_context(gen, make_cache):
    # Changing tokens after a query, or the content of unused blocks, changes nothing else.
    c = make_cache("kvarn_k4v2_g64", 128, [130], 2, torch.float16, spare_blocks=4)
    q = torch.randn(1, 4, 4, 128, generator=gen)
    out1 = torch.empty_like(q)
    ref.decode(q, *c.context_args(), 0.1, out1, None)
    used = c.block_table[0, :2].long()
    unused = torch.ones(c.packed.shape[0], dtype=torch.bool)
    unused[used] = False
    c.packed[unused] = 0x3C
    out2 = torch.empty_like(q)
    ref.decode(q, *c.context_args(), 0.1, out2, None)
    assert torch.equal(out1, out2)
    # The last token (position 129, in the pool tail) is seen by the last query only.
    c.exact_v[c.tail_pool_block[0], 1] = 7.0
    out3 = torch.empty_like(q)
    ref.decode(q, *c.context_args(), 0.1, out3, None)
    assert torch.equal(out3[0, :3], out1[0, :3])
    assert not torch.equal(out3[0, 3], out1[0, 3])


def test_decode_does_not_depend_on_block_placement(gen, make_cache):
    c = make_cache("kvarn_k4v4_g64", 128, [200, 64, 131], 2, torch.bfloat16, spare_blocks=5)
    q = torch.randn(3, 2, 6, 128, generator=gen)
    out1 = torch.empty_like(q)
    ref.decode(q, *c.context_args(), 0.09, out1, None)
    perm = torch.randperm(c.packed.shape[0], generator=gen)
    inv = torch.argsort(perm)
    c.packed = c.packed[perm].contiguous()  # new position i holds old block perm[i]
    c.block_table = torch.where(
        c.block_table >= 0, inv[c.block_table.clamp_min(0).long()].int(), c.block_table
    )
    out2 = torch.empty_like(q)
    ref.decode(q, *c.context_args(), 0.09, out2, None)
    assert torch.equal(out1, out2)


def test_single_token_context_returns_its_value(gen, make_cache):
    c = make_cache("kvarn_k4v2_g64", 128, [1], 2, torch.float16)
    q = torch.randn(1, 1, 2, 128, generator=gen)
    out = torch.empty_like(q)
    ref.decode(q, *c.context_args(), 0.3, out, None)
    v = ref.hadamard(c.exact_v[c.tail_pool_block[0], 0].float())  # [Hkv, D] model frame
    torch.testing.assert_close(out[0, 0], v, rtol=0, atol=2e-6 * float(v.abs().max()))


def test_oracle_against_explicit_softmax(gen):
    q = torch.randn(3, 4, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(10, 2, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(10, 2, 64, generator=gen, dtype=torch.float64)
    got = ref.attention_oracle(q, k, v, 0.2)
    for t in range(3):
        for h in range(4):
            n = 10 - 3 + t + 1
            w = torch.softmax(0.2 * (k[:n, h // 2] @ q[t, h]), dim=0)
            torch.testing.assert_close(got[t, h], w @ v[:n, h // 2], rtol=1e-12, atol=1e-12)


def test_decode_rejects_bad_input(gen, make_cache):
    c = make_cache("kvarn_k4v2_g64", 128, [70, 5], 2)
    q = torch.randn(2, 2, 4, 128, generator=gen)
    out = torch.empty_like(q)
    args = list(c.context_args())
    bad_bt = c.block_table.clone()
    bad_bt[0, 0] = -1
    bad_tail = c.tail_pool_block.clone()
    bad_tail[0] = 99
    cases = [
        (dict(q=q.double()), "q", "dtype"),
        (dict(q=q[:, :, :3].contiguous()), "q", "multiple"),
        (dict(q=torch.randn(2, 9, 4, 128)), "q", "T"),
        (dict(q=q[:1].contiguous()), "q", "shape"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "q", "contiguous"),
        (dict(q=q.to("meta")), "q", "meta"),
        (dict(out=out[..., :64].contiguous()), "out", "shape"),
        (dict(out=out.int()), "out", "dtype"),
        (dict(scale=float("nan")), "softmax_scale", "finite"),
        (dict(scale=-1.0), "softmax_scale", "positive"),
        (dict(ws=torch.empty(4, dtype=torch.float16)), "workspace", "dtype"),
        (dict(i=1, val=bad_bt), "block_table", "out of range"),
        (dict(i=7, val=bad_tail), "tail_pool_block", "out of range"),
        (dict(i=2, val=torch.tensor([70, 1], dtype=torch.int32)), "seq_lens", ">= T"),
        (dict(i=2, val=torch.tensor([70, 5], dtype=torch.int64)), "seq_lens", "dtype"),
        (dict(i=3, val=c.exact_k.float()), "exact_k", "dtype"),
        (dict(i=5, val=torch.ones(c.exact_k.shape[:3])), "k_scale", "None"),
        (dict(i=8, val=kf.dense_layout("kvarn_k4v2_g64", 64)), "exact_k", "head_dim"),
        (dict(i=8, val=kf.mla_layout("kvarn_mla_k4_g64")), "layout", "mla"),
    ]
    for change, arg, match in cases:
        a = list(args)
        if "i" in change:
            a[change["i"]] = change["val"]
        with pytest.raises(ValueError, match=rf"^{arg}:.*{match}"):
            ref.decode(
                change.get("q", q),
                *a,
                change.get("scale", 0.1),
                change.get("out", out),
                change.get("ws"),
            )


def test_operand_precision_emulates_16_bit_operands(gen, make_cache):
    """The kernels' yardstick: rounding q and the scaled weights to fp16 moves the fp64 result
    by a few fp16 roundings (not zero, not more), and tf32 truncation adds the tail's."""
    c = make_cache("kvarn_k4v2_g64", 128, [700, 90], 2, torch.bfloat16)
    q = torch.randn(2, 2, 4, 128, generator=gen)
    outs = {}
    for prec in ref.OPERAND_PRECISIONS:
        outs[prec] = torch.empty(2, 2, 4, 128)
        ref.decode(
            q, *c.context_args(), 0.09, outs[prec], None,
            compute_dtype=torch.float64, operand_precision=prec,
        )  # fmt: skip
    top = float(outs[None].abs().max())
    for prec in ("fp16", "fp16_tf32"):
        dev = float((outs[prec] - outs[None]).abs().max()) / top
        assert 2**-16 < dev < 8 * 2**-11, (prec, dev)
    assert not torch.equal(outs["fp16"], outs["fp16_tf32"])
    with pytest.raises(ValueError, match=r"^operand_precision:"):
        ref.decode(q, *c.context_args(), 0.09, outs[None], None, operand_precision="bf16")


def test_tf32_truncation_keeps_ten_mantissa_bits():
    from kvarn_ops.reference.decode import _tf32

    x = torch.tensor([1 + 2**-10, 1 + 2**-11, -(1 + 2**-10 + 2**-11), 3.0], dtype=torch.float64)
    assert _tf32(x).tolist() == [1 + 2**-10, 1.0, -(1 + 2**-10), 3.0]
