"""MLA decode main kernel that dequantizes each latent tile once and puts the tokens on the
MMA's M axis: full-context decode (no ``indices``), every code width, Triton.

The other two kernels (``mla_decode.py``, ``mla_decode_mma.py``) keep the 16 heads on the
MMA's M axis (``mma.sync`` m16) and fold the channel scales into the query, so the codes
reach the tensor cores as exact small integers; but the code tile is then a B operand in two
orientations (channels x tokens for the scores, tokens x channels for the values), unpacked
twice per block, and the scale products, the cross-warp score sums and the softmax cost more
instructions per block than the unpack (Nsight Compute: about 2,700 per warp and block, a
latency-bound loop at 14-18% of copy bandwidth on the H200).

Here one program (one request, one split of its 64-token blocks, 16 heads) turns each block
into the fp16 tile ``DT[d, t] = code * cs[d] + zp[d]`` (``[512, 64]``, one packed fp16 fma per
two elements, exact but for its one rounding) and multiplies it twice, as the A operand of
two transposed products whose M is 64 tokens and 512 channels (Hopper: ``wgmma`` from shared
memory; the tile is stored once):

    S[t, h]  = rs[t] * (DT^T @ q^T)[t, h] + (rope @ q_rope^T)[t, h]      (M = 64 tokens)
    O^T[d, h] += (DT @ pw)[d, h],   pw[t, h] = fp16(p[t, h] * rs[t] / rmax)   (M = 512)

``q`` (rotated latent query times the softmax scale in base 2) enters as two fp16 parts
``hi + lo`` (about 2^-22), the RoPE query as two bf16 parts, so the only roundings besides
fp32 arithmetic are the tile's fp16 values and the softmax weights ``pw`` (test yardstick:
``fp16_tile_decode`` in the tests). Per block the tile is scaled by a power of two ``g`` (the
largest ``|zp| + (2^b - 1) |cs|`` of the block brought to [1, 2)) so that no record's scales
overflow or underflow fp16; ``rs`` carries ``g`` back.

Exact-pool blocks (the filling tail, sinks, rehydrated blocks) take the same products on their
rows converted to fp16 (fp8 pools exact, with the per-token scale as ``rs``; bf16 pools rounded
to fp16, ``rs = 1``).

The next packed block's code words, scales and RoPE rows are loaded while the current one is
computed (register prefetch). Partial rows and natural-log log-sum-exps go to the workspace
of ``mla_decode``, merged by its combine kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn_ops.kernels._common import f16_parts, pow2
from kvarn_ops.kernels.mla_common import bf16_bits_to_f32
from kvarn_ops.kernels.mla_decode import _chunk_codes, _chunk_words, _column_token, _pair_token

__all__ = ["mla_tile_kernel"]


@triton.jit
def _fma_f16(c, s, z, ASM: tl.constexpr):
    """``fp16(c * s + z)`` for fp16 ``c, s, z`` (broadcast), one rounding: ``fma.rn.f16x2``
    on the GPU; the interpreter twin computes in fp64 (exact here) and rounds once."""
    c, s = tl.broadcast(c, s)
    c, z = tl.broadcast(c, z)
    if ASM:
        return tl.inline_asm_elementwise(
            asm="fma.rn.f16x2 $0, $1, $2, $3;",
            constraints="=r,r,r,r",
            args=[c, s, z],
            dtype=tl.float16,
            is_pure=True,
            pack=2,
        )
    else:
        return (c.to(tl.float64) * s.to(tl.float64) + z.to(tl.float64)).to(tl.float16)


@triton.jit
def _f16(bits):
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _pow2_floor(x):
    """The power of two ``g`` with ``x / g`` in [1, 2), for a finite fp32 ``x >= 2^-126`` (1
    for 0)."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return pow2(tl.where(x > 0.0, e, 0))




@triton.jit
def _chan_top(cs, zp, BITS: tl.constexpr):
    """Largest ``|zp| + (2^b - 1) |cs|`` of a chunk's channels (fp32): the tile's scale ``g``
    brings the largest of the record into [1, 2)."""
    return tl.max(tl.abs(zp.to(tl.float32)) + ((1 << BITS) - 1) * tl.abs(cs.to(tl.float32)), 0)


@triton.jit
def _words(rec32_ptr, base, ok, C: tl.constexpr, W: tl.constexpr):
    """Code words ``[128, W]`` of channels ``[128 C, 128 C + 128)`` (zeros when not ``ok``)."""
    d = C * 128 + tl.arange(0, 128)
    return tl.load(rec32_ptr + base // 4 + d[:, None] * W + tl.arange(0, W)[None, :], mask=ok,
                   other=0)  # fmt: skip


@triton.jit
def _chan(rb16, OFF: tl.constexpr, C: tl.constexpr):
    """fp16 channel field at byte ``OFF`` of a record, channels ``[128 C, 128 C + 128)``."""
    return _f16(tl.load(rb16 + OFF // 2 + C * 128 + tl.arange(0, 128)))


@triton.jit
def _tile(w, cs, zp, gi, rec32_ptr, base, C: tl.constexpr, BITS: tl.constexpr,
          FAST: tl.constexpr, ASM: tl.constexpr, FMA_ASM: tl.constexpr):  # fmt: skip
    """fp16 ``(code * cs + zp) / g`` of chunk ``C``, ``[128, 64]`` (tokens in the unpack's
    column order), one rounding: ``cs / g`` and ``zp / g`` are exact (``gi = 1 / g`` a power of
    two that keeps them normal)."""
    codes = _chunk_codes(w, rec32_ptr, base, C, 128, BITS, FAST, ASM, "", 0)
    csg = (cs.to(tl.float32) * gi).to(tl.float16)
    zpg = (zp.to(tl.float32) * gi).to(tl.float16)
    return _fma_f16(codes, csg[:, None], zpg[:, None], FMA_ASM)


@triton.jit
def _pool_tile(pool_ptr, row, okt, C: tl.constexpr):
    """Exact-pool rows ``row`` as an fp16 tile ``[128 channels of chunk C, 64 tokens]``."""
    d = C * 128 + tl.arange(0, 128)
    lat = tl.load(pool_ptr + row[None, :] * 512 + d[:, None], mask=okt[None, :], other=0.0)
    return lat.to(tl.float16)


@triton.jit
def _scores(s, DT, q_hi, q_lo):
    DTt = tl.trans(DT)
    return tl.dot(DTt, tl.trans(q_lo), tl.dot(DTt, tl.trans(q_hi), s))


@triton.jit
def _values(acc, DT, pw, alpha, ws):
    return acc * alpha[None, :] + tl.dot(DT, pw) * ws[None, :]


@triton.jit
def _softmax(s, rs, rope, okt, gq, qr_hi, qr_lo, m, l, ASM: tl.constexpr):
    """Scores ``[64, 16]`` (tokens x heads) of a block from the latent product ``s`` (times
    the row scales ``rs``, 0 past the valid tokens, and the query's scale ``gq``) plus the RoPE
    product (int16 bits of bf16 rows; two bf16 MMAs on the GPU, one fp32 product in the
    interpreter, whose bf16 dots are not exact), then one online-softmax step (base 2): new
    ``m``, ``l``, the accumulators' factor ``alpha``, the value operand ``pw = fp16(p * rs /
    rmax)`` and its weight ``beta * rmax``."""
    s = s * (rs * gq)[:, None]
    if ASM:
        rope = rope.to(tl.bfloat16, bitcast=True)
        s = tl.dot(rope, tl.trans(qr_hi.to(tl.bfloat16)), s)
        s = tl.dot(rope, tl.trans(qr_lo.to(tl.bfloat16)), s)
    else:
        s = tl.dot(bf16_bits_to_f32(rope), tl.trans(qr_hi + qr_lo), s)
    s = tl.where(okt[:, None], s, float("-inf"))
    # at least one valid token: m_blk is finite
    m_blk = tl.max(s, axis=0)
    m_new = tl.maximum(m, m_blk)
    alpha = tl.exp2(m - m_new)
    beta = tl.exp2(m_blk - m_new)
    p = tl.exp2(s - m_blk[None, :])
    rmax = tl.max(rs, axis=0)
    rmax = tl.where(rmax > 0.0, rmax, 1.0)
    pw = (p * (rs / rmax)[:, None]).to(tl.float16)
    l = l * alpha + beta * tl.sum(p, axis=0)
    return m_new, l, alpha, pw, beta * rmax


@triton.jit
def mla_tile_kernel(
    q_ptr,
    qrot_ptr,
    rec16_ptr,
    rec32_ptr,
    map_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    bt_ptr,
    seq_ptr,
    po_ptr,
    plse_ptr,
    H,
    S,
    bt_stride,
    max_blocks,
    qk_scale,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
    ASM: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    FMA_ASM: tl.constexpr,
    ROPE16: tl.constexpr,
):
    """Grid ``(B, splits, ceil(H / 16))``: split ``program_id(1)`` of request
    ``program_id(0)``'s blocks for 16 heads; writes normalized partial rows and natural-log
    log-sum-exps to the workspace of ``mla_decode``. ``qk_scale``: softmax scale times
    log2(e)."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    h = tl.program_id(2) * 16 + tl.arange(0, 16)
    hok = h < H
    qrow = b * H + tl.where(hok, h, 0)
    prow = qrow * S + split
    seq_len = tl.load(seq_ptr + b)
    n_blk = tl.minimum(tl.cdiv(seq_len, 64), max_blocks)
    per = tl.maximum(tl.cdiv(n_blk, num_splits), MIN_BLOCKS)
    lo = split * per
    hi = tl.minimum(lo + per, n_blk)
    if lo >= hi:
        # nothing to read: the combine skips this split's (unwritten) partial row
        tl.store(plse_ptr + prow, tl.full([16], float("-inf"), tl.float32), mask=hok)
        return
    c = tl.arange(0, 128)
    r = tl.arange(0, 64)
    tok = tl.arange(0, 64)
    FAST: tl.constexpr = (8 % BITS) == 0
    W: tl.constexpr = 2 * BITS if FAST else 1
    if FAST:
        tokc = _column_token(tok, 8 // BITS)  # token of each column of the unpacked tile
    elif BITS == 3 or BITS == 5:
        tokc = _pair_token(tok)
    else:
        tokc = tok
    # Queries in four chunks of 128 latent channels [16, 128] (B operands transposed): two fp16 parts of
    # q / gq, gq the power of two bringing max |q| into [1, 2) (queries far from fp16's normal
    # range lose nothing; the scores take gq back). RoPE [16, 64], two bf16 parts.
    qp = qrot_ptr + qrow[:, None] * 512 + c[None, :]
    q0 = tl.load(qp, mask=hok[:, None], other=0.0) * qk_scale
    q1 = tl.load(qp + 128, mask=hok[:, None], other=0.0) * qk_scale
    q2 = tl.load(qp + 256, mask=hok[:, None], other=0.0) * qk_scale
    q3 = tl.load(qp + 384, mask=hok[:, None], other=0.0) * qk_scale
    qmax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), 1), tl.max(tl.abs(q1), 1)),
                      tl.maximum(tl.max(tl.abs(q2), 1), tl.max(tl.abs(q3), 1)))  # fmt: skip
    gq = _pow2_floor(tl.max(qmax, 0))
    q0h, q0l = f16_parts(q0 * (1.0 / gq))
    q1h, q1l = f16_parts(q1 * (1.0 / gq))
    q2h, q2l = f16_parts(q2 * (1.0 / gq))
    q3h, q3l = f16_parts(q3 * (1.0 / gq))
    qr = tl.load(q_ptr + qrow[:, None] * 576 + 512 + r[None, :], mask=hok[:, None], other=0.0)
    qr = qr.to(tl.float32) * qk_scale
    qr_hi = qr.to(tl.bfloat16).to(tl.float32)
    qr_lo = qr - qr_hi
    m = tl.full([16], float("-inf"), tl.float32)
    l = tl.zeros([16], tl.float32)
    a0 = tl.zeros([128, 16], tl.float32)
    a1 = tl.zeros([128, 16], tl.float32)
    a2 = tl.zeros([128, 16], tl.float32)
    a3 = tl.zeros([128, 16], tl.float32)
    bt_row = bt_ptr + b * bt_stride
    blk = tl.load(bt_row + lo)
    pb = tl.load(map_ptr + blk)
    base = blk.to(tl.int64) * REC
    w0 = blk  # no word tiles for the widths that read their own
    w1 = blk
    w2 = blk
    w3 = blk
    if FAST:
        w0 = _words(rec32_ptr, base, pb < 0, 0, W)
        w1 = _words(rec32_ptr, base, pb < 0, 1, W)
        w2 = _words(rec32_ptr, base, pb < 0, 2, W)
        w3 = _words(rec32_ptr, base, pb < 0, 3, W)
    for u in range(lo, hi):
        # prefetch: the next packed block's code words (none for a pool block or past the
        # split; its scales and RoPE rows are loaded at the top of its step)
        blk_n = tl.load(bt_row + tl.minimum(u + 1, hi - 1))
        pb_n = tl.load(map_ptr + blk_n)
        base_n = blk_n.to(tl.int64) * REC
        ok_n = (pb_n < 0) & (u + 1 < hi)
        if FAST:
            w0_n = _words(rec32_ptr, base_n, ok_n, 0, W)
            w1_n = _words(rec32_ptr, base_n, ok_n, 1, W)
            w2_n = _words(rec32_ptr, base_n, ok_n, 2, W)
            w3_n = _words(rec32_ptr, base_n, ok_n, 3, W)
        valid = tl.minimum(seq_len - u * 64, 64)
        s = tl.zeros([64, 16], tl.float32)
        if pb >= 0:
            row = pb.to(tl.int64) * 64 + tok
            okt = tok < valid
            if FP8:
                rs = tl.load(pscale_ptr + row, mask=okt, other=0.0)
            else:
                rs = tl.where(okt, 1.0, 0.0)
            rope = tl.load(prope_ptr + row[:, None] * 64 + r[None, :], mask=okt[:, None], other=0)
            s = _scores(s, _pool_tile(pool_ptr, row, okt, 0), q0h, q0l)
            s = _scores(s, _pool_tile(pool_ptr, row, okt, 1), q1h, q1l)
            s = _scores(s, _pool_tile(pool_ptr, row, okt, 2), q2h, q2l)
            s = _scores(s, _pool_tile(pool_ptr, row, okt, 3), q3h, q3l)
            m, l, alpha, pw, ws = _softmax(s, rs, rope, okt, gq, qr_hi, qr_lo, m, l, ROPE16)
            a0 = _values(a0, _pool_tile(pool_ptr, row, okt, 0), pw, alpha, ws)
            a1 = _values(a1, _pool_tile(pool_ptr, row, okt, 1), pw, alpha, ws)
            a2 = _values(a2, _pool_tile(pool_ptr, row, okt, 2), pw, alpha, ws)
            a3 = _values(a3, _pool_tile(pool_ptr, row, okt, 3), pw, alpha, ws)
        else:
            okt = tokc < valid
            rb16 = rec16_ptr + base // 2
            cs0 = _chan(rb16, CS_OFF, 0)
            cs1 = _chan(rb16, CS_OFF, 1)
            cs2 = _chan(rb16, CS_OFF, 2)
            cs3 = _chan(rb16, CS_OFF, 3)
            zp0 = _chan(rb16, ZP_OFF, 0)
            zp1 = _chan(rb16, ZP_OFF, 1)
            zp2 = _chan(rb16, ZP_OFF, 2)
            zp3 = _chan(rb16, ZP_OFF, 3)
            rs = _f16(tl.load(rb16 + RS_OFF // 2 + tokc))
            rope = tl.load(rb16 + ROPE_OFF // 2 + tokc[:, None] * 64 + r[None, :])
            top = tl.maximum(
                tl.maximum(_chan_top(cs0, zp0, BITS), _chan_top(cs1, zp1, BITS)),
                tl.maximum(_chan_top(cs2, zp2, BITS), _chan_top(cs3, zp3, BITS)),
            )
            g = _pow2_floor(top)
            gi = 1.0 / g  # exact: a power of two
            rs = tl.where(okt, rs.to(tl.float32) * g, 0.0)
            s = _scores(s, _tile(w0, cs0, zp0, gi, rec32_ptr, base, 0, BITS, FAST, ASM, FMA_ASM), q0h, q0l)
            s = _scores(s, _tile(w1, cs1, zp1, gi, rec32_ptr, base, 1, BITS, FAST, ASM, FMA_ASM), q1h, q1l)
            s = _scores(s, _tile(w2, cs2, zp2, gi, rec32_ptr, base, 2, BITS, FAST, ASM, FMA_ASM), q2h, q2l)
            s = _scores(s, _tile(w3, cs3, zp3, gi, rec32_ptr, base, 3, BITS, FAST, ASM, FMA_ASM), q3h, q3l)
            m, l, alpha, pw, ws = _softmax(s, rs, rope, okt, gq, qr_hi, qr_lo, m, l, ROPE16)
            # the same tiles again, from the words still in registers (the widths that read
            # their own words read them again: cache hits)
            a0 = _values(a0, _tile(w0, cs0, zp0, gi, rec32_ptr, base, 0, BITS, FAST, ASM, FMA_ASM), pw,
                         alpha, ws)  # fmt: skip
            a1 = _values(a1, _tile(w1, cs1, zp1, gi, rec32_ptr, base, 1, BITS, FAST, ASM, FMA_ASM), pw,
                         alpha, ws)  # fmt: skip
            a2 = _values(a2, _tile(w2, cs2, zp2, gi, rec32_ptr, base, 2, BITS, FAST, ASM, FMA_ASM), pw,
                         alpha, ws)  # fmt: skip
            a3 = _values(a3, _tile(w3, cs3, zp3, gi, rec32_ptr, base, 3, BITS, FAST, ASM, FMA_ASM), pw,
                         alpha, ws)  # fmt: skip
        blk = blk_n
        pb = pb_n
        base = base_n
        if FAST:
            w0 = w0_n
            w1 = w1_n
            w2 = w2_n
            w3 = w3_n
    inv = 1.0 / tl.where(l > 0.0, l, 1.0)
    po = po_ptr + prow[None, :] * 512 + c[:, None]
    tl.store(po, a0 * inv[None, :], mask=hok[None, :])
    tl.store(po + 128, a1 * inv[None, :], mask=hok[None, :])
    tl.store(po + 256, a2 * inv[None, :], mask=hok[None, :])
    tl.store(po + 384, a3 * inv[None, :], mask=hok[None, :])
    lse = tl.where(l > 0.0, (m + tl.log2(tl.where(l > 0.0, l, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(plse_ptr + prow, lse, mask=hok)
