"""Jit helpers of the MLA pack kernels: one program per block (``mla_pack.py``) and a block's
channels split over several programs (``mla_pack_split.py``).

The latent tile is the dense K orientation ``x[d, t]``: 512 channels (rows) by 64 tokens
(columns), rounded per channel by min/max RTN (``MLA_CONFIG``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn_ops.kernels._common import fp16_balance_shift, pow2, round_half_even

__all__ = ["copy_rope", "load_rows", "rtn_rows", "store_code_rows", "store_scales"]


@triton.jit
def load_rows(pool_ptr, pscale_ptr, src, d, t, FP8: tl.constexpr):
    """Channels ``d`` of tokens ``t`` of pool block ``src`` as fp32 ``[len(d), len(t)]``
    (times the token's scale for an fp8 pool)."""
    x = tl.load(pool_ptr + (src * 64 + t[None, :]) * 512 + d[:, None]).to(tl.float32)
    if FP8:
        x = x * tl.load(pscale_ptr + src * 64 + t)[None, :]
    return x


@triton.jit
def rtn_rows(b, LEVELS: tl.constexpr):
    """Min/max RTN of every row (channel) of the balanced tile ``b``: int32 codes, fp32 step
    and zero point per row."""
    lo = tl.min(b, axis=1)
    rng = tl.max(b, axis=1) - lo
    # The reference's ``levels / rng`` is torch's reversed division: reciprocal(rng) * levels
    # (two IEEE roundings, on every device).
    ones = tl.full(rng.shape, 1.0, tl.float32)
    inv = tl.where(rng > 0.0, tl.div_rn(ones, tl.where(rng > 0.0, rng, 1.0)) * LEVELS, 0.0)
    q = round_half_even((b - lo[:, None]) * inv[:, None])
    codes = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)
    step = tl.div_rn(rng, tl.full(rng.shape, LEVELS, tl.float32))
    return codes, step, lo


@triton.jit
def store_code_rows(ptr, codes, BITS: tl.constexpr, ROWS: tl.constexpr):
    """Bit-pack int32 ``codes [ROWS, 64]`` (values < 2**BITS) as stream ``d*64 + t`` at uint8
    ``ptr`` (the first row's byte), one store per byte and no reshape.

    Row ``d`` fills exactly the ``8*BITS`` bytes ``[d*8*BITS, (d+1)*8*BITS)``. Code ``t`` starts
    at bit ``o = BITS*t``: its low piece ``(code << o%8) & 0xFF`` belongs to byte ``o // 8`` of
    the row, its high piece ``code >> (8 - o%8)`` (0 unless the code straddles) to the next
    byte. Byte ``j`` of every row is the sum (= OR, the pieces hold disjoint bits) of the
    pieces that belong to it: one row reduction and one [ROWS] store per ``j``."""
    t = tl.arange(0, 64)
    d = tl.arange(0, ROWS)
    o = t * BITS
    first = o >> 3
    sh = o & 7
    lo_piece = (codes << sh[None, :]) & 0xFF
    hi_piece = codes >> (8 - sh)[None, :]
    ROW_BYTES: tl.constexpr = 8 * BITS
    for j in range(ROW_BYTES):
        piece = tl.where(first[None, :] == j, lo_piece, 0) + tl.where(
            first[None, :] + 1 == j, hi_piece, 0
        )
        byte = tl.sum(piece, axis=1)
        tl.store(ptr + d * ROW_BYTES + j, byte.to(tl.uint8))


@triton.jit
def store_scales(
    rec16_ptr,
    b16,
    s,
    z,
    lc,
    e,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
):
    """The record's fp16 fields of a tile from its folded channel scales ``s`` and zero points
    ``z`` ([512], prescaled units), token log scales ``lc`` [64] and prescale exponent ``e``:
    a power of two moved between the sides so every field stays normal where possible
    (reference step 6). ``b16``: the record's first int16."""
    d = tl.arange(0, 512)
    t = tl.arange(0, 64)
    w = tl.exp(lc)
    j = fp16_balance_shift(s, z, w, e)
    tl.store(
        rec16_ptr + b16 + CS_OFF // 2 + d,
        (s * pow2(e + j)).to(tl.float16).to(tl.int16, bitcast=True),
    )
    tl.store(
        rec16_ptr + b16 + ZP_OFF // 2 + d,
        (z * pow2(e + j)).to(tl.float16).to(tl.int16, bitcast=True),
    )
    tl.store(
        rec16_ptr + b16 + RS_OFF // 2 + t, (w * pow2(-j)).to(tl.float16).to(tl.int16, bitcast=True)
    )


@triton.jit
def copy_rope(prope_ptr, rec16_ptr, src, b16, ROPE_OFF: tl.constexpr):
    """RoPE: a bit copy of pool block ``src``'s rows into the record at int16 ``b16``."""
    t = tl.arange(0, 64)
    rr = tl.arange(0, 64)
    rope = tl.load(prope_ptr + (src * 64 + t[:, None]) * 64 + rr[None, :])
    tl.store(rec16_ptr + b16 + ROPE_OFF // 2 + t[:, None] * 64 + rr[None, :], rope)
