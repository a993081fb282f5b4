"""Split-K flash decoding over a dense KVarN paged cache (packed records + exact tail).

Two launches per call:

1. ``_decode_split_kernel``, grid ``(S, B * Hkv)``: one program per (split, request, KV head)
   serves every grouped query head and every one of the T query tokens (rows
   ``r = t * GQA + g``), so each record is read and unpacked once. It rotates q into the
   cache frame (Sylvester Hadamard built from ``popcount(i & j)``), walks its share of the
   request's full blocks (packed records) and, in the last split, the exact tail, and writes
   a normalized partial output and its log-sum-exp (base 2) to the workspace.
   On a CUDA GPU, 4- or 2-bit K with 2- or 4-bit V at G 64 or 128 (d128 with T * GQA <= 16,
   d64 and d256 with T * GQA <= 8) takes the Gluon kernels of ``decode_mma.py`` /
   ``decode_mma_t.py`` (and its head-pair and d256 variants) instead (same grid and
   workspace contract, one warp per program, codes unpacked straight into MMA operand
   registers; the exact tail is then folded in by the combine kernel). ``KVARN_DECODE_MMA=0``
   turns them off.
2. ``_decode_combine_kernel``, grid ``(B * T * Hq,)``: merges the live splits of one query row
   (every partial row and the exact tail read in one memory round trip after ``seq_len``'s,
   up to 16,384 fp32 of partial rows; tiles of ``SC`` splits beyond) and rotates the result
   back to the model frame by a fast Walsh-Hadamard transform (:func:`_fwht`; the exact
   tail's q, when the combine computes it, the same way). On sm_90+ it is launched as the
   main kernel's programmatic dependent: every main program signals it at its start, so the
   combine's programs are placed as the main grid's last wave runs and its launch gap, the
   tail's loads and the tail's attention overlap the main kernel; ``griddepcontrol.wait``
   then orders its workspace reads after the main grid's writes (H200, graph replay: batch
   1 at 32K 24.9 -> 22.1 us, batch 64 at 32K 764 -> 732 us). ``KVARN_DECODE_PDL=0`` turns it
   off. A stream captured into a CUDA graph keeps the dependency.

The split count follows the live context length read on the device: with ``n`` work units
(full blocks, plus one for a non-empty tail), ``per = cdiv(n, min(S, cdiv(n, MIN_UNITS)))``
units go to each split and only ``cdiv(n, per)`` splits run; the other programs of the fixed
grid return at once. Both kernels evaluate the same formula, so nothing is synchronized with
the host and the call can be captured in a CUDA graph.

4- or 8-bit K with 2-, 4- or 8-bit V, a whole block per token chunk and T * GQA <= 16 (k4v2,
k4v4, k8v8 at d <= 256) take a software-pipelined loop (``FAST``): a block's codes are loaded
as int32 words and its scales as fp16 vectors one iteration ahead (the block-table entry two
ahead), so every load of an iteration depends only on the loop index and a block costs no
exposed memory latency after the first; the codes enter the dots as exact fp16 values built
by masking them into the mantissa of 0x6400 (fp16 ``1024 + code``; two codes per lop3 in
inline PTX on the GPU, a plain-Triton twin of one code per op under the interpreter) and
subtracting 1024 in fp16 (exact; one sub.f16x2 per two codes). Folding the offset into the
zero-point terms instead saves that subtraction but makes the fp32 dots carry 1024 times the
weights, whose rounding then cancels (measured under the interpreter: up to 2.5x the error of
the 16-bit operands alone). Columns of those tiles hold bytes 0, 2, 1, 3 of each word
(``_slot_byte``), so K tokens and V channels are permuted consistently: column i of the V
accumulators is channel ``ivc[i] * NPV + e`` (also in the tail), and the workspace is written
in channel order. Other widths (and T * GQA > 16, where the pipelined loop spills) take the
byte-load loop.

Dequantization folds into the dot products (kvarn-method.md section 7)::

    score[t] = s_row_K[t] * (sum_d (q[d] * s_col_K[d]) * cK[d, t] + sum_d q[d] * zp_K[d])
    out[d]  += s_col_V[d] * (sum_t (p[t] * s_row_V[t]) * cV[t, d] + sum_t p[t] * zp_V[t])

Codes go to the tensor cores as exact fp16 integers and are never re-interleaved: for widths
that divide 8 (2, 4, 8 bits) the K dot is split by a code's position inside its byte ("phase":
4-bit K -> even / odd tokens of the tile) and the V dot by the V code's position inside its
byte (2-bit V -> four channel groups ``d % 4``). Other widths (3, 5, 6, 7) take a generic
path that reads a 16-bit window at byte ``(i * b) >> 3`` and shifts by ``(i * b) & 7``.

Memory traffic per call (the roofline the benchmark uses): read, for every request,
``ceil(seq_len / G)`` records per KV head (full blocks: ``record_bytes``; the tail:
``(seq_len % G) * D * 2`` pool elements, plus their fp32 scales for fp8 pools) and q
(``B*T*Hq*D`` elements); write ``out`` (``B*T*Hq*D``); the workspace adds
``S * B*T*Hq*(D + 1) * 4`` bytes written and read back.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

import kvarn_formats as kf
from kvarn_ops import _validate as V
from kvarn_ops.kernels._common import cuda_feature, f16_parts, gluon_modules, launch_or_op
from kvarn_ops.kernels._fastlaunch import PlanCache, launch
from kvarn_ops.reference.decode import MAX_GQA, MAX_QUERY_ROWS

__all__ = [
    "DECODE_MAX_QUERY_LEN",
    "DECODE_MAX_ROWS",
    "DECODE_MIN_UNITS_PER_SPLIT",
    "decode",
    "decode_workspace",
    "chunk_tokens",
    "decode_num_splits",
]

DECODE_MAX_QUERY_LEN = 8
"""Largest T (speculative verify) the kernel serves."""
DECODE_MAX_ROWS = MAX_QUERY_ROWS
"""Largest ``T * GQA`` (query rows per KV head) of a call: 64, the reference's limit (GQA 8 up
to T = 8, GQA 16 up to T = 4, GQA 32 up to T = 2)."""
DECODE_PROGRAM_ROWS = 32
"""Most query rows per KV head one launch computes: a run with more is computed in chunks of
query tokens (:func:`chunk_tokens`). The Triton kernel's 64-row tile compiles to ``wgmma``
at 4 and 8 warps on sm_90 and computed wrong results there (k4v2, GQA 16, T 4: relative error
1.46; k4v4, GQA 32, T 2: an illegal memory access; BENCHMARKS.md, "2026-12-02, night"); its
32-row tile (``mma.sync``) is right."""
DECODE_MMA_CHUNKS = True
"""Where the MMA kernel serves 16 query rows per KV head, a run of more rows (``T * GQA >
16``) is computed in chunks of at most 16 rows through it rather than in Triton launches."""
DECODE_MIN_UNITS_PER_SPLIT = 2
"""A split gets at least this many work units (blocks) when the context allows: below that the
fixed per-program cost (rotating q, writing a partial row) outweighs the blocks it reads."""
DECODE_MAX_SPLITS = 128
"""Upper bound on the split count a workspace is sized for."""
_CODE_REG_BUDGET = 8192
"""Largest packed-code tile (elements) one program holds at once; bigger head_dims process a
block in token chunks so the code tile stays within the register file at 4-8 warps."""


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _hadamard_signs(i, j):
    """+1 / -1 entries of the unnormalized Sylvester Hadamard: (-1)^popcount(i & j)."""
    x = i & j
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return 1 - 2 * (x & 1)


@triton.jit
def _fwht(x, D: tl.constexpr):
    """``x @ H_D`` (unnormalized Sylvester Hadamard) of a ``[D]`` vector, D a power of two, by
    log2(D) butterfly stages: about D log2(D) additions instead of the D^2 products (and the
    D^2 generated signs) of the matrix product."""
    for b in tl.static_range(D.bit_length() - 1):
        y = tl.permute(tl.reshape(x, [D >> (b + 1), 2, 1 << b]), [0, 2, 1])
        lo, hi = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), [0, 2, 1]), [D])
    return x


@triton.jit
def _load_codes(base_ptr, idx, BITS: tl.constexpr):
    """Generic unpack: code ``idx`` of a little-endian ``BITS``-bit stream, any width 2..8.

    Reads the 16-bit window at byte ``(idx * BITS) >> 3``; the byte after a field's last code
    is always inside the record (a scale field follows every codes field)."""
    bit = idx * BITS
    byte = bit >> 3
    lo = tl.load(base_ptr + byte).to(tl.int32)
    hi = tl.load(base_ptr + byte + 1).to(tl.int32)
    return (((hi << 8) | lo) >> (bit & 7)) & ((1 << BITS) - 1)


@triton.jit
def _online_update(m, l, s):
    """Running max / sum update for a new score tile ``s`` [R, N] (base-2 logits)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, alpha, p


@triton.jit
def _pv_phase(
    p,
    srow_v,
    zp_v,
    v_rows_ptr,
    va0,
    va1,
    va2,
    va3,
    pz,
    D: tl.constexpr,
    VB: tl.constexpr,
    NPV: tl.constexpr,
    V_GENERIC: tl.constexpr,
    vtok,
    N: tl.constexpr,
):
    """Add ``(p * s_row_V) @ cV`` for the N tokens ``vtok`` of one K phase to the per-phase V
    accumulators (``va_e`` holds channels ``d = i * NPV + e``) and ``p @ zp_V`` to ``pz``."""
    pw = (p * srow_v[None, :]).to(tl.float16)
    pz = pz + tl.sum(p * zp_v[None, :], axis=1)
    DV: tl.constexpr = D // NPV
    iv = tl.arange(0, DV)
    if V_GENERIC:
        cv = _load_codes(v_rows_ptr, vtok[:, None] * D + iv[None, :], VB)
        va0 = tl.dot(pw, cv.to(tl.float16), va0)
    else:
        vb = tl.load(v_rows_ptr + vtok[:, None] * DV + iv[None, :]).to(tl.int32)
        mask: tl.constexpr = (1 << VB) - 1
        va0 = tl.dot(pw, (vb & mask).to(tl.float16), va0)
        if NPV >= 2:
            va1 = tl.dot(pw, ((vb >> VB) & mask).to(tl.float16), va1)
        if NPV >= 4:
            va2 = tl.dot(pw, ((vb >> (2 * VB)) & mask).to(tl.float16), va2)
            va3 = tl.dot(pw, ((vb >> (3 * VB)) & mask).to(tl.float16), va3)
    return va0, va1, va2, va3, pz


@triton.jit
def _slot_byte(c):
    """Byte (within its word run) whose code lands in column ``c`` of a :func:`_words_to_f16`
    tile: the 4 columns of a word hold bytes 0, 2, 1, 3 (the order in which one 32-bit logic
    op yields two codes)."""
    return (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)


@triton.jit
def _words_to_f16(w, SHIFT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Codes of a [M, W] tile of little-endian int32 words as exact fp16 values, [M, 4 * W]:
    columns ``4 * j .. 4 * j + 3`` hold the ``BITS``-bit fields at bit ``SHIFT`` of bytes 0, 2,
    1, 3 of word ``[m, j]`` (see :func:`_slot_byte`). Masking two fields of a word into the
    mantissas of fp16 1024.0 (bits 0x6400) gives two codes per 32-bit logic op and no
    int-to-float convert (a quarter-rate instruction); one packed fp16 subtraction of 1024
    (exact) per two codes leaves the codes. ``ASM`` does it in inline PTX (GPU); the plain
    twin (one code per op) is what the interpreter runs; both give the same bits."""
    M: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    mask: tl.constexpr = (1 << BITS) - 1
    if ASM:
        m2: tl.constexpr = mask | (mask << 16)
        c0, c1 = tl.inline_asm_elementwise(
            asm=f"{{ .reg .b32 t, o; shr.u32 t, $2, {SHIFT}; "
            f"lop3.b32 t, t, {m2}, 1677747200, 0xea; mov.b32 o, 1677747200; "
            f"sub.f16x2 t, t, o; mov.b32 {{$0, $1}}, t; }}",
            constraints="=h,=h,r",
            args=[w],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
        c2, c3 = tl.inline_asm_elementwise(
            asm=f"{{ .reg .b32 t, o; shr.u32 t, $2, {SHIFT + 8}; "
            f"lop3.b32 t, t, {m2}, 1677747200, 0xea; mov.b32 o, 1677747200; "
            f"sub.f16x2 t, t, o; mov.b32 {{$0, $1}}, t; }}",
            constraints="=h,=h,r",
            args=[w],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
        # join stacks along a new last axis: slot 2 * i + k of a word is
        # (c0, c2)[i] for k = 0 and (c1, c3)[i] for k = 1, so the slots are c0, c1, c2, c3
        # and each lop3 result stays one register
        x = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [M, W, 2, 2]
        return tl.reshape(x, [M, 4 * W])
    else:
        # tl.join puts the new minor axis in one thread's registers, so the 4 codes of a word
        # stay in the thread that loaded it and the reshape moves no data
        c0 = ((w >> SHIFT) & mask) | 0x6400
        c1 = ((w >> (16 + SHIFT)) & mask) | 0x6400
        c2 = ((w >> (8 + SHIFT)) & mask) | 0x6400
        c3 = ((w >> (24 + SHIFT)) & mask) | 0x6400
        x = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # slots c0, c1, c2, c3 as above
        x = tl.reshape(x, [M, 4 * W])
        return x.to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _k_phase_scores(
    qs, qt, qz, kb, srow_k_ptr, tok, key_pos, q_pos, KB: tl.constexpr, SHIFT: tl.constexpr
):
    """Scores of one K phase: ``s_row_K[t] * ((qs + qt) @ cK[:, tok] + qz)`` with the causal
    mask (``qs + qt``: the two fp16 parts of ``q_rot * s_col_K``)."""
    mask: tl.constexpr = (1 << KB) - 1
    ck = ((kb >> SHIFT) & mask).to(tl.float16)
    srow = tl.load(srow_k_ptr + tok).to(tl.float32)
    s = (tl.dot(qs, ck, tl.dot(qt, ck)) + qz[:, None]) * srow[None, :]
    return tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))


# --------------------------------------------------------------------------------------------
# main kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _decode_split_kernel(
    q_ptr,
    rec_ptr,
    rec16_ptr,
    rec32_ptr,
    bt_ptr,
    seq_ptr,
    ek_ptr,
    ev_ptr,
    ks_ptr,
    vs_ptr,
    tail_ptr,
    ws_ptr,
    qk_scale,
    bt_stride,
    num_kv_heads,
    num_q_heads,
    lse_numel,
    T: tl.constexpr,
    GQA: tl.constexpr,
    R_PAD: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
    REC: tl.constexpr,
    K_OFF: tl.constexpr,
    KCS_OFF: tl.constexpr,
    KZP_OFF: tl.constexpr,
    KRS_OFF: tl.constexpr,
    V_OFF: tl.constexpr,
    VCS_OFF: tl.constexpr,
    VRS_OFF: tl.constexpr,
    VZP_OFF: tl.constexpr,
    S: tl.constexpr,
    MIN_UNITS: tl.constexpr,
    TC: tl.constexpr,
    QC: tl.constexpr,
    POOL_FP8: tl.constexpr,
    FAST: tl.constexpr,
    ASM: tl.constexpr,
    TAIL_IN_COMBINE: tl.constexpr,
    PDL: tl.constexpr = False,
    LAG: tl.constexpr = 0,
):
    if PDL:  # the combine may launch now (it waits for this grid before reading its output)
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads

    seq_len = tl.load(seq_ptr + b)
    n_full = seq_len // G
    tail = seq_len - n_full * G
    if TAIL_IN_COMBINE:
        # the combine kernel folds the exact tail in: the splits share the full blocks only
        n_units = n_full
        if n_units == 0:
            return
    else:
        n_units = n_full + (tail > 0).to(tl.int32)
    n_splits = tl.maximum(tl.minimum(S, tl.cdiv(n_units, MIN_UNITS)), 1)
    per = tl.cdiv(n_units, n_splits)
    n_live = tl.cdiv(n_units, per)
    if split >= n_live:
        return
    u0 = split * per
    u1 = tl.minimum(u0 + per, n_units)

    # rows r = t * GQA + g: query token t (position seq_len - T - LAG + t: LAG more query
    # tokens of the request follow these T), head h * GQA + g
    r = tl.arange(0, R_PAD)
    row_ok = r < T * GQA
    tq = r // GQA
    hq = h * GQA + (r % GQA)
    q_pos = tl.where(row_ok, seq_len - (T + LAG) + tq, -1)
    q_row = ((b * T + tq) * num_q_heads + hq).to(tl.int64)

    # q_rot = (q * qk_scale) @ H_D, by chunks of QC input channels on the tensor cores
    # (unnormalized +-1 entries are exact in fp16; 1/sqrt(D) is applied after).
    dcol = tl.arange(0, D)
    q_rot = tl.zeros([R_PAD, D], dtype=tl.float32)
    for kc in tl.static_range(D // QC):
        dk = kc * QC + tl.arange(0, QC)
        qc = tl.load(q_ptr + q_row[:, None] * D + dk[None, :], mask=row_ok[:, None], other=0.0)
        qc = (qc.to(tl.float32) * qk_scale).to(tl.float16)
        hc = _hadamard_signs(dk[:, None], dcol[None, :]).to(tl.float16)
        q_rot = tl.dot(qc, hc, q_rot)
    q_rot = q_rot * (1.0 / tl.sqrt(D * 1.0))

    NPK: tl.constexpr = 8 // KB if (8 % KB) == 0 else 1
    K_GENERIC: tl.constexpr = (8 % KB) != 0
    NPV: tl.constexpr = 8 // VB if (8 % VB) == 0 else 1
    V_GENERIC: tl.constexpr = (8 % VB) != 0
    DV: tl.constexpr = D // NPV
    JK: tl.constexpr = TC // NPK  # tokens of one K phase in a chunk
    iv = tl.arange(0, DV)
    # channel of column i of the V accumulators: acc_e[:, i] is channel ivc[i] * NPV + e (the
    # word-load loop's tiles hold bytes in _slot_byte order)
    if FAST:
        ivc = _slot_byte(iv)
    else:
        ivc = iv

    m = tl.full([R_PAD], -1.0e30, dtype=tl.float32)
    l = tl.zeros([R_PAD], dtype=tl.float32)
    acc0 = tl.zeros([R_PAD, DV], dtype=tl.float32)
    acc1 = tl.zeros([R_PAD, DV], dtype=tl.float32)
    acc2 = tl.zeros([R_PAD, DV], dtype=tl.float32)
    acc3 = tl.zeros([R_PAD, DV], dtype=tl.float32)

    jk = tl.arange(0, JK)
    if FAST:
        # Widths dividing 8, one token chunk per block, K codes in at most 2 phases. Codes and
        # scales are read as whole words and the next block's are fetched while the current
        # one is computed (software pipelining in registers); the block-table entry is read
        # two blocks ahead. Every load of an iteration depends only on the loop index, so
        # a block costs one memory latency at the start of a split, not several per block.
        WK: tl.constexpr = G * KB // 32  # int32 words per K row (channel)
        WV: tl.constexpr = D * VB // 32  # int32 words per V row (token)
        REC4: tl.constexpr = REC // 4
        REC2: tl.constexpr = REC // 2
        wk = tl.arange(0, WK)
        wv = tl.arange(0, WV)
        # column c of a K phase tile is byte _slot_byte(c) of its K row
        tokA = _slot_byte(jk) * NPK  # K phase 0 tokens (even tokens for 4-bit K)
        tokB = tokA + (NPK - 1)  # K phase 1 tokens (NPK == 2); unused when NPK == 1
        u_end = tl.minimum(u1, n_full)
        have = u_end > u0
        bt_row = bt_ptr + b.to(tl.int64) * bt_stride
        blk = tl.load(bt_row + u0, mask=have, other=0).to(tl.int64)
        blk_n = tl.load(bt_row + tl.minimum(u0 + 1, u_end - 1), mask=have, other=0)
        rbase = blk * num_kv_heads + h
        r32 = rec32_ptr + rbase * REC4
        r16 = rec16_ptr + rbase * REC2
        kw = tl.load(r32 + K_OFF // 4 + dcol[:, None] * WK + wk[None, :], mask=have, other=0)
        vwA = tl.load(r32 + V_OFF // 4 + tokA[:, None] * WV + wv[None, :], mask=have, other=0)
        vwB = tl.load(r32 + V_OFF // 4 + tokB[:, None] * WV + wv[None, :], mask=have, other=0)
        kcs = tl.load(r16 + KCS_OFF // 2 + dcol, mask=have, other=0.0)
        kzp = tl.load(r16 + KZP_OFF // 2 + dcol, mask=have, other=0.0)
        krsA = tl.load(r16 + KRS_OFF // 2 + tokA, mask=have, other=0.0)
        krsB = tl.load(r16 + KRS_OFF // 2 + tokB, mask=have, other=0.0)
        vrsA = tl.load(r16 + VRS_OFF // 2 + tokA, mask=have, other=0.0)
        vrsB = tl.load(r16 + VRS_OFF // 2 + tokB, mask=have, other=0.0)
        vzpA = tl.load(r16 + VZP_OFF // 2 + tokA, mask=have, other=0.0)
        vzpB = tl.load(r16 + VZP_OFF // 2 + tokB, mask=have, other=0.0)
        for u in range(u0, u_end):
            # issue the loads of block u + 1 (clamped: the last iteration re-reads block u)
            blk_nn = tl.load(bt_row + tl.minimum(u + 2, u_end - 1))
            nbase = blk_n.to(tl.int64) * num_kv_heads + h
            n32 = rec32_ptr + nbase * REC4
            n16 = rec16_ptr + nbase * REC2
            kw_n = tl.load(n32 + K_OFF // 4 + dcol[:, None] * WK + wk[None, :])
            vwA_n = tl.load(n32 + V_OFF // 4 + tokA[:, None] * WV + wv[None, :])
            vwB_n = tl.load(n32 + V_OFF // 4 + tokB[:, None] * WV + wv[None, :])
            kcs_n = tl.load(n16 + KCS_OFF // 2 + dcol)
            kzp_n = tl.load(n16 + KZP_OFF // 2 + dcol)
            krsA_n = tl.load(n16 + KRS_OFF // 2 + tokA)
            krsB_n = tl.load(n16 + KRS_OFF // 2 + tokB)
            vrsA_n = tl.load(n16 + VRS_OFF // 2 + tokA)
            vrsB_n = tl.load(n16 + VRS_OFF // 2 + tokB)
            vzpA_n = tl.load(n16 + VZP_OFF // 2 + tokA)
            vzpB_n = tl.load(n16 + VZP_OFF // 2 + tokB)
            # V column scales of block u: only needed at the end of this iteration
            vcs0 = tl.load(r16 + VCS_OFF // 2 + ivc * NPV).to(tl.float32)
            if NPV >= 2:
                vcs1 = tl.load(r16 + VCS_OFF // 2 + ivc * NPV + 1).to(tl.float32)
            if NPV >= 4:
                vcs2 = tl.load(r16 + VCS_OFF // 2 + ivc * NPV + 2).to(tl.float32)
                vcs3 = tl.load(r16 + VCS_OFF // 2 + ivc * NPV + 3).to(tl.float32)

            # ---- block u: scores (codes enter the dot as exact fp16; one cross-warp
            # reduction per quantity and block, both K phases together)
            qs, qt = f16_parts(q_rot * kcs.to(tl.float32)[None, :])
            qz = tl.sum(q_rot * kzp.to(tl.float32)[None, :], axis=1)
            kpos = u * G + tokA
            if NPK == 2:
                # both K phases in one [D, 2 * JK] tile (column 2c + p: token tokA[c] + p) and
                # one dot: offline no spill at the 168-register cap (8 B before) and 2 fewer
                # barriers per block; H200 2-3% faster. Its transposed ldmatrix reads still
                # have 2-way bank conflicts (Nsight Compute), as the two phase tiles' had.
                ck = tl.reshape(
                    tl.join(_words_to_f16(kw, 0, KB, ASM), _words_to_f16(kw, KB, KB, ASM)),
                    [D, 2 * JK],
                )
                krs = tl.reshape(tl.join(krsA, krsB), [2 * JK]).to(tl.float32)
                kp2 = tl.reshape(tl.join(kpos, kpos + 1), [2 * JK])
                s01 = (tl.dot(qs, ck, tl.dot(qt, ck)) + qz[:, None]) * krs[None, :]
                s01 = tl.where(kp2[None, :] <= q_pos[:, None], s01, float("-inf"))
                m_new = tl.maximum(m, tl.max(s01, axis=1))
                p, p1 = tl.split(tl.reshape(tl.exp2(s01 - m_new[:, None]), [R_PAD, JK, 2]))
            else:
                ck = _words_to_f16(kw, 0, KB, ASM)
                s0 = (tl.dot(qs, ck, tl.dot(qt, ck)) + qz[:, None]) * krsA.to(tl.float32)[None, :]
                s0 = tl.where(kpos[None, :] <= q_pos[:, None], s0, float("-inf"))
                m_new = tl.maximum(m, tl.max(s0, axis=1))
                p = tl.exp2(s0 - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            m = m_new
            pw = (p * vrsA.to(tl.float32)[None, :]).to(tl.float16)
            # row sums: the softmax denominator and the V zero-point term
            pl = p
            pzt = p * vzpA.to(tl.float32)[None, :]
            va0 = tl.dot(pw, _words_to_f16(vwA, 0, VB, ASM))
            if NPV >= 2:
                va1 = tl.dot(pw, _words_to_f16(vwA, VB, VB, ASM))
            if NPV >= 4:
                va2 = tl.dot(pw, _words_to_f16(vwA, 2 * VB, VB, ASM))
                va3 = tl.dot(pw, _words_to_f16(vwA, 3 * VB, VB, ASM))
            if NPK == 2:
                p = p1
                pw = (p * vrsB.to(tl.float32)[None, :]).to(tl.float16)
                pl += p
                pzt += p * vzpB.to(tl.float32)[None, :]
                va0 = tl.dot(pw, _words_to_f16(vwB, 0, VB, ASM), va0)
                if NPV >= 2:
                    va1 = tl.dot(pw, _words_to_f16(vwB, VB, VB, ASM), va1)
                if NPV >= 4:
                    va2 = tl.dot(pw, _words_to_f16(vwB, 2 * VB, VB, ASM), va2)
                    va3 = tl.dot(pw, _words_to_f16(vwB, 3 * VB, VB, ASM), va3)
            l = l * alpha + tl.sum(pl, axis=1)
            pz = tl.sum(pzt, axis=1)
            acc0 = acc0 * alpha[:, None] + vcs0[None, :] * (va0 + pz[:, None])
            if NPV >= 2:
                acc1 = acc1 * alpha[:, None] + vcs1[None, :] * (va1 + pz[:, None])
            if NPV >= 4:
                acc2 = acc2 * alpha[:, None] + vcs2[None, :] * (va2 + pz[:, None])
                acc3 = acc3 * alpha[:, None] + vcs3[None, :] * (va3 + pz[:, None])

            # ---- rotate the pipeline
            r16 = n16
            blk_n = blk_nn
            kw = kw_n
            vwA = vwA_n
            vwB = vwB_n
            kcs = kcs_n
            kzp = kzp_n
            krsA = krsA_n
            krsB = krsB_n
            vrsA = vrsA_n
            vrsB = vrsB_n
            vzpA = vzpA_n
            vzpB = vzpB_n
    else:
        for u in range(u0, tl.minimum(u1, n_full)):
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + u).to(tl.int64)
            rec = rec_ptr + (blk * num_kv_heads + h) * REC
            rec16 = rec16_ptr + (blk * num_kv_heads + h) * (REC // 2)
            kcs = tl.load(rec16 + KCS_OFF // 2 + dcol).to(tl.float32)
            kzp = tl.load(rec16 + KZP_OFF // 2 + dcol).to(tl.float32)
            qs, qt = f16_parts(q_rot * kcs[None, :])
            qz = tl.sum(q_rot * kzp[None, :], axis=1)
            vcs0 = tl.load(rec16 + VCS_OFF // 2 + iv * NPV).to(tl.float32)
            va0 = tl.zeros([R_PAD, DV], dtype=tl.float32)
            va1 = tl.zeros([R_PAD, DV], dtype=tl.float32)
            va2 = tl.zeros([R_PAD, DV], dtype=tl.float32)
            va3 = tl.zeros([R_PAD, DV], dtype=tl.float32)
            pz = tl.zeros([R_PAD], dtype=tl.float32)
            alpha_tile = tl.full([R_PAD], 1.0, dtype=tl.float32)
            m_tile = m
            for c in tl.static_range(G // TC):
                c0 = c * TC
                if K_GENERIC:
                    tok = c0 + jk
                    kcodes = _load_codes(rec + K_OFF, dcol[:, None] * G + tok[None, :], KB)
                    srow = tl.load(rec16 + KRS_OFF // 2 + tok).to(tl.float32)
                    kc16 = kcodes.to(tl.float16)
                    s0 = (tl.dot(qs, kc16, tl.dot(qt, kc16)) + qz[:, None]) * srow[None, :]
                    s0 = tl.where(u * G + tok[None, :] <= q_pos[:, None], s0, float("-inf"))
                    m_new, l, alpha, p0 = _online_update(m_tile, l, s0)
                    va0, va1, va2, va3, pz = _rescale5(va0, va1, va2, va3, pz, alpha)
                    alpha_tile = alpha_tile * alpha
                    m_tile = m_new
                    srv = tl.load(rec16 + VRS_OFF // 2 + tok).to(tl.float32)
                    zpv = tl.load(rec16 + VZP_OFF // 2 + tok).to(tl.float32)
                    va0, va1, va2, va3, pz = _pv_phase(
                        p0,
                        srv,
                        zpv,
                        rec + V_OFF,
                        va0,
                        va1,
                        va2,
                        va3,
                        pz,
                        D,
                        VB,
                        NPV,
                        V_GENERIC,
                        tok,
                        JK,
                    )
                else:
                    # K bytes of this chunk: row d holds G / NPK bytes; byte j of the chunk carries
                    # tokens c0 + j * NPK + phase.
                    kb = tl.load(
                        rec + K_OFF + dcol[:, None] * (G // NPK) + (c0 // NPK) + jk[None, :]
                    ).to(tl.int32)
                    tok0 = c0 + jk * NPK
                    s0 = _k_phase_scores(
                        qs, qt, qz, kb, rec16 + KRS_OFF // 2, tok0, u * G + tok0, q_pos, KB, 0
                    )
                    m_new = tl.maximum(m_tile, tl.max(s0, axis=1))
                    if NPK >= 2:
                        s1 = _k_phase_scores(
                            qs,
                            qt,
                            qz,
                            kb,
                            rec16 + KRS_OFF // 2,
                            tok0 + 1,
                            u * G + tok0 + 1,
                            q_pos,
                            KB,
                            KB,
                        )
                        m_new = tl.maximum(m_new, tl.max(s1, axis=1))
                    if NPK >= 4:
                        s2 = _k_phase_scores(
                            qs,
                            qt,
                            qz,
                            kb,
                            rec16 + KRS_OFF // 2,
                            tok0 + 2,
                            u * G + tok0 + 2,
                            q_pos,
                            KB,
                            2 * KB,
                        )
                        s3 = _k_phase_scores(
                            qs,
                            qt,
                            qz,
                            kb,
                            rec16 + KRS_OFF // 2,
                            tok0 + 3,
                            u * G + tok0 + 3,
                            q_pos,
                            KB,
                            3 * KB,
                        )
                        m_new = tl.maximum(
                            m_new, tl.maximum(tl.max(s2, axis=1), tl.max(s3, axis=1))
                        )
                    alpha = tl.exp2(m_tile - m_new)
                    va0, va1, va2, va3, pz = _rescale5(va0, va1, va2, va3, pz, alpha)
                    alpha_tile = alpha_tile * alpha
                    l = l * alpha
                    m_tile = m_new
                    p = tl.exp2(s0 - m_new[:, None])
                    l += tl.sum(p, axis=1)
                    va0, va1, va2, va3, pz = _pv_phase(
                        p,
                        tl.load(rec16 + VRS_OFF // 2 + tok0).to(tl.float32),
                        tl.load(rec16 + VZP_OFF // 2 + tok0).to(tl.float32),
                        rec + V_OFF,
                        va0,
                        va1,
                        va2,
                        va3,
                        pz,
                        D,
                        VB,
                        NPV,
                        V_GENERIC,
                        tok0,
                        JK,
                    )
                    if NPK >= 2:
                        p = tl.exp2(s1 - m_new[:, None])
                        l += tl.sum(p, axis=1)
                        va0, va1, va2, va3, pz = _pv_phase(
                            p,
                            tl.load(rec16 + VRS_OFF // 2 + tok0 + 1).to(tl.float32),
                            tl.load(rec16 + VZP_OFF // 2 + tok0 + 1).to(tl.float32),
                            rec + V_OFF,
                            va0,
                            va1,
                            va2,
                            va3,
                            pz,
                            D,
                            VB,
                            NPV,
                            V_GENERIC,
                            tok0 + 1,
                            JK,
                        )
                    if NPK >= 4:
                        p = tl.exp2(s2 - m_new[:, None])
                        l += tl.sum(p, axis=1)
                        va0, va1, va2, va3, pz = _pv_phase(
                            p,
                            tl.load(rec16 + VRS_OFF // 2 + tok0 + 2).to(tl.float32),
                            tl.load(rec16 + VZP_OFF // 2 + tok0 + 2).to(tl.float32),
                            rec + V_OFF,
                            va0,
                            va1,
                            va2,
                            va3,
                            pz,
                            D,
                            VB,
                            NPV,
                            V_GENERIC,
                            tok0 + 2,
                            JK,
                        )
                        p = tl.exp2(s3 - m_new[:, None])
                        l += tl.sum(p, axis=1)
                        va0, va1, va2, va3, pz = _pv_phase(
                            p,
                            tl.load(rec16 + VRS_OFF // 2 + tok0 + 3).to(tl.float32),
                            tl.load(rec16 + VZP_OFF // 2 + tok0 + 3).to(tl.float32),
                            rec + V_OFF,
                            va0,
                            va1,
                            va2,
                            va3,
                            pz,
                            D,
                            VB,
                            NPV,
                            V_GENERIC,
                            tok0 + 3,
                            JK,
                        )
            # fold the tile into the running accumulators: s_col_V per channel, zp_V per row
            m = m_tile
            acc0 = acc0 * alpha_tile[:, None] + vcs0[None, :] * (va0 + pz[:, None])
            if NPV >= 2:
                vcs1 = tl.load(rec16 + VCS_OFF // 2 + iv * NPV + 1).to(tl.float32)
                acc1 = acc1 * alpha_tile[:, None] + vcs1[None, :] * (va1 + pz[:, None])
            if NPV >= 4:
                vcs2 = tl.load(rec16 + VCS_OFF // 2 + iv * NPV + 2).to(tl.float32)
                vcs3 = tl.load(rec16 + VCS_OFF // 2 + iv * NPV + 3).to(tl.float32)
                acc2 = acc2 * alpha_tile[:, None] + vcs2[None, :] * (va2 + pz[:, None])
                acc3 = acc3 * alpha_tile[:, None] + vcs3[None, :] * (va3 + pz[:, None])

    # exact tail: the seq_len % G newest tokens, read from the pool block tail_pool_block[b]
    if (tail > 0) & (u1 > n_full) & (not TAIL_IN_COMBINE):
        pb = tl.load(tail_ptr + b).to(tl.int64)
        tt = tl.arange(0, TC)
        for c in tl.static_range(G // TC):
            tok = c * TC + tt
            t_ok = tok < tail
            slot = (pb * G + tok) * num_kv_heads + h
            kx = tl.load(
                ek_ptr + slot[:, None] * D + dcol[None, :], mask=t_ok[:, None], other=0.0
            ).to(tl.float32)
            if POOL_FP8:
                kx = kx * tl.load(ks_ptr + slot, mask=t_ok, other=0.0)[:, None]
            s = tl.dot(q_rot, tl.trans(kx))
            ok = t_ok[None, :] & (n_full * G + tok[None, :] <= q_pos[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new, l, alpha, p = _online_update(m, l, s)
            m = m_new
            if POOL_FP8:
                p = p * tl.load(vs_ptr + slot, mask=t_ok, other=0.0)[None, :]
            vrow = ev_ptr + slot[:, None] * D
            vx = tl.load(vrow + ivc[None, :] * NPV, mask=t_ok[:, None], other=0.0)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, vx.to(tl.float32))
            if NPV >= 2:
                vx = tl.load(vrow + ivc[None, :] * NPV + 1, mask=t_ok[:, None], other=0.0)
                acc1 = acc1 * alpha[:, None] + tl.dot(p, vx.to(tl.float32))
            if NPV >= 4:
                vx = tl.load(vrow + ivc[None, :] * NPV + 2, mask=t_ok[:, None], other=0.0)
                acc2 = acc2 * alpha[:, None] + tl.dot(p, vx.to(tl.float32))
                vx = tl.load(vrow + ivc[None, :] * NPV + 3, mask=t_ok[:, None], other=0.0)
                acc3 = acc3 * alpha[:, None] + tl.dot(p, vx.to(tl.float32))

    # normalized partial rows + log2-sum-exp; a row that saw no key writes lse = -inf
    seen = l > 0.0
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)
    lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
    ws_row = q_row * S + split
    tl.store(ws_ptr + ws_row, lse, mask=row_ok)
    out_base = ws_ptr + lse_numel + ws_row[:, None] * D + ivc[None, :] * NPV
    tl.store(out_base, acc0 * inv_l[:, None], mask=row_ok[:, None])
    if NPV >= 2:
        tl.store(out_base + 1, acc1 * inv_l[:, None], mask=row_ok[:, None])
    if NPV >= 4:
        tl.store(out_base + 2, acc2 * inv_l[:, None], mask=row_ok[:, None])
        tl.store(out_base + 3, acc3 * inv_l[:, None], mask=row_ok[:, None])


@triton.jit
def _rescale5(va0, va1, va2, va3, pz, alpha):
    a = alpha[:, None]
    return va0 * a, va1 * a, va2 * a, va3 * a, pz * alpha


# --------------------------------------------------------------------------------------------
# combine kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _tail_attention(q_row, kx, vx, k_sc, v_sc, t_ok, D: tl.constexpr, POOL_FP8: tl.constexpr):
    """Attention of one query row (fp32, model frame, times ``qk_scale``) over the exact tail
    tokens ``t_ok`` of ``kx`` / ``vx`` in fp32: the unnormalized output row, the weights' sum
    and the base-2 log-sum-exp."""
    # q_rot[j] = sum_i q[i] H[i, j] by a fast Walsh-Hadamard transform
    q_rot = _fwht(q_row, D) * (1.0 / tl.sqrt(D * 1.0))
    kx = kx.to(tl.float32)
    if POOL_FP8:
        kx = kx * k_sc[:, None]
    st = tl.where(t_ok, tl.sum(kx * q_rot[None, :], axis=1), float("-inf"))
    m_t = tl.max(st, axis=0)
    p_t = tl.where(t_ok, tl.exp2(st - m_t), 0.0)
    l_t = tl.sum(p_t, axis=0)
    if POOL_FP8:
        p_t = p_t * v_sc
    o_t = tl.sum(p_t[:, None] * vx.to(tl.float32), axis=0)
    lse_t = tl.where(l_t > 0.0, m_t + tl.log2(tl.where(l_t > 0.0, l_t, 1.0)), float("-inf"))
    return o_t, l_t, lse_t


@triton.jit
def _decode_combine_kernel(
    ws_ptr,
    seq_ptr,
    out_ptr,
    lse_numel,
    rows_per_request,
    q_ptr,
    ek_ptr,
    ev_ptr,
    ks_ptr,
    vs_ptr,
    tail_ptr,
    qk_scale,
    num_kv_heads,
    num_q_heads,
    D: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    S_P2: tl.constexpr,
    MIN_UNITS: tl.constexpr,
    SC: tl.constexpr,
    TAIL: tl.constexpr,
    T: tl.constexpr,
    GQA: tl.constexpr,
    POOL_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
    LAG: tl.constexpr = 0,
):
    """One program per query row: merge the live splits' partial rows (and, with ``TAIL``, the
    exact tail's attention, computed here in fp32) and rotate back to the model frame.

    Global reads come in two dependent rounds: the row's ``seq_len`` (with the query row and
    the tail's pool block, which do not depend on it), then every log-sum-exp, partial row
    and tail token at once when ``SC >= S_P2`` (one tile of all splits); a smaller ``SC``
    adds one round per further tile of ``SC`` splits. With ``PDL`` (launched as the main
    kernel's programmatic dependent, sm_90+) the program may start while the main kernel
    runs: the tail's loads and its attention come first, then ``griddepcontrol.wait`` (the
    main kernel's writes become visible), then the workspace reads."""
    row = tl.program_id(0).to(tl.int64)
    b = row // rows_per_request
    d = tl.arange(0, D)
    # round 1
    seq_len = tl.load(seq_ptr + b)
    if TAIL:
        qv = tl.load(q_ptr + row * D + d).to(tl.float32) * qk_scale
        pb = tl.load(tail_ptr + b).to(tl.int64)  # read only where the tail is non-empty
    n_full = seq_len // G
    tail = seq_len - n_full * G
    if TAIL:
        n_units = n_full
    else:
        n_units = n_full + (tail > 0).to(tl.int32)
    n_splits = tl.maximum(tl.minimum(S, tl.cdiv(n_units, MIN_UNITS)), 1)
    per = tl.maximum(tl.cdiv(n_units, n_splits), 1)
    n_live = tl.cdiv(n_units, per)
    # round 2: everything the row needs, issued before any of it is used (with PDL: the
    # tail's part first, the workspace's after the wait)
    sp = tl.arange(0, S_P2)
    if TAIL:
        # the exact tail (seq_len % G newest tokens of pool block tail_pool_block[b]) in fp32
        h = (row % num_q_heads) // GQA
        q_pos = seq_len - (T + LAG) + (row % rows_per_request) // num_q_heads
        tok = tl.arange(0, G)
        t_ok = (tok < tail) & (n_full * G + tok <= q_pos)
        slot = (pb * G + tok) * num_kv_heads + h
        kx = tl.load(ek_ptr + slot[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        vx = tl.load(ev_ptr + slot[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        if POOL_FP8:
            k_sc = tl.load(ks_ptr + slot, mask=t_ok, other=0.0)
            v_sc = tl.load(vs_ptr + slot, mask=t_ok, other=0.0)
        else:
            k_sc = None
            v_sc = None
        if PDL:
            o_t, l_t, lse_t = _tail_attention(qv, kx, vx, k_sc, v_sc, t_ok, D, POOL_FP8)
    if PDL:
        tl.extra.cuda.gdc_wait()
    lse = tl.load(ws_ptr + row * S + sp, mask=sp < n_live, other=float("-inf"))
    if SC >= S_P2:
        part0 = tl.load(
            ws_ptr + lse_numel + (row * S + sp)[:, None] * D + d[None, :],
            mask=(sp < n_live)[:, None],
            other=0.0,
        )
    lse_max = tl.max(lse, axis=0)
    if TAIL:
        if not PDL:
            o_t, l_t, lse_t = _tail_attention(qv, kx, vx, k_sc, v_sc, t_ok, D, POOL_FP8)
        top = tl.maximum(lse_max, lse_t)
        w_t = tl.where(l_t > 0.0, tl.exp2(lse_t - top), 0.0)
        o = o_t * tl.where(l_t > 0.0, w_t / tl.where(l_t > 0.0, l_t, 1.0), 0.0)
        lse_max = top
        w_sum = w_t
    else:
        o = tl.zeros([D], dtype=tl.float32)
        w_sum = 0.0
    w = tl.where(sp < n_live, tl.exp2(lse - lse_max), 0.0)
    inv_w = 1.0 / (tl.sum(w, axis=0) + w_sum)
    if SC >= S_P2:
        o += tl.sum(w[:, None] * part0, axis=0)
    else:
        # partial rows by tiles of SC splits: one memory round trip per tile
        for s0 in range(0, n_live, SC):
            sc = s0 + tl.arange(0, SC)
            live = sc < n_live
            w_s = tl.exp2(tl.load(ws_ptr + row * S + sc, mask=live, other=float("-inf")) - lse_max)
            part = tl.load(
                ws_ptr + lse_numel + (row * S + sc)[:, None] * D + d[None, :],
                mask=live[:, None],
                other=0.0,
            )
            o += tl.sum(w_s[:, None] * part, axis=0)
    o = o * (inv_w / tl.sqrt(D * 1.0))
    # back to the model frame: out[j] = sum_i o[i] * H[i, j]
    tl.store(out_ptr + row * D + d, _fwht(o, D).to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    """inline PTX does not run under the Triton interpreter: its plain twins are used there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _layout_consts(format_name: str, head_dim: int) -> dict:
    lay = kf.dense_layout(format_name, head_dim)
    fmt = kf.parse_format(format_name)
    assert isinstance(fmt, kf.DenseFormat)  # dense_layout refused anything else
    f = lay.field
    return dict(
        G=lay.block_size,
        KB=fmt.k_bits,
        VB=fmt.v_bits,
        REC=lay.record_bytes,
        K_OFF=f("k_codes").offset,
        KCS_OFF=f("k_col_scale").offset,
        KZP_OFF=f("k_zero_point").offset,
        KRS_OFF=f("k_row_scale").offset,
        V_OFF=f("v_codes").offset,
        VCS_OFF=f("v_col_scale").offset,
        VRS_OFF=f("v_row_scale").offset,
        VZP_OFF=f("v_zero_point").offset,
    )


def kernel_config(
    format_name: str,
    head_dim: int,
    gqa: int,
    query_len: int,
    num_splits: int,
    pool_fp8: bool,
    lag: int = 0,
) -> tuple[dict, dict]:
    """Constexprs and launch options of the split kernel for one geometry (also used by the
    offline compile tests); ``lag``: query tokens of the run after these ``query_len``."""
    c = _layout_consts(format_name, head_dim)
    kb, g, d = c["KB"], c["G"], head_dim
    npk = 8 // kb if 8 % kb == 0 else 1
    # token chunk: codes of one chunk ([D, TC / NPK] bytes) stay within the register budget,
    # and each K phase keeps >= 16 tokens (the K dimension of the V dot must be >= 16).
    tc = min(g, max(16 * npk, _next_pow2(_CODE_REG_BUDGET * npk // d) if d else g))
    tc = min(g, max(tc, 16 * npk))
    # pipelined word-load path: widths dividing 8, a whole block per chunk, K codes in one or
    # two phases per byte (4- and 8-bit K), at most 16 query rows (T * GQA > 16 spills
    # registers there: 552 B of stack at T=8 GQA4 d128 on sm_90, vs 288 B in the byte-load
    # loop); everything else takes the byte-load loop
    fast = (
        8 % kb == 0
        and 8 % c["VB"] == 0
        and tc == g
        and npk <= 2
        and (g * kb) % 32 == 0
        and (d * c["VB"]) % 32 == 0
        and query_len * gqa <= 16
    )
    consts = dict(
        T=query_len,
        GQA=gqa,
        R_PAD=max(16, _next_pow2(query_len * gqa)),
        D=d,
        S=num_splits,
        MIN_UNITS=DECODE_MIN_UNITS_PER_SPLIT,
        TC=tc,
        QC=min(d, 32),
        POOL_FP8=pool_fp8,
        FAST=fast,
        ASM=fast and not _interpreting(),
        TAIL_IN_COMBINE=False,
        LAG=lag,
        **c,
    )
    # warps per program, measured on the H200 (CUDA-graph replay, 12 geometries of at most 16
    # query rows per KV head: d64/d128/d256, 2- to 8-bit codes, batch 1-32;
    # benchmarks/results/decode_h200_2026-12-02_triton_warps.json): 2 warps for d <= 128 were
    # 1.0-2.7x faster than 4 (d64 k4v2 B=32 16K 1,697 -> 614 us; k5v5 d128 2,395 -> 1,757 us;
    # k8v8 1,043 -> 757 us) although they spill (offline: up to ~0.9 KB of stack), 4 warps for
    # d256 1.1-1.3x faster than 8; the former register cap of 168 at batch * KV heads >= 64 was
    # slower everywhere once the score operand took two fp16 parts. More than 16 rows (T > 1
    # verification) and d512 keep 4 / 8 warps: not measured.
    if consts["R_PAD"] == 16 and d <= 256:
        opts = dict(num_warps=2 if d <= 128 else 4, num_stages=1)
    else:
        opts = dict(num_warps=4 if d <= 128 else 8, num_stages=1)
    return consts, opts


def combine_config(
    head_dim: int, num_splits: int, block_size: int = 64, tail: bool = False
) -> tuple[dict, dict]:
    """Constexprs and launch options of the combine kernel: ``SC`` splits per partial-row tile,
    all of them in one tile when that is <= 16,384 fp32 elements (one memory round trip for
    the whole row; 128 splits at d128), at 4 warps. Batch 1 with 128 splits (the largest
    tile), on an H100, the step with the combine at 4 warps instead of 8: k4v2 d128 32K
    18.4-18.7 -> 17.3-17.5 us, 128K 54.0 -> 52.9 us, k2v2 24.6 -> 22.5 us, d256 51.0 -> 48.4
    us, d64 17.0 -> 16.8 us; 2 warps 19.0 us (BENCHMARKS.md "2026-12-07"). 8 warps where an
    exact ``tail`` of 128-token records sits beside a tile of more than 4,096 elements (two
    [128, head_dim] token tiles more: at 4 warps they spill). 2 warps where the tile is at
    most 512 elements (the 2-4 splits of batches of 32 and more at d128) beside the MMA
    kernels' exact tail of 64-token records at head_dim 64 or 128 (the configurations GPU
    parity ran; larger tails spill at 2 warps): a row's few partials do not need 128
    threads. On an H100, the combine's warps swept at batch 64 and 32 (BENCHMARKS.md
    "2026-12-07, night"), with 37-token exact tails 2 warps against 4: B=64 32K step 653.7
    -> 649.1 us, B=64 4K 108.8 -> 104.0, B=32 16K 177.8 -> 174.1 (1 warp another 0.5-3%
    faster, but it spills with the tail folded in: 160 B of spill frame)."""
    sc = max(1, min(_next_pow2(num_splits), 16384 // head_dim))
    big = tail and block_size * head_dim > 8192 and sc * head_dim > 4096
    if sc * head_dim <= 512 and tail and block_size == 64 and head_dim <= 128:
        return dict(SC=sc), dict(num_warps=2)
    return dict(SC=sc), dict(num_warps=8 if big else 4)


def mma_heads_per_program(head_dim: int, rows: int) -> int:
    """KV heads per program of the transposed MMA kernel at head_dim 64 (``decode_mma_pair``):
    2 where ``rows`` query rows (T * GQA) fit its 8 columns twice, else 1; 0 at other
    head_dims (one 128-channel head, the kernel's own layout)."""
    if head_dim != 64:
        return 0
    return 2 if 2 * rows <= 8 else 1


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_size: int,
    device: torch.device | str | None = None,
) -> int:
    """Split count a workspace is sized for: enough (request, KV head, split) programs to
    fill the GPU with about one wave of the MMA kernel's one-warp programs, no more than the
    longest context can use."""
    sms = 132
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    units = -(-max(1, max_seq_len) // block_size)
    # one wave of the MMA kernel's one-warp programs: 8 resident per SM at its 187 registers
    # (Nsight Compute's block limit from registers: two warps in each scheduler's quarter of
    # the register file). H200, k4v2 d128, split counts swept: B=32 16K 4 splits 44.2% of
    # copy bandwidth (8: 42.3%, 16: 40.1%), B=8 32K 16 splits 43.3% (33: 38.6%), B=64 32K 2
    # splits 53.8% (4: 53.2%). Swept again with the fused-column kernel (H100, BENCHMARKS.md
    # "2026-12-07"): these counts stay best at batch 1-64: more splits under a 168-register
    # cap (12 resident) lose 2-19%, more splits without it 15-67% (a second wave)
    want = max(1, 8 * sms // max(1, batch * num_kv_heads))
    by_ctx = -(-units // DECODE_MIN_UNITS_PER_SPLIT)
    return max(1, min(DECODE_MAX_SPLITS, want, by_ctx))


def decode_workspace(
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    block_size: int,
    device: torch.device | str = "cuda",
    num_splits: int | None = None,
) -> torch.Tensor:
    """Scratch for :func:`decode`: float32 ``[S * B * T * Hq * (D + 1)]``.

    Allocate once per geometry (outside CUDA-graph capture). ``S`` (the largest split count)
    defaults to :func:`decode_num_splits` of the programs a step launches (at head_dim 64 up to
    two KV heads a program, :func:`mma_heads_per_program`, whichever kernel serves the format);
    the live split count of each call is at most ``S`` and follows each request's live context
    length.
    """
    for name, value, low in (
        ("batch", batch, 0),
        ("query_len", query_len, 1),
        ("num_q_heads", num_q_heads, 1),
        ("num_kv_heads", num_kv_heads, 1),
        ("head_dim", head_dim, 1),
        ("max_seq_len", max_seq_len, 0),
        ("block_size", block_size, 1),
    ):
        V.check_count(name, value, low)
    if num_splits is None:
        # at head_dim 64 the MMA kernel's programs take up to two KV heads each
        rows = query_len * (num_q_heads // max(1, num_kv_heads))
        hpp = max(1, mma_heads_per_program(head_dim, rows))
        num_splits = decode_num_splits(batch, -(-num_kv_heads // hpp), max_seq_len, block_size,
                                       device)  # fmt: skip
    if not 1 <= num_splits <= DECODE_MAX_SPLITS:
        raise ValueError(f"num_splits: must be in [1, {DECODE_MAX_SPLITS}], got {num_splits}")
    n = num_splits * batch * query_len * num_q_heads * (head_dim + 1)
    return torch.empty(n, dtype=torch.float32, device=device)


def _check_decode_args(
    q,
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    layout,
    softmax_scale,
    out,
    workspace,
) -> int:
    V.check_tensor("q", q, dtypes=V.MODEL_DTYPES, ndim=4)
    dev = q.device
    b, t, hq, d = q.shape
    V.check_dense_layout("layout", layout, head_dim=d)
    if not 1 <= t <= DECODE_MAX_QUERY_LEN:
        raise ValueError(f"q: query length T must be in [1, {DECODE_MAX_QUERY_LEN}], got {t}")
    V.check_tensor("packed", packed, dtypes=torch.uint8, ndim=3, device=dev)
    nb, hkv, rb = packed.shape
    if rb != layout.record_bytes:
        raise ValueError(
            f"packed: last dim must be record_bytes={layout.record_bytes} of "
            f"{layout.format_name!r} at head_dim {d}, got {rb}"
        )
    if hkv < 1 or hq % hkv != 0 or hq < hkv:
        raise ValueError(f"q: {hq} query heads for {hkv} KV heads (packed dim 1); need a multiple")
    if hq // hkv > MAX_GQA:
        raise ValueError(
            f"q: {hq // hkv} query heads per KV head exceed {MAX_GQA} (one query token's rows "
            "must fit one program)"
        )
    if t * (hq // hkv) > DECODE_MAX_ROWS:
        raise ValueError(
            f"q: T * (query heads per KV head) = {t} * {hq // hkv} exceeds {DECODE_MAX_ROWS} "
            "query rows per KV head"
        )
    V.check_tensor("block_table", block_table, dtypes=torch.int32, ndim=2, device=dev)
    if block_table.shape[0] != b:
        raise ValueError(
            f"block_table: expected {b} rows (batch of q), got {list(block_table.shape)}"
        )
    V.check_tensor("seq_lens", seq_lens, dtypes=torch.int32, shape=(b,), device=dev)
    V.check_tensor("tail_pool_block", tail_pool_block, dtypes=torch.int32, shape=(b,), device=dev)
    npool, g, phkv, pd = V.check_pool(exact_k, exact_v, k_scale, v_scale, device=dev, layout=layout)
    if phkv != hkv:
        raise ValueError(f"exact_k: {phkv} KV heads, but packed has {hkv}")
    V.check_softmax_scale(softmax_scale)
    V.check_tensor("out", out, dtypes=V.MODEL_DTYPES, shape=(b, t, hq, d), device=dev)
    V.check_tensor("workspace", workspace, dtypes=torch.float32, ndim=1, device=dev)
    if b == 0:
        return 0  # an empty batch: nothing to read or write
    splits = workspace.numel() // (b * t * hq * (d + 1))
    if splits < 1:
        raise ValueError(
            f"workspace: too small, {workspace.numel()} float32 elements; at least "
            f"{b * t * hq * (d + 1)} needed (use decode_workspace(...))"
        )
    if dev.type == "cpu":
        # value checks only where they cost no device sync
        if bool((seq_lens < t).any()):
            raise ValueError(
                f"seq_lens: every entry must be >= T={t} (the cache holds the "
                f"T new tokens), got {seq_lens.tolist()}"
            )
        full = (seq_lens // g).to(torch.int64)
        if int(full.max()) > block_table.shape[1]:
            raise ValueError(
                f"block_table: {block_table.shape[1]} columns, but a request has "
                f"{int(full.max())} full blocks"
            )
        cols = torch.arange(block_table.shape[1])
        V.check_index_range("block_table", block_table, nb, used=cols[None, :] < full[:, None])
        V.check_index_range("tail_pool_block", tail_pool_block, npool, used=(seq_lens % g) > 0)
    return min(splits, DECODE_MAX_SPLITS)


_MMA_STAGES = 2
"""Records in flight per program of the MMA kernel (cp.async stages; 0: plain loads)."""
_MMA_TRANSPOSED = True
"""Up to 8 query rows per KV head: the kernel with the rows in the MMA's N dimension
(``decode_mma_t.py``)."""
_MMA_MAXNREG: int | None = None
"""Register cap of the MMA kernel (None: the compiler's choice, 253 at k4v2)."""
_PDL_TRIGGER = True
"""With programmatic dependent launch: the main kernel's programs signal the combine at their
start (``griddepcontrol.launch_dependents``), so its programs can be resident once the main
grid's last wave is; False leaves the signal to each program's exit."""
_TAIL_IN_COMBINE = False
"""Triton split kernel only: leave the exact tail to the combine kernel, as the MMA kernel
always does (tests set it to check that combine path under the interpreter)."""


def _use_mma_kernel(format_name: str, q: torch.Tensor, hkv: int, t: int | None = None) -> bool:
    """The Gluon kernels (``decode_mma.py`` and the transposed ones) serve 4-bit K, 2/4-bit V,
    G 64 or 128 on sm_80+: d128 up to 16 query rows per KV head (``t`` query tokens; default:
    q's), d64 and d256 up to 8; 2-bit K alike."""
    if not cuda_feature(q, "KVARN_DECODE_MMA", (8, 0)):
        return False
    c = _layout_consts(format_name, q.shape[3])
    rows = (q.shape[1] if t is None else t) * (q.shape[2] // hkv)
    if q.shape[3] != 128 and not (_MMA_TRANSPOSED and _MMA_STAGES >= 2):
        return False  # head pairs (head_dim 64) exist in the transposed kernel only
    mods = _mma_module()
    return mods is not None and mods[0].mma_decode_supported(
        c["KB"], c["VB"], c["G"], q.shape[3], rows
    )


@functools.cache
def _mma_module():
    return gluon_modules("decode_mma", "decode_mma_t", "decode_mma_d256")


def _launch(
    q,
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    format_name,
    softmax_scale,
    out,
    workspace,
    num_splits,
    q_lag=0,
):
    b, t, hq, d = q.shape
    hkv = packed.shape[1]
    pool_fp8 = exact_k.dtype == torch.float8_e4m3fn
    consts, opts = kernel_config(format_name, d, hq // hkv, t, num_splits, pool_fp8, q_lag)
    lse_numel = num_splits * b * t * hq
    ks = k_scale if pool_fp8 else exact_k
    vs = v_scale if pool_fp8 else exact_v
    qk_scale = float(softmax_scale) * math.log2(math.e)
    mma = _use_mma_kernel(format_name, q, hkv)
    pdl = cuda_feature(q, "KVARN_DECODE_PDL", (9, 0))  # combine as programmatic dependent
    if mma:
        c = _layout_consts(format_name, d)
        mod, mod_t, mod_256 = _mma_module()
        kern = mod.mma_decode_kernel
        pair = mma_heads_per_program(d, t * (hq // hkv))
        if pair or (_MMA_TRANSPOSED and t * (hq // hkv) <= 8 and _MMA_STAGES >= 2):
            kern = mod_t.mma_decode_t_kernel
        if d == 256:
            kern = mod_256.mma_decode_t256_kernel  # two 128-channel halves a block
        extra = {"PAIR": pair} if pair else {}
        if c["KB"] == 2:
            extra["KB"] = 2
        launch(
            kern,
            (num_splits, b * (-(-hkv // pair) if pair else hkv)),
            q,
            packed.view(torch.float16),
            packed.view(torch.int32),
            block_table,
            seq_lens,
            workspace,
            qk_scale,
            block_table.stride(0),
            hkv,
            hq,
            lse_numel,
            T=t,
            GQA=hq // hkv,
            VB=c["VB"],
            REC=c["REC"],
            K_OFF=c["K_OFF"],
            KCS_OFF=c["KCS_OFF"],
            KZP_OFF=c["KZP_OFF"],
            KRS_OFF=c["KRS_OFF"],
            V_OFF=c["V_OFF"],
            VCS_OFF=c["VCS_OFF"],
            VRS_OFF=c["VRS_OFF"],
            VZP_OFF=c["VZP_OFF"],
            S=num_splits,
            MIN_UNITS=DECODE_MIN_UNITS_PER_SPLIT,
            NBUF=_MMA_STAGES,
            G=c["G"],
            PDL=pdl and _PDL_TRIGGER,
            LAG=q_lag,
            num_warps=1,
            **extra,
            **({} if _MMA_MAXNREG is None else {"maxnreg": _MMA_MAXNREG}),
        )
        tail_in_combine = True
    else:
        tail_in_combine = _TAIL_IN_COMBINE
        consts["TAIL_IN_COMBINE"] = tail_in_combine
        launch(
            _decode_split_kernel,
            (num_splits, b * hkv),
            q,
            packed,
            packed.view(torch.float16),
            packed.view(torch.int32),
            block_table,
            seq_lens,
            exact_k,
            exact_v,
            ks,
            vs,
            tail_pool_block,
            workspace,
            qk_scale,
            block_table.stride(0),
            hkv,
            hq,
            lse_numel,
            PDL=pdl and _PDL_TRIGGER,
            **consts,
            **opts,
        )
    cc, copts = combine_config(d, num_splits, consts["G"], tail_in_combine)
    launch(
        _decode_combine_kernel,
        (b * t * hq,),
        workspace,
        seq_lens,
        out,
        lse_numel,
        t * hq,
        q,
        exact_k,
        exact_v,
        ks,
        vs,
        tail_pool_block,
        qk_scale,
        hkv,
        hq,
        D=d,
        G=consts["G"],
        S=num_splits,
        S_P2=_next_pow2(num_splits),
        MIN_UNITS=DECODE_MIN_UNITS_PER_SPLIT,
        TAIL=tail_in_combine,
        T=t,
        GQA=hq // hkv,
        POOL_FP8=pool_fp8,
        PDL=pdl,
        LAG=q_lag,
        launch_pdl=pdl,
        **cc,
        **copts,
    )


@torch.library.custom_op("kvarn::decode", mutates_args=("out", "workspace"))
def _decode_op(
    q: torch.Tensor,
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    format_name: str,
    softmax_scale: float,
    out: torch.Tensor,
    workspace: torch.Tensor,
    num_splits: int,
    q_lag: int = 0,
) -> None:
    _launch(
        q,
        packed,
        block_table,
        seq_lens,
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        tail_pool_block,
        format_name,
        softmax_scale,
        out,
        workspace,
        num_splits,
        q_lag,
    )


@_decode_op.register_fake
def _decode_op_fake(
    q,
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    format_name,
    softmax_scale,
    out,
    workspace,
    num_splits,
    q_lag=0,
) -> None:
    return None


def _decode_switches() -> tuple:
    """What :func:`decode`'s path reads besides its arguments (part of every plan's
    signature, :mod:`._fastlaunch`): the environment switches and the module settings and
    functions that tests and benchmarks replace."""
    env = os.environ.get
    return (
        env("KVARN_DECODE_MMA"), env("KVARN_DECODE_PDL"), _MMA_STAGES, _MMA_TRANSPOSED,
        _MMA_MAXNREG, _PDL_TRIGGER, _TAIL_IN_COMBINE, DECODE_MMA_CHUNKS, DECODE_PROGRAM_ROWS,
        DECODE_MAX_SPLITS, DECODE_MAX_ROWS, DECODE_MAX_QUERY_LEN, DECODE_MIN_UNITS_PER_SPLIT,
        kernel_config, combine_config, _use_mma_kernel,
        _mma_module, _decode_split_kernel, _decode_combine_kernel,
    )  # fmt: skip


_PLANS = PlanCache(_decode_switches)
"""Recorded launches of :func:`decode` calls (host time: see :mod:`._fastlaunch`)."""


def decode(
    q,
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    layout,
    softmax_scale,
    out,
    workspace,
) -> None:
    """Attention of T query tokens per request over a KVarN paged cache.

    Parameters
    ----------
    q : Tensor [B, T, Hq, D], float16 / bfloat16 / float32, model frame
        T <= 8 queries: the last T tokens of each sequence, causal among themselves.
    packed : uint8 [num_blocks, Hkv, record_bytes]
    block_table : int32 [B, max_blocks]
        Logical block ``i < seq_len // G`` of request ``b`` is ``packed[block_table[b, i]]``.
    seq_lens : int32 [B]
        Tokens in the cache, including the T new ones (>= T).
    exact_k, exact_v : [P, G, Hkv, D] float16 / bfloat16 / float8_e4m3fn, rotated frame
    k_scale, v_scale : float32 [P, G, Hkv] for an fp8 pool, else None
    tail_pool_block : int32 [B]
        Pool block holding the ``seq_len % G`` newest tokens (read only when that is > 0).
    layout : kvarn_formats.RecordLayout (dense)
    softmax_scale : float
    out : Tensor [B, T, Hq, D], float16 / bfloat16 / float32, written in the model frame.
    workspace : float32 Tensor from :func:`decode_workspace` (the only scratch).

    Two kernel launches and no allocation when ``T * GQA`` fits one launch
    (:func:`chunk_tokens`); a longer run is computed in chunks of query tokens, each two
    launches into a contiguous copy of its queries and outputs. No host synchronization on
    the GPU. A repeated call of one signature (shapes, strides, dtypes, alignment, layout,
    scale) replays the launches of the first without its checks (:mod:`._fastlaunch`).
    """
    tensors = (q, packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale,
               tail_pool_block, out, workspace)  # fmt: skip
    key = None
    if type(softmax_scale) in (float, int):
        key = _PLANS.key(tensors, (id(layout), softmax_scale))
    if _PLANS.replay(key, tensors):
        return
    with _PLANS.recording(key, tensors, keep=(layout,)):
        splits = _check_decode_args(
            q,
            packed,
            block_table,
            seq_lens,
            exact_k,
            exact_v,
            k_scale,
            v_scale,
            tail_pool_block,
            layout,
            softmax_scale,
            out,
            workspace,
        )
        if splits == 0:
            return  # empty batch
        t = q.shape[1]
        step = chunk_tokens(layout.format_name, q, packed.shape[1])
        cache = (packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block)
        scale = float(softmax_scale)
        if step >= t:
            launch_or_op(
                _decode_op, _launch, q, *cache, layout.format_name, scale, out, workspace, splits, 0
            )
            return
        # chunks of query tokens; each one's keys end ``t - t1`` tokens before the run's last
        # (the workspace is sized for all T rows, so each chunk fits, and they run in order)
        for t0 in range(0, t, step):
            t1 = min(t, t0 + step)
            qc = q[:, t0:t1].contiguous()
            oc = torch.empty(qc.shape, dtype=out.dtype, device=out.device)
            launch_or_op(
                _decode_op, _launch, qc, *cache, layout.format_name, scale, oc, workspace, splits,
                t - t1,
            )  # fmt: skip
            out[:, t0:t1].copy_(oc)


def chunk_tokens(format_name: str, q: torch.Tensor, num_kv_heads: int) -> int:
    """Query tokens per launch of a decode of ``q`` [B, T, Hq, D] (GQA = Hq / num_kv_heads):
    T when ``T * GQA <= 16``; else ``16 // GQA`` where the MMA kernel serves 16 rows
    (``DECODE_MMA_CHUNKS``: 16-row chunks through it); else T when ``T * GQA`` is at most
    ``DECODE_PROGRAM_ROWS`` (one Triton launch), and ``DECODE_PROGRAM_ROWS // GQA`` beyond."""
    t, gqa = q.shape[1], q.shape[2] // num_kv_heads
    if t * gqa <= 16:
        return t
    if DECODE_MMA_CHUNKS and gqa <= 16 and _use_mma_kernel(format_name, q, num_kv_heads, 16 // gqa):
        return 16 // gqa
    return t if t * gqa <= DECODE_PROGRAM_ROWS else max(1, DECODE_PROGRAM_ROWS // gqa)
