"""The MLA tile decode kernel (``kernels/mla_decode_tile.py``) under the interpreter, against
its own yardstick and the fp64 oracle, on the cases of ``test_mla_ops.py``'s full-context
decode tests (fresh random inputs, poisoned outputs and workspace).

Tolerance: the kernel rounds each block's dequantized latent tile to fp16 (after scaling it by
a power of two) and the softmax weights times the row scales to fp16; ``fp16_tile_decode``
below is the fp64 oracle with exactly those two roundings. Kernel vs yardstick: the fp32
allowance of the other decode kernels (2e-4 * max abs(out), plus isolated fp16 rounding
flips, ``assert_near_yardstick``); yardstick vs oracle within ``YARDSTICK_ORACLE_BOUND``
(8 * 2^-10 * max), the bound of the other kernels' yardstick.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from kvarn_ops.kernels import mla_decode as kdec  # noqa: E402
from kvarn_ops.reference import mla as ref  # noqa: E402
from kvarn_ops.reference.hadamard import hadamard  # noqa: E402

from test_mla_ops import (  # noqa: E402
    BF16,
    FP8,
    assert_near_oracle,
    assert_near_yardstick,
    filled_pool,
    i32,
    make_ill_conditioned,
)


def f16(x: torch.Tensor) -> torch.Tensor:
    """fp64 -> nearest fp16 (one rounding, subnormals included) -> fp64."""
    return torch.from_numpy(x.numpy().astype(np.float16).astype(np.float64))


def tile_scale(cs: torch.Tensor, zp: torch.Tensor, bits: int) -> float:
    top = float((zp.abs() + (2**bits - 1) * cs.abs()).max())
    return 2.0 ** np.floor(np.log2(top)) if top > 0 else 1.0


def fp16_tile_decode(q, packed, bt, seq, bmap, pool, layout, scale):
    """Full-context decode with the tile kernel's two roundings, fp64 otherwise (``[B, H,
    512]`` fp64, model frame). Per packed block: ``g`` the power of two that brings
    ``max(|zp| + (2^b - 1) |cs|)`` into [1, 2), ``D[t, d] = fp16(code * fp16(cs / g) + fp16(zp
    / g))`` (one rounding), ``rs' = rs * g``; per pool block ``D`` the pool's values in fp16,
    ``rs'`` the fp8 pool's scale or 1. Then ``score = rs' * (q @ D^T) + q_rope @ rope``, and
    with the block's max score m_b and largest ``rs'`` rmax, ``pw = fp16(exp(score - m_b) *
    rs' / rmax)`` enters ``out += exp(m_b - M) * rmax * (pw @ D)``, ``l += exp(m_b - M) *
    sum(exp(score - m_b))``."""
    bits = layout.field("codes").bits
    f = ref.record_tensors(packed, layout)
    q_rot = hadamard(q[..., :512].to(torch.float64))
    q_rope = q[..., 512:].to(torch.float64)
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for r in range(q.shape[0]):
        n = int(seq[r])
        parts = []  # (scores [H, v], D [v, 512], rs' [v])
        for i in range(-(-n // 64)):
            blk, v = int(bt[r, i]), min(64, n - 64 * i)
            pb = int(bmap[blk])
            if pb >= 0:
                d = f16(pool[0][pb, :v].to(torch.float64))
                rs = pool[1][pb, :v].double() if pool[1] is not None else torch.ones(v).double()
                rope = pool[2][pb, :v].to(torch.float64)
            else:
                cs = f["col_scale"][blk].to(torch.float64)
                zp = f["zero_point"][blk].to(torch.float64)
                g = tile_scale(cs, zp, bits)
                code = f["codes"][blk, :, :v].to(torch.float64)  # [512, v]
                d = f16(code * f16(cs / g)[:, None] + f16(zp / g)[:, None]).T
                rs = f["row_scale"][blk, :v].to(torch.float64) * g
                rope = f["rope"][blk, :v].to(torch.float64)
            s = (q_rot[r] @ d.T) * rs + q_rope[r] @ rope.T
            parts.append((s * scale, d, rs))
        m_all = torch.stack([s.amax(dim=1) for s, _, _ in parts], dim=1).amax(dim=1)
        acc = torch.zeros(q.shape[1], 512, dtype=torch.float64)
        den = torch.zeros(q.shape[1], dtype=torch.float64)
        for s, d, rs in parts:
            m_b = s.amax(dim=1)
            p = torch.exp(s - m_b[:, None])
            rmax = float(rs.max()) if float(rs.max()) > 0 else 1.0
            pw = f16(p * (rs / rmax))
            beta = torch.exp(m_b - m_all)[:, None]
            acc += beta * rmax * (pw @ d)
            den += beta[:, 0] * p.sum(dim=1)
        out[r] = hadamard(acc / den[:, None])
    return out


@pytest.fixture
def tile(monkeypatch):
    monkeypatch.setattr(kdec, "TILE_KERNEL", True)


def run_case(gen, bits, dtype, splits, ill=False, nrec=12, scale=0.05):
    """A sink and the filling tail in the pool, a partial packed block, two head groups (the
    second partial), splits that get several blocks or none."""
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool, _ = filled_pool(gen, 4, dtype)
    packed = torch.zeros(nrec, layout.record_bytes, dtype=torch.uint8)
    src = torch.arange(nrec).int() % 4
    ref.mla_pack(pool[0], pool[1], pool[2], src, torch.arange(nrec).int(), packed, layout)
    if ill:
        make_ill_conditioned(gen, packed, layout, [0, 1, 3, 5, 9])
    bmap = torch.full((nrec,), -1, dtype=torch.int32)
    bmap[7], bmap[2] = 3, 0  # block 7: request 0's sink; block 2: its filling tail
    bt = torch.tensor(
        [[7, 0, 5, 9, 1, 3, 10, 4, 2], [6, 11, 8, 0, 0, 0, 0, 0, 0]], dtype=torch.int32
    )
    seq = i32(8 * 64 + 37, 2 * 64 + 5)  # request 1 ends in a partial packed block
    b, h = 2, 18
    q = torch.randn(b, h, 576, generator=gen)
    o_ref = torch.empty(b, h, 512)
    ref.mla_decode(q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, scale, o_ref)
    o = torch.full((b, h, 512), float("nan"))
    ws = ref.mla_decode_workspace(b, h, splits)
    ws.part_out.fill_(float("nan"))  # rows of splits that read nothing must not be read
    kdec.mla_decode(q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, scale, o, ws)
    assert not bool(o.isnan().any())
    top = float(o_ref.abs().max())
    model = fp16_tile_decode(q, packed, bt, seq, bmap, pool, layout, scale)
    print(f"tile yardstick vs oracle: {float((model - o_ref).abs().max()) / top:.2e} * max")
    print(f"kernel vs yardstick: {float((o - model).abs().max()) / top:.2e} * max")
    assert_near_yardstick(o, model, top)
    assert_near_oracle(o, model, o_ref, top)


@pytest.mark.parametrize(
    "bits,dtype,splits", [(4, BF16, 2), (4, FP8, 3), (5, FP8, 1), (2, BF16, 2), (3, FP8, 2)]
)
def test_tile_decode_matches_yardstick_and_oracle(gen, tile, bits, dtype, splits):
    run_case(gen, bits, dtype, splits)


@pytest.mark.parametrize("bits", [4, 5])
def test_tile_decode_ill_conditioned_latents(gen, tile, bits):
    """Records whose zero-point term cancels the code term but for fp16 rounding: the tile
    holds the dequantized value (one rounding of the exact ``code * cs + zp``), so the
    cancellation costs nothing."""
    run_case(gen, bits, BF16, 2, ill=True)


def test_tile_decode_scales_out_of_fp16_range(gen, tile):
    """Records scaled by 2^12 and 2^-20 (channel scales and zero points past fp16's largest
    value once multiplied by the codes, or subnormal): the power-of-two tile scale keeps the
    fp16 tile normal, so the error stays the yardstick's."""
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    for k in (12, -20):
        pool, _ = filled_pool(gen, 2, BF16)
        packed = torch.zeros(4, layout.record_bytes, dtype=torch.uint8)
        ref.mla_pack(pool[0], pool[1], pool[2], i32(0, 1, 0, 1), torch.arange(4).int(), packed,
                     layout)  # fmt: skip
        cso, zpo = layout.field("col_scale").offset, layout.field("zero_point").offset
        for off in (cso, zpo):
            v = packed[:, off : off + 1024].view(torch.float16).double() * 2.0**k
            packed[:, off : off + 1024] = v.to(torch.float16).view(torch.uint8)
        bmap = i32(-1, -1, -1, -1)
        bt, seq = i32(0, 1, 2, 3).view(1, 4), i32(4 * 64)
        q = torch.randn(1, 16, 576, generator=gen) * (2.0**-k / 16)
        o_ref = torch.empty(1, 16, 512)
        args = (q, packed, bt, seq, bmap, pool[0], pool[1], pool[2], layout, 0.05)
        ref.mla_decode(*args, o_ref)
        o = torch.full((1, 16, 512), float("nan"))
        kdec.mla_decode(*args, o, ref.mla_decode_workspace(1, 16, 2))
        top = float(o_ref.abs().max())
        model = fp16_tile_decode(q, packed, bt, seq, bmap, pool, layout, 0.05)
        assert_near_yardstick(o, model, top)
        assert_near_oracle(o, model, o_ref, top)
