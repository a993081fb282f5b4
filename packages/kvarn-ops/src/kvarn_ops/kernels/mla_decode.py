"""mla_decode: attention of absorbed MLA queries ``[B, H, 576]`` over packed latent tiles plus
exact-pool rows, split-K, three launches with no host sync and no allocation:

1. ``_mla_qrot_kernel``: ``q_rot = q[..., :512] @ H_512`` into the workspace;
2. ``_mla_decode_kernel``, grid ``(B, splits, ceil(H / BLOCK_H))``: one program per (request,
   split, ``BLOCK_H`` heads) attends over its share of the request and writes a partial output
   and its log-sum-exp; a split with nothing to read writes lse = -inf only;
3. ``_mla_combine_kernel``: merges the live splits (partial rows of lse = -inf are not read)
   and rotates the output back by ``H_512``.

Splits: the launcher runs ``live_splits(B, H, S)`` of the workspace's ``S`` (no more than fill
the SMs ``CTAS_PER_SM`` programs deep; host arithmetic on shapes only, so a CUDA graph
captures it); the kernel gives each split ``max(ceil(n / splits), MIN_BLOCKS_PER_SPLIT)`` of
the request's ``n`` 64-token blocks (device-side, from ``seq_lens``).

Full context (no ``indices``): the loop walks whole blocks through the block table, software
pipelined (block u + 1's code words, channel scales and pool-map entry and block u + 2's table
entry are loaded while block u is computed). A block mapped to the exact pool (the filling
tail, sinks, rehydrated blocks) takes the pool path: its fp8/bf16 rows dequantized to fp32,
16 tokens per step, fp32 dots (tf32 on the GPU). A packed block never dequantizes: with the
record's ``x[d, t] = (code * cs[d] + zp[d]) * rs[t]`` (K orientation, code index ``d*64 + t``)
and centered codes ``c = code - 2^(b-1)``, ``zpc = zp + 2^(b-1) * cs``::

    score[t] = rs[t] * (cmax * ((q * cs / cmax) @ c)[t] + q @ zpc) + q_rope @ rope[t]
    out[d]  += cs[d] * (pw @ c^T)[d] + zpc[d] * sum(pw),   pw = exp(score - m_block) * rs / rmax

(``cmax = max |cs|``, ``rmax = max rs``, block-relative softmax weights rescaled into the
running accumulator by ``exp(m_block - m) * rmax``). Both products are fp16 tensor-core dots
with fp32 accumulation whose code operand is exact; the per-element work is an unpack. Codes
are loaded as int32 words, coalesced: for widths dividing 8 a word tile ``[512, 2b]`` is
unpacked by phase (the field at bit ``e * b`` of every byte: ``8 / b`` tiles ``[512, 8 * b]``)
by masking two fields per 32-bit op into the mantissas of fp16 1024.0 and one
packed fp16 subtraction (``mla_common.words_to_codes_f16``; inline PTX on the GPU, a plain twin
in the interpreter); a tile's columns are tokens in ``mla_common.phase_token`` order, and row
scales and RoPE rows are loaded in that order. Other widths (3, 5, 6, 7) read each code's
two-word window (``window_codes_f16``). The 16-bit operands are the only roundings besides
fp32 arithmetic (tests: ``fp16_operand_decode``).

Sparse (``indices``): each split walks its share of the selected entries 16 at a time,
gathering each token from its pool block or record (``mla_common.load_tokens``), fp32 dots.

Memory traffic: every selected token is read once (``R/64`` record bytes for a packed token,
``512*E + s + 128`` for a pool token; a request's pool blocks also read their stale record
once, and a split re-reads its last record once as the pipeline's overrun), ``q`` once,
``out`` written once, plus ``B*H*(512 + 1)*4`` partial bytes per live split written and read
once and the ``B*H*512*4`` rotated query.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import INTERPRET, cast_rne, check_device, rotate_rows
from kvarn_ops.kernels.mla_common import (
    bf16_bits_to_f32,
    field_offsets,
    load_tokens,
    phase_token,
    pool_views,
    window_codes_f16,
    words_to_codes_f16,
)
from kvarn_ops.reference.mla import (
    LATENT_DIM,
    MlaDecodeWorkspace,
    check_decode_args,
    mla_decode_workspace,
)

__all__ = ["mla_decode", "mla_decode_workspace"]

BLOCK_H = 16
"""Heads per program (the smallest tl.dot M; DeepSeek serves 16 or 128 heads per rank)."""
BLOCK_N = 16
"""Tokens per step of the sparse gather and of an exact-pool block (4 steps per block)."""
NUM_WARPS = 8
"""Warps of the decode kernel."""
MAXNREG = 255
"""Register cap passed to ptxas. Without it ptxas 12.8 compiled the full-context loop at 32
registers (kilobytes of spills) for sm_90a; with it, 255 registers and ~1.8 KB of spills."""
CTAS_PER_SM = 2
"""Programs per SM the split count aims at: ``B * splits * head_groups <= SMs * CTAS_PER_SM``."""
MIN_BLOCKS_PER_SPLIT = 2
"""A split gets at least this many 64-token blocks (fewer, longer splits for short contexts:
each split costs a query load and a partial row written and read back)."""
_DEFAULT_SMS = 132


@triton.jit
def _mla_qrot_kernel(q_ptr, qrot_ptr, BH, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = row < BH
    row = tl.where(ok, row, 0)
    d = tl.arange(0, 512)
    x = tl.load(q_ptr + row[:, None] * 576 + d[None, :], mask=ok[:, None], other=0.0)
    y = rotate_rows(x.to(tl.float32), BLOCK_H, 512, False)
    tl.store(qrot_ptr + row[:, None] * 512 + d[None, :], y, mask=ok[:, None])


@triton.jit
def _softmax_step(m, l, acc, s, lat):
    """Online-softmax update with fp32 scores ``s [BH, N]`` (-inf where masked) and fp32 values
    ``lat [N, 512]`` (the sparse gather and the exact-pool blocks)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, lat)
    return m_new, l, acc


@triton.jit
def _pool_block(m, l, acc, q, qr, pb, valid, pool_ptr, pscale_ptr, prope_ptr, sm_scale, FP8):
    """The first ``valid`` tokens of exact-pool block ``pb`` (fp8 or bf16 latent, bf16 RoPE):
    dequantized to fp32 (cheap next to a packed block), 16 tokens per step."""
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    for c in tl.static_range(64 // 16):
        tok = c * 16 + tl.arange(0, 16)
        ok = tok < valid
        row = pb.to(tl.int64) * 64 + tok
        lat = tl.load(pool_ptr + row[:, None] * 512 + d[None, :], mask=ok[:, None], other=0.0)
        lat = lat.to(tl.float32)
        if FP8:
            lat = lat * tl.load(pscale_ptr + row, mask=ok, other=0.0)[:, None]
        rope = tl.load(prope_ptr + row[:, None] * 64 + r[None, :], mask=ok[:, None], other=0)
        s = tl.dot(q, tl.trans(lat)) + tl.dot(qr, tl.trans(bf16_bits_to_f32(rope)))
        s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, s, lat)
    return m, l, acc


@triton.jit
def _phase_scores(qs, cmax, qz, qr, codes, rs, rope, tok, valid, sm_scale):
    """Scores of one code tile ``codes [512, T]`` (centered codes, exact fp16) of tokens
    ``tok [T]``: ``rs[t] * (cmax * (qs @ codes) + qz) + qr @ rope[t]`` times ``sm_scale``,
    -inf past ``valid``."""
    s = (tl.dot(qs, codes) * cmax + qz[:, None]) * rs[None, :]
    s = s + tl.dot(qr, tl.trans(bf16_bits_to_f32(rope)))
    return tl.where(tok[None, :] < valid, s * sm_scale, float("-inf"))


@triton.jit
def _phase_values(s, m_blk, rs, codes, va, pl, pz):
    """Block-relative softmax weights of one code tile: ``p = exp(s - m_blk)`` (<= 1), the
    fp16 value weights ``pw = p * rs`` (``rs`` normalized by the block's largest row scale)
    into ``va += pw @ codes^T``, and the row sums of ``p`` and of the rounded ``pw``."""
    p = tl.exp(s - m_blk[:, None])
    pw = (p * rs[None, :]).to(tl.float16)
    va = tl.dot(pw, tl.trans(codes), va)
    return va, pl + tl.sum(p, axis=1), pz + tl.sum(pw.to(tl.float32), axis=1)


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    qrot_ptr,
    rec_ptr,
    rec16_ptr,
    rec32_ptr,
    map_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    bt_ptr,
    seq_ptr,
    idx_ptr,
    po_ptr,
    plse_ptr,
    H,
    S,
    bt_stride,
    idx_stride,
    max_blocks,
    sm_scale,
    SPARSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
    ASM: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = h < H
    h = tl.where(hok, h, 0)
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    qrow = b * H + h
    prow = qrow * S + split
    seq_len = tl.load(seq_ptr + b)
    # this split's share: 64-token blocks [lo, hi) (full context) or selected entries
    if SPARSE:
        per = tl.cdiv(tl.cdiv(idx_stride, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.minimum(lo + per, idx_stride)
    else:
        n_blk = tl.minimum(tl.cdiv(seq_len, 64), max_blocks)
        per = tl.maximum(tl.cdiv(n_blk, num_splits), MIN_BLOCKS)
        lo = split * per
        hi = tl.minimum(lo + per, n_blk)
    if lo >= hi:
        # nothing to read: the combine skips this split's (unwritten) partial row
        tl.store(plse_ptr + prow, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hok)
        return
    q = tl.load(qrot_ptr + qrow[:, None] * 512 + d[None, :], mask=hok[:, None], other=0.0)
    qr = tl.load(q_ptr + qrow[:, None] * 576 + 512 + r[None, :], mask=hok[:, None], other=0.0)
    qr = qr.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    if SPARSE:
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            inb = n < hi
            logical = tl.load(idx_ptr + b * idx_stride + tl.where(inb, n, 0), mask=inb, other=-1)
            ok = (logical >= 0) & (logical < seq_len)
            lg = tl.where(ok, logical, 0)
            lb = lg // 64
            ok = ok & (lb < max_blocks)
            pb = tl.load(bt_ptr + b * bt_stride + tl.where(ok, lb, 0), mask=ok, other=0)
            slot = pb.to(tl.int64) * 64 + lg % 64
            lat, rope = load_tokens(
                slot,
                ok,
                rec_ptr,
                rec16_ptr,
                map_ptr,
                pool_ptr,
                pscale_ptr,
                prope_ptr,
                BLOCK_N,
                BITS,
                CS_OFF,
                ZP_OFF,
                RS_OFF,
                ROPE_OFF,
                REC,
                FP8,
            )
            s = tl.dot(q, tl.trans(lat)) + tl.dot(qr, tl.trans(bf16_bits_to_f32(rope)))
            s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
            m, l, acc = _softmax_step(m, l, acc, s, lat)
    else:
        # Whole blocks. Widths dividing 8 (FAST) load a block's codes as int32 words [512, W]
        # and unpack them by phase (the field at bit e * BITS of every byte: NP tiles of
        # [512, 64 / NP], tokens named by phase_token); other widths read each code's
        # two-word window (window_codes_f16), one tile [512, 64] in token order.
        FAST: tl.constexpr = (8 % BITS) == 0
        NP: tl.constexpr = 8 // BITS if FAST else 1
        T: tl.constexpr = 64 // NP
        W: tl.constexpr = 2 * BITS if FAST else 1
        CENTER: tl.constexpr = 1 << (BITS - 1)
        c = tl.arange(0, T)
        wv = tl.arange(0, W)
        if FAST:
            tok0 = phase_token(c, NP, 0)
            tok1 = phase_token(c, NP, 1 % NP)
            tok2 = phase_token(c, NP, 2 % NP)
            tok3 = phase_token(c, NP, 3 % NP)
        else:
            tok0 = c
            tok1 = c
            tok2 = c
            tok3 = c
        bt_row = bt_ptr + b * bt_stride
        # Software pipeline: the words and channel scales of block u + 1, its block-pool map
        # entry and the block-table entry of u + 2 are loaded during block u, so every load
        # of an iteration depends only on the previous one. The record of a pool block is
        # read too (unused; a request has few pool blocks).
        blk = tl.load(bt_row + lo)
        blk_n = tl.load(bt_row + tl.minimum(lo + 1, hi - 1))
        pb = tl.load(map_ptr + blk)
        base = blk.to(tl.int64) * REC
        if FAST:
            words = tl.load(rec32_ptr + base // 4 + d[:, None] * W + wv[None, :])
        cs16 = tl.load(rec16_ptr + base // 2 + CS_OFF // 2 + d)
        zp16 = tl.load(rec16_ptr + base // 2 + ZP_OFF // 2 + d)
        for u in range(lo, hi):
            blk_nn = tl.load(bt_row + tl.minimum(u + 2, hi - 1))
            pb_n = tl.load(map_ptr + blk_n)
            base_n = blk_n.to(tl.int64) * REC
            if FAST:
                words_n = tl.load(rec32_ptr + base_n // 4 + d[:, None] * W + wv[None, :])
            cs16_n = tl.load(rec16_ptr + base_n // 2 + CS_OFF // 2 + d)
            zp16_n = tl.load(rec16_ptr + base_n // 2 + ZP_OFF // 2 + d)
            valid = tl.minimum(seq_len - u * 64, 64)
            if pb >= 0:
                m, l, acc = _pool_block(
                    m, l, acc, q, qr, pb, valid, pool_ptr, pscale_ptr, prope_ptr, sm_scale, FP8
                )
            else:
                # Scales fold into the dots (record: x[d, t] = (code * cs[d] + zp[d]) * rs[t]):
                #   score[t] = rs[t] * (cmax * ((q * cs / cmax) @ (code - C)) + q @ zpc) + rope
                #   out[d] += cs[d] * (pw @ (code - C)^T)[d] + zpc[d] * sum(pw)
                # with centered codes (C = 2^(BITS-1)), zpc = zp + C * cs, pw = p * rs (fp16
                # operands, fp32 accumulation; p relative to the block's max score and rs to
                # its largest row scale, so both fp16 operands are normalized).
                rb16 = rec16_ptr + base // 2
                rs0 = tl.load(rb16 + RS_OFF // 2 + tok0, mask=tok0 < valid, other=0)
                rp0 = tl.load(rb16 + ROPE_OFF // 2 + tok0[:, None] * 64 + r[None, :])
                rs0 = rs0.to(tl.float16, bitcast=True).to(tl.float32)
                rmax = tl.max(rs0, axis=0)
                if NP >= 2:
                    rs1 = tl.load(rb16 + RS_OFF // 2 + tok1, mask=tok1 < valid, other=0)
                    rp1 = tl.load(rb16 + ROPE_OFF // 2 + tok1[:, None] * 64 + r[None, :])
                    rs1 = rs1.to(tl.float16, bitcast=True).to(tl.float32)
                    rmax = tl.maximum(rmax, tl.max(rs1, axis=0))
                if NP >= 4:
                    rs2 = tl.load(rb16 + RS_OFF // 2 + tok2, mask=tok2 < valid, other=0)
                    rp2 = tl.load(rb16 + ROPE_OFF // 2 + tok2[:, None] * 64 + r[None, :])
                    rs2 = rs2.to(tl.float16, bitcast=True).to(tl.float32)
                    rs3 = tl.load(rb16 + RS_OFF // 2 + tok3, mask=tok3 < valid, other=0)
                    rp3 = tl.load(rb16 + ROPE_OFF // 2 + tok3[:, None] * 64 + r[None, :])
                    rs3 = rs3.to(tl.float16, bitcast=True).to(tl.float32)
                    rmax = tl.maximum(rmax, tl.maximum(tl.max(rs2, axis=0), tl.max(rs3, axis=0)))
                rmax = tl.where(rmax > 0.0, rmax, 1.0)
                cs = cs16.to(tl.float16, bitcast=True).to(tl.float32)
                zpc = zp16.to(tl.float16, bitcast=True).to(tl.float32) + cs * CENTER
                cmax = tl.max(tl.abs(cs), axis=0)
                cmax = tl.where(cmax > 0.0, cmax, 1.0)
                qs = (q * (cs / cmax)[None, :]).to(tl.float16)
                qz = tl.sum(q * zpc[None, :], axis=1)
                if FAST:
                    c0 = words_to_codes_f16(words, 0, BITS, CENTER, ASM)
                else:
                    c0 = window_codes_f16(rec32_ptr + base // 4 + d * 2 * BITS, c, BITS, CENTER)
                s0 = _phase_scores(qs, cmax, qz, qr, c0, rs0, rp0, tok0, valid, sm_scale)
                m_blk = tl.max(s0, axis=1)
                if NP >= 2:
                    c1 = words_to_codes_f16(words, BITS, BITS, CENTER, ASM)
                    s1 = _phase_scores(qs, cmax, qz, qr, c1, rs1, rp1, tok1, valid, sm_scale)
                    m_blk = tl.maximum(m_blk, tl.max(s1, axis=1))
                if NP >= 4:
                    c2 = words_to_codes_f16(words, 2 * BITS, BITS, CENTER, ASM)
                    s2 = _phase_scores(qs, cmax, qz, qr, c2, rs2, rp2, tok2, valid, sm_scale)
                    c3 = words_to_codes_f16(words, 3 * BITS, BITS, CENTER, ASM)
                    s3 = _phase_scores(qs, cmax, qz, qr, c3, rs3, rp3, tok3, valid, sm_scale)
                    m_blk = tl.maximum(m_blk, tl.maximum(tl.max(s2, axis=1), tl.max(s3, axis=1)))
                # valid >= 1 token: m_blk is finite
                m_new = tl.maximum(m, m_blk)
                alpha = tl.exp(m - m_new)
                beta = tl.exp(m_blk - m_new)
                va = tl.zeros([BLOCK_H, 512], tl.float32)
                pl = tl.zeros([BLOCK_H], tl.float32)
                pz = tl.zeros([BLOCK_H], tl.float32)
                va, pl, pz = _phase_values(s0, m_blk, rs0 / rmax, c0, va, pl, pz)
                if NP >= 2:
                    va, pl, pz = _phase_values(s1, m_blk, rs1 / rmax, c1, va, pl, pz)
                if NP >= 4:
                    va, pl, pz = _phase_values(s2, m_blk, rs2 / rmax, c2, va, pl, pz)
                    va, pl, pz = _phase_values(s3, m_blk, rs3 / rmax, c3, va, pl, pz)
                l = l * alpha + beta * pl
                acc = acc * alpha[:, None] + (beta * rmax)[:, None] * (
                    va * cs[None, :] + pz[:, None] * zpc[None, :]
                )
                m = m_new
            blk_n = blk_nn
            pb = pb_n
            base = base_n
            if FAST:
                words = words_n
            cs16 = cs16_n
            zp16 = zp16_n
    lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(po_ptr + prow[:, None] * 512 + d[None, :], out, mask=hok[:, None])
    tl.store(plse_ptr + prow, lse, mask=hok)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, out_ptr, BH, S, NS, BLOCK_H: tl.constexpr):
    """Merge the ``NS`` live splits of ``BLOCK_H`` rows (workspace stride ``S``); a split with
    lse = -inf read nothing and its partial row is not read."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = row < BH
    row = tl.where(ok, row, 0)
    d = tl.arange(0, 512)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(NS):
        m = tl.maximum(m, tl.load(plse_ptr + row * S + s, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for s in range(NS):
        lse = tl.load(plse_ptr + row * S + s, mask=ok, other=float("-inf"))
        w = tl.exp(lse - m_safe)
        live = ok & (lse > float("-inf"))
        part = tl.load(
            po_ptr + (row * S + s)[:, None] * 512 + d[None, :], mask=live[:, None], other=0.0
        )
        acc += w[:, None] * part
        den += w
    acc = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    y = rotate_rows(acc, BLOCK_H, 512, False)
    tl.store(
        out_ptr + row[:, None] * 512 + d[None, :],
        cast_rne(y, out_ptr.dtype.element_ty),
        mask=ok[:, None],
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def live_splits(batch: int, heads: int, num_splits: int, device) -> int:
    """Splits launched per (request, head group): at most the workspace's ``num_splits``,
    and no more than fill the SMs ``CTAS_PER_SM`` programs deep (host arithmetic only)."""
    groups = batch * triton.cdiv(heads, BLOCK_H)
    return max(1, min(num_splits, (_sm_count(torch.device(device)) * CTAS_PER_SM) // groups))


@torch.library.custom_op(
    "kvarn::mla_decode", mutates_args=("out", "ws_q_rot", "ws_part_out", "ws_part_lse")
)
def _decode_op(
    q: torch.Tensor,
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_pool_map: torch.Tensor,
    pool_latent: torch.Tensor,
    pool_scale: torch.Tensor | None,
    pool_rope: torch.Tensor,
    format_name: str,
    softmax_scale: float,
    out: torch.Tensor,
    ws_q_rot: torch.Tensor,
    ws_part_out: torch.Tensor,
    ws_part_lse: torch.Tensor,
    indices: torch.Tensor | None,
) -> None:
    import kvarn_formats as kf

    bsz, heads = q.shape[:2]
    if bsz == 0 or heads == 0:
        return
    s = ws_part_lse.shape[2]
    offs = field_offsets(kf.mla_layout(format_name))
    pl, ps, pr, fp8 = pool_views(pool_latent, pool_scale, pool_rope)
    bh = bsz * heads
    _mla_qrot_kernel[(triton.cdiv(bh, BLOCK_H),)](q, ws_q_rot, bh, BLOCK_H=BLOCK_H, num_warps=4)
    sparse = indices is not None
    idx = indices if sparse else seq_lens
    ns = live_splits(bsz, heads, s, q.device)
    _mla_decode_kernel[(bsz, ns, triton.cdiv(heads, BLOCK_H))](
        q,
        ws_q_rot,
        packed,
        packed.view(torch.int16),
        packed.view(torch.int32),
        block_pool_map,
        pl,
        ps,
        pr,
        block_table,
        seq_lens,
        idx,
        ws_part_out,
        ws_part_lse,
        heads,
        s,
        block_table.stride(0),
        indices.shape[1] if indices is not None else 0,
        block_table.shape[1],
        softmax_scale,
        SPARSE=sparse,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        MIN_BLOCKS=MIN_BLOCKS_PER_SPLIT,
        FP8=fp8,
        ASM=not INTERPRET,
        num_warps=NUM_WARPS,
        maxnreg=MAXNREG,
        **offs,
    )
    _mla_combine_kernel[(triton.cdiv(bh, BLOCK_H),)](
        ws_part_out, ws_part_lse, out, bh, s, ns, BLOCK_H=BLOCK_H, num_warps=4
    )


@_decode_op.register_fake
def _decode_fake(
    q,
    packed,
    block_table,
    seq_lens,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    format_name,
    softmax_scale,
    out,
    ws_q_rot,
    ws_part_out,
    ws_part_lse,
    indices,
) -> None:
    return None


def mla_decode(
    q,
    packed,
    block_table,
    seq_lens,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    layout,
    softmax_scale: float,
    out,
    workspace: MlaDecodeWorkspace | None = None,
    indices=None,
) -> None:
    """Triton ``mla_decode`` (contract of :func:`kvarn_ops.reference.mla.mla_decode`).

    ``workspace`` (from :func:`mla_decode_workspace`) is required: it is the only scratch and
    fixes the split count, so the call can be captured in a CUDA graph. ``q`` contiguous
    ``[B, H, 576]``; ``indices`` int32 ``[B, K]`` contiguous or None.
    """
    if workspace is None:
        raise ValueError(
            "workspace: required; create it once with mla_decode_workspace(B, H, "
            "num_splits, device)"
        )
    check_decode_args(
        q,
        packed,
        block_table,
        seq_lens,
        block_pool_map,
        pool_latent,
        pool_scale,
        pool_rope,
        layout,
        out,
        workspace,
        indices,
    )
    check_device(q)
    torch.ops.kvarn.mla_decode(
        q,
        packed,
        block_table,
        seq_lens,
        block_pool_map,
        pool_latent,
        pool_scale,
        pool_rope,
        layout.format_name,
        float(softmax_scale),
        out,
        workspace.q_rot,
        workspace.part_out,
        workspace.part_lse,
        indices,
    )


assert LATENT_DIM == 512
