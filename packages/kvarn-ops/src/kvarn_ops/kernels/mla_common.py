"""Jit helpers and launcher checks shared by the MLA kernels (mla_scatter, mla_pack,
mla_gather, mla_decode).

Reuses the dense helpers of ``kvarn_ops.kernels._common`` (Hadamard rows, exact bf16/e4m3
rounding, bit (un)packing). Everything runs compiled and under ``TRITON_INTERPRET=1``: values
are upcast to fp32 right after loading, and every address is formed from clamped indices, so
masked lanes never point outside their tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import round_to_bf16, round_to_e4m3

__all__ = ["field_offsets", "load_tokens", "pool_round", "token_mask_rows"]

LATENT = tl.constexpr(512)
ROPE = tl.constexpr(64)
GROUP = tl.constexpr(64)


def field_offsets(layout) -> dict:
    """Byte offsets and the code width of an MLA layout, as launch constants."""
    return {
        "BITS": layout.field("codes").bits,
        "CS_OFF": layout.field("col_scale").offset,
        "ZP_OFF": layout.field("zero_point").offset,
        "RS_OFF": layout.field("row_scale").offset,
        "ROPE_OFF": layout.field("rope").offset,
        "REC": layout.record_bytes,
    }


@triton.jit
def pool_round(y, FP8: tl.constexpr):
    """Rotated fp32 latents ``y [M, 512]`` rounded as the pool stores them: returns
    ``(values fp32 on the pool grid, per-token scale fp32 [M])``. fp8: scale = amax/448 (1.0
    when amax is 0), values = e4m3(clamp(y/scale)); bf16: values rounded to bf16, scale 1."""
    if FP8:
        amax = tl.max(tl.abs(y), axis=1)
        scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
        q = tl.div_rn(y, tl.broadcast_to(scale[:, None], y.shape))
        q = round_to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
        return q, scale
    else:
        return round_to_bf16(y), tl.full([y.shape[0]], 1.0, tl.float32)


@triton.jit
def token_mask_rows(ok, N: tl.constexpr):
    return tl.broadcast_to(ok[:, None], [ok.shape[0], N])


@triton.jit
def load_tokens(
    slot,
    ok,
    rec_ptr,
    rec16_ptr,
    map_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    BLOCK_T: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
):
    """Latent (fp32 ``[BLOCK_T, 512]``, rotated frame) and RoPE bits (int16 ``[BLOCK_T, 64]``)
    of the tokens at physical ``slot [BLOCK_T]`` (lanes with ``ok`` false return zeros).

    A token comes from its block's exact-pool rows when ``block_pool_map`` maps the block, else
    from the packed record: ``(code * col_scale[d] + zero_point[d]) * row_scale[t]`` (fp32; the
    product code*col_scale is exact, so the result does not depend on FMA contraction)."""
    d = tl.arange(0, LATENT)
    r = tl.arange(0, ROPE)
    slot = tl.where(ok, slot, 0)
    blk = slot // GROUP
    off = slot % GROUP
    pb = tl.load(map_ptr + blk, mask=ok, other=-1)
    in_pool = ok & (pb >= 0)
    in_rec = ok & (pb < 0)
    prow = tl.where(in_pool, pb, 0).to(tl.int64) * GROUP + off
    rbase = tl.where(in_rec, blk, 0).to(tl.int64) * REC
    # pool rows
    pm = token_mask_rows(in_pool, LATENT)
    pv = tl.load(pool_ptr + prow[:, None] * LATENT + d[None, :], mask=pm, other=0.0)
    pv = pv.to(tl.float32)
    if FP8:
        pv = pv * tl.load(pscale_ptr + prow, mask=in_pool, other=1.0)[:, None]
    # packed records: code of (d, t) is stream index d*64 + t of the codes field
    rm = token_mask_rows(in_rec, LATENT)
    bit = (d[None, :] * GROUP + off[:, None]) * BITS
    byte_ptr = rec_ptr + rbase[:, None] + (bit >> 3)
    lo = tl.load(byte_ptr, mask=rm, other=0).to(tl.int32)
    if BITS == 8:
        code = lo
    else:
        # The second byte is still inside the record (the col_scale field follows the codes).
        hi = tl.load(byte_ptr + 1, mask=rm, other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (bit & 7)) & ((1 << BITS) - 1)
    r16 = rbase // 2
    # rec16_ptr is an int16 view of the records: fp16 scales are bitcast after loading.
    cs = tl.load(rec16_ptr + r16[:, None] + CS_OFF // 2 + d[None, :], mask=rm, other=0)
    zp = tl.load(rec16_ptr + r16[:, None] + ZP_OFF // 2 + d[None, :], mask=rm, other=0)
    rs = tl.load(rec16_ptr + r16 + RS_OFF // 2 + off, mask=in_rec, other=0)
    cs = cs.to(tl.float16, bitcast=True)
    zp = zp.to(tl.float16, bitcast=True)
    rs = rs.to(tl.float16, bitcast=True)
    rv = (code.to(tl.float32) * cs.to(tl.float32) + zp.to(tl.float32)) * rs.to(tl.float32)[:, None]
    lat = tl.where(pm, pv, tl.where(rm, rv, 0.0))
    # RoPE bits: int16 views of the pool and of the records
    pr = tl.load(
        prope_ptr + prow[:, None] * ROPE + r[None, :], mask=token_mask_rows(in_pool, ROPE), other=0
    )
    rr = tl.load(
        rec16_ptr + r16[:, None] + ROPE_OFF // 2 + off[:, None] * ROPE + r[None, :],
        mask=token_mask_rows(in_rec, ROPE),
        other=0,
    )
    rope = tl.where(token_mask_rows(in_pool, ROPE), pr, rr)
    return lat, rope


def pool_views(pool_latent, pool_scale, pool_rope):
    """Kernel arguments of the pool: latent (native dtype), scale (or a dummy), rope as int16."""
    fp8 = pool_latent.dtype == torch.float8_e4m3fn
    return pool_latent, (pool_scale if fp8 else pool_latent), pool_rope.view(torch.int16), fp8


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)
