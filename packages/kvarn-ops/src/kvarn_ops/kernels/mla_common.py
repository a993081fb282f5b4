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

from kvarn_ops.kernels._common import (
    abs_max,
    clamp_e4m3,
    round_to_bf16,
    round_to_e4m3,
    to_e4m3,
)

__all__ = [
    "bf16_bits_to_f32",
    "field_offsets",
    "latent_cols",
    "pair_codes_f16",
    "phase_token",
    "pool_cast",
    "pool_round",
    "token_mask_rows",
    "token_rope",
    "token_sources",
    "window_codes_f16",
    "words_to_codes_f16",
]

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
        amax = abs_max(y, 1)  # NaN for a token holding NaN: scale 1.0, as the reference
        scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
        q = tl.div_rn(y, tl.broadcast_to(scale[:, None], y.shape))
        q = round_to_e4m3(clamp_e4m3(q))
        return q, scale
    else:
        return round_to_bf16(y), tl.full([y.shape[0]], 1.0, tl.float32)


@triton.jit
def pool_cast(vals, FP8: tl.constexpr, dtype: tl.constexpr):
    """:func:`pool_round`'s values as the pool's element type (fp8: NaN kept as NaN)."""
    if FP8:
        return to_e4m3(vals)
    else:
        return vals.to(dtype)


@triton.jit
def token_mask_rows(ok, N: tl.constexpr):
    return tl.broadcast_to(ok[:, None], [ok.shape[0], N])


@triton.jit
def token_sources(slot, ok, map_ptr, REC: tl.constexpr):
    """Where the tokens at physical ``slot [T]`` live: ``(in_pool, in_rec, pool row, record
    byte base, offset in the block)``. A token comes from its block's exact-pool rows when
    ``block_pool_map`` maps the block, else from the packed record; lanes with ``ok`` false are
    in neither."""
    slot = tl.where(ok, slot, 0)
    blk = slot // GROUP
    off = slot % GROUP
    pb = tl.load(map_ptr + blk, mask=ok, other=-1)
    in_pool = ok & (pb >= 0)
    in_rec = ok & (pb < 0)
    prow = tl.where(in_pool, pb, 0).to(tl.int64) * GROUP + off
    rbase = tl.where(in_rec, blk, 0).to(tl.int64) * REC
    return in_pool, in_rec, prow, rbase, off


@triton.jit
def latent_cols(
    in_pool,
    in_rec,
    prow,
    rbase,
    off,
    rec_ptr,
    rec16_ptr,
    pool_ptr,
    pscale_ptr,
    C0: tl.constexpr,
    CH: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    FP8: tl.constexpr,
):
    """Latent channels ``[C0, C0 + CH)`` (fp32 ``[T, CH]``, rotated frame) of the tokens
    located by :func:`token_sources` (zeros for tokens in neither). From a record:
    ``(code * col_scale[d] + zero_point[d]) * row_scale[t]`` in fp32 (the product
    code*col_scale is exact, so the result does not depend on FMA contraction)."""
    d = C0 + tl.arange(0, CH)
    pm = token_mask_rows(in_pool, CH)
    pv = tl.load(pool_ptr + prow[:, None] * LATENT + d[None, :], mask=pm, other=0.0)
    pv = pv.to(tl.float32)
    if FP8:
        pv = pv * tl.load(pscale_ptr + prow, mask=in_pool, other=1.0)[:, None]
    # packed records: code of (d, t) is stream index d*64 + t of the codes field
    rm = token_mask_rows(in_rec, CH)
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
    return tl.where(pm, pv, tl.where(rm, rv, 0.0))


@triton.jit
def token_rope(in_pool, in_rec, prow, rbase, off, rec16_ptr, prope_ptr, ROPE_OFF: tl.constexpr):
    """RoPE bits (int16 ``[T, 64]``, bf16 patterns) of the tokens located by
    :func:`token_sources`, from int16 views of the pool and of the records (zeros for tokens
    in neither)."""
    r = tl.arange(0, ROPE)
    pr = tl.load(
        prope_ptr + prow[:, None] * ROPE + r[None, :], mask=token_mask_rows(in_pool, ROPE), other=0
    )
    rr = tl.load(
        rec16_ptr + rbase[:, None] // 2 + ROPE_OFF // 2 + off[:, None] * ROPE + r[None, :],
        mask=token_mask_rows(in_rec, ROPE),
        other=0,
    )
    return tl.where(token_mask_rows(in_pool, ROPE), pr, rr)


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bit patterns of bf16 values as exact fp32 values."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def phase_token(c, NP: tl.constexpr, PHASE: tl.constexpr):
    """Token (code index inside its 64-code row) held by column ``c`` of the phase-``PHASE``
    tile of :func:`words_to_codes_f16`, for a width with ``NP = 8 / BITS`` codes per byte.

    The 4 columns of word ``j`` hold bytes 0, 2, 1, 3 of it (the order in which one 32-bit
    logic op yields two codes); byte ``k`` of a row holds codes ``k * NP .. k * NP + NP - 1``
    LSB first, and phase ``PHASE`` is the field at bit ``PHASE * BITS`` of each byte."""
    byte = (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)
    return byte * NP + PHASE


@triton.jit
def words_to_codes_f16(
    w, SHIFT: tl.constexpr, BITS: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr
):
    """Centered codes ``code - CENTER`` of a ``[M, W]`` int32 word tile as exact fp16 values,
    ``[M, 4 * W]``: column ``4 * j + i`` is the ``BITS``-bit field at bit ``SHIFT`` of byte
    ``(0, 2, 1, 3)[i]`` of word ``[m, j]`` (:func:`phase_token` names its token).

    Two fields are masked into the mantissas of two fp16 ``1024.0`` (bits 0x6400) by one
    32-bit logic op; one packed fp16 subtraction of ``1024 + CENTER`` (exact: the results are
    small integers) per two codes leaves the centered codes: no int-to-float conversion.
    ``ASM`` runs it in inline PTX (GPU); the plain twin (one code per op) runs in the
    interpreter; both give the same bits."""
    M: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    mask: tl.constexpr = (1 << BITS) - 1
    if ASM:
        m2: tl.constexpr = mask | (mask << 16)
        bias: tl.constexpr = (0x6400 + CENTER) | ((0x6400 + CENTER) << 16)
        # No scoped ``.reg`` temporaries: ptxas 12.8 compiled this kernel with them at 32
        # registers and kilobytes of spills; two scratch outputs (unused) serve instead.
        lo_a, hi_a, _t0, _o0 = tl.inline_asm_elementwise(
            asm=f"shr.u32 $2, $4, {SHIFT}; lop3.b32 $2, $2, {m2}, 1677747200, 0xea; "
            f"mov.b32 $3, {bias}; sub.f16x2 $2, $2, $3; mov.b32 {{$0, $1}}, $2;",
            constraints="=h,=h,=r,=r,r",
            args=[w],
            dtype=(tl.float16, tl.float16, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        lo_b, hi_b, _t1, _o1 = tl.inline_asm_elementwise(
            asm=f"shr.u32 $2, $4, {SHIFT + 8}; lop3.b32 $2, $2, {m2}, 1677747200, 0xea; "
            f"mov.b32 $3, {bias}; sub.f16x2 $2, $2, $3; mov.b32 {{$0, $1}}, $2;",
            constraints="=h,=h,=r,=r,r",
            args=[w],
            dtype=(tl.float16, tl.float16, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        # slots 0..3 of a word are lo_a, hi_a, lo_b, hi_b (bytes 0, 2, 1, 3): the two halves
        # of each PTX result stay adjacent in one thread's registers, the reshape moves nothing
        x = tl.join(tl.join(lo_a, lo_b), tl.join(hi_a, hi_b))
        return tl.reshape(x, [M, 4 * W])
    else:
        b0 = ((w >> SHIFT) & mask) | 0x6400
        b2 = ((w >> (16 + SHIFT)) & mask) | 0x6400
        b1 = ((w >> (8 + SHIFT)) & mask) | 0x6400
        b3 = ((w >> (24 + SHIFT)) & mask) | 0x6400
        x = tl.join(tl.join(b0, b1), tl.join(b2, b3))
        x = tl.reshape(x, [M, 4 * W]).to(tl.int16).to(tl.float16, bitcast=True)
        return x - (1024.0 + CENTER)


@triton.jit
def pair_codes_f16(
    lo, hi, SH: tl.constexpr, BITS: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr
):
    """Centered codes ``code - CENTER`` (exact fp16) of the two ``BITS``-bit fields of the
    32-bit window at bit ``SH`` of the int32 word pairs ``(lo, hi)`` (same-shape tiles; ``hi``
    is the word after ``lo``, read only when the window straddles them; ``SH < 0`` shifts
    ``lo`` left): field ``A`` at window bit ``P`` and field ``B = A + 4`` (4 codes later) at
    window bit ``16 + Q``, with ``(P, Q) = (0, 4)`` for 5 bits and ``(4, 0)`` for 3 bits.

    One 32-bit logic op masks both fields into the mantissas of two fp16 ``1024.0`` (0x6400),
    i.e. ``1024 + code * 2^P`` and ``1024 + code * 2^Q``; one packed fp16 fma by
    ``2^-P | 2^-Q`` less ``1024 * 2^-P + CENTER | 1024 * 2^-Q + CENTER`` leaves the centered
    codes (exact: powers of two times small integers). ``ASM``: inline PTX (GPU); the plain
    twin (interpreter) gives the same bits."""
    P: tl.constexpr = 4 if BITS == 3 else 0
    Q: tl.constexpr = 4 * BITS - 16 + P
    mask: tl.constexpr = (1 << BITS) - 1
    if ASM:
        m2: tl.constexpr = (mask << P) | (mask << (16 + Q))
        sc_lo: tl.constexpr = 0x3C00 - (P << 10)  # fp16 2^-P
        sc_hi: tl.constexpr = 0x3C00 - (Q << 10)
        # fp16 bits of -(1024 * 2^-P + CENTER) and -(1024 * 2^-Q + CENTER): exact integers
        # below 2048, so the mantissa is the integer's bits below its leading one.
        n_lo: tl.constexpr = (1024 >> P) + CENTER
        n_hi: tl.constexpr = (1024 >> Q) + CENTER
        e_lo: tl.constexpr = n_lo.bit_length() - 1
        e_hi: tl.constexpr = n_hi.bit_length() - 1
        b_lo: tl.constexpr = 0x8000 | ((e_lo + 15) << 10) | ((n_lo << (10 - e_lo)) & 0x3FF)
        b_hi: tl.constexpr = 0x8000 | ((e_hi + 15) << 10) | ((n_hi << (10 - e_hi)) & 0x3FF)
        if SH < 0:
            win: tl.constexpr = f"shl.b32 $2, $5, {-SH}; "
        elif SH == 0:
            win: tl.constexpr = "mov.b32 $2, $5; "  # type: ignore[no-redef]
        elif SH + 16 + Q + BITS <= 32:
            win: tl.constexpr = f"shr.u32 $2, $5, {SH}; "  # type: ignore[no-redef]
        else:
            win: tl.constexpr = f"shf.r.clamp.b32 $2, $5, $6, {SH}; "  # type: ignore[no-redef]
        a, b, _t, _s, _b = tl.inline_asm_elementwise(
            asm=win + f"lop3.b32 $2, $2, {m2}, 1677747200, 0xea; "
            f"mov.b32 $3, {sc_lo | (sc_hi << 16)}; mov.b32 $4, {b_lo | (b_hi << 16)}; "
            "fma.rn.f16x2 $2, $2, $3, $4; mov.b32 {$0, $1}, $2;",
            constraints="=h,=h,=r,=r,=r,r,r",
            args=[lo, hi],
            dtype=(tl.float16, tl.float16, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        return a, b
    else:
        ulo = lo.to(tl.uint32, bitcast=True)
        if SH < 0:
            v = ulo << (-SH)
        elif SH == 0:
            v = ulo
        else:
            v = (ulo >> SH) | (hi.to(tl.uint32, bitcast=True) << (32 - SH))
        a = ((v >> P) & mask) | 0x6400
        b = ((v >> (16 + Q)) & mask) | 0x6400
        a = a.to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + CENTER)
        b = b.to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + CENTER)
        return a, b


@triton.jit
def window_codes_f16(row32, t, BITS: tl.constexpr, CENTER: tl.constexpr, EVICT: tl.constexpr = ""):
    """Centered codes ``code - CENTER`` (exact fp16) of tokens ``t [T]`` of the 64-code rows
    starting at the int32 pointers ``row32 [M]`` (any width; a code may straddle two words).

    Reads the two aligned words around each code; the word after a record's last code row is
    still inside the record (the scale fields follow the codes). ``EVICT``: the loads' eviction
    policy (a second read of the same words with another policy is not merged with the first
    by the compiler)."""
    bit = t * BITS
    wi = bit >> 5
    sh = (bit & 31).to(tl.uint32)
    lo = tl.load(row32[:, None] + wi[None, :], eviction_policy=EVICT).to(tl.uint32, bitcast=True)
    hi = tl.load(row32[:, None] + wi[None, :] + 1, eviction_policy=EVICT)
    hi = hi.to(tl.uint32, bitcast=True)
    v = (lo >> sh[None, :]) | ((hi << 1) << (31 - sh[None, :]))
    code = (v & ((1 << BITS) - 1)) | 0x6400
    return code.to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + CENTER)


def pool_views(pool_latent, pool_scale, pool_rope):
    """Kernel arguments of the pool: latent (native dtype), scale (or a dummy), rope as int16."""
    fp8 = pool_latent.dtype == torch.float8_e4m3fn
    return pool_latent, (pool_scale if fp8 else pool_latent), pool_rope.view(torch.int16), fp8


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)
