"""mla_decode: attention of absorbed MLA queries ``[B, H, 576]`` over packed latent tiles plus
exact-pool rows, split-K, three launches with no host sync and no allocation:

1. ``_mla_qrot_kernel``: ``q_rot = q[..., :512] @ H_512`` into the workspace;
2. ``_mla_decode_kernel``, grid ``(B, splits, ceil(H / BLOCK_H))``: one program per (request,
   split, ``BLOCK_H`` heads) attends over its share of the request and writes a partial output
   and its log-sum-exp; a split with nothing to read writes lse = -inf only;
3. ``_mla_combine_kernel``: merges the live splits (partial rows of lse = -inf are not read)
   and rotates the output back by ``H_512``.

Full-context decode runs a Gluon kernel in place of step 2 (same workspace, same combine): on
sm_90 the ``wgmma`` kernel of ``mla_decode_wgmma.py`` at 2, 4 and 5 bits (each tile unpacked
once into shared memory; 2.1x the ``mma.sync`` kernel on the H200 at batch 64), or from
``WGMMA64_MIN_HEADS`` heads its 64-heads-per-program sibling ``mla_decode_wgmma64.py`` (1.8x
the 16-head kernel at 128 heads); on other sm_80+ GPUs the ``mma.sync`` kernel of
``mla_decode_mma.py`` at 4 bits (about 2x this file's kernel at batch >= 8).
``WGMMA_KERNEL = False`` or ``KVARN_MLA_WGMMA=0`` keeps the ``mma.sync`` kernel; ``MMA_KERNEL =
False`` or ``KVARN_MLA_MMA=0`` keeps this file's kernel.

Splits: the launcher runs ``live_splits(B, H, S)`` of the workspace's ``S`` (no more than fill
the SMs ``CTAS_PER_SM`` programs deep; host arithmetic on shapes only, so a CUDA graph
captures it); the kernel gives each split ``max(ceil(n / splits), MIN_BLOCKS_PER_SPLIT)`` of
the request's ``n`` 64-token blocks (device-side, from ``seq_lens``).

Full context (no ``indices``): the loop walks whole blocks through the block table, software
pipelined (block u + 1's code words and pool-map entry and block u + 2's table entry are
loaded while block u is computed). The 512 latent channels are processed in ``512 / CHUNK``
chunks (query chunks and output accumulators are separate register tiles). A block mapped to
the exact pool (the filling tail, sinks, rehydrated blocks) takes the pool path: its fp8/bf16
rows dequantized to fp32 chunk by chunk, all 64 tokens at once, fp32 dots (tf32 on the GPU),
each chunk read twice (scores, then values). A packed block never dequantizes: with the
record's ``x[d, t] = (code * cs[d] + zp[d]) * rs[t]`` (K orientation, code index ``d*64 + t``)
and centered codes ``c = code - 2^(b-1)``, ``zpc = zp + 2^(b-1) * cs``::

    score[t] = rs[t] * (cmax * ((q * cs / cmax) @ c)[t] + q @ zpc) + q_rope @ rope[t]
    out[d]  += cs[d] * (pw @ c^T)[d] + zpc[d] * sum(pw),   pw = exp(score - m_block) * rs / rmax

(``cmax = max |cs|``, ``rmax = max rs``, block-relative softmax weights rescaled into the
running accumulator by ``exp(m_block - m) * rmax``). Both products are fp16 tensor-core dots
with fp32 accumulation whose code operand is exact; the per-element work is an unpack. Pass 1
sums the score dot over the chunks; pass 2 reads each chunk's code words again (cache hits:
the first read asks to keep them, the second to evict them) and unpacks them again for its
value dot, so no unpacked ``[512, 64]`` tile is live across the softmax (registers, shared
memory). Codes are loaded as int32 words, coalesced: for widths dividing 8 a chunk's word tile
``[CHUNK, 2b]`` is unpacked by phase (the field at bit ``e * b`` of every byte: ``8 / b``
tiles ``[CHUNK, 8 * b]``, joined column by column into one ``[CHUNK, 64]`` tile in registers)
by masking two fields per 32-bit op into the mantissas of fp16 1024.0 and one packed fp16
subtraction (``mla_common.words_to_codes_f16``; inline PTX on the GPU, a plain twin in the
interpreter); a tile's columns are tokens in ``_column_token`` order, and row scales and RoPE
rows are loaded in that order. Widths 3 and 5 load a chunk's ``b`` words of each 32-code
half-row once (tiles ``[2, CH]``, one per word index) and take codes ``i`` and ``i + 4`` of a
half from one fixed 32-bit window per op (``mla_common.pair_codes_f16``: shift or funnel
shift, one mask op, one packed fp16 fma), tokens in ``_pair_token`` order. Other widths (6, 7)
read each code's two-word window (``window_codes_f16``). The 16-bit operands are the only
roundings besides fp32 arithmetic (tests: ``fp16_operand_decode``).

Sparse (``indices``): each split walks its share of the selected entries 16 at a time,
gathering each token from its pool block or record (``mla_common.token_sources``,
``latent_cols``, ``token_rope``) in the same channel chunks as the full-context path, fp32
(tf32) dots, the loop not software-pipelined: offline at k5 with an fp8 pool, 76 KB of shared
memory on sm_90a and sm_120a (123 KB pipelined; 148 KB with whole 512-channel tiles), so the
sparse path fits sm_120's 99 KB.

Memory traffic: every selected token is read once from memory (``R/64`` record bytes for a
packed token, ``512*E + s + 128`` for a pool token; a request's pool blocks also read their
stale record's words once, and a split re-reads its last record's words once as the
pipeline's overrun; the second pass over a block hits the cache), ``q`` once, ``out``
written once, plus ``B*H*(512 + 1)*4`` partial bytes per live split written and read
once and the ``B*H*512*4`` rotated query.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvarn_ops._validate import check_count
from kvarn_ops.kernels._common import (
    INTERPRET,
    cast_rne,
    check_device,
    cuda_feature,
    device_capability,
    f16_parts,
    gluon_modules,
    launch_or_op,
    rotate_rows,
)
from kvarn_ops.kernels._fastlaunch import PlanCache, launch
from kvarn_ops.kernels.mla_common import (
    bf16_bits_to_f32,
    field_offsets,
    latent_cols,
    pair_codes_f16,
    phase_token,
    pool_views,
    token_rope,
    token_sources,
    window_codes_f16,
    words_to_codes_f16,
)
from kvarn_ops.reference import mla as _ref
from kvarn_ops.reference.mla import LATENT_DIM, MlaDecodeWorkspace, check_decode_args

__all__ = ["mla_decode", "mla_decode_workspace"]

BLOCK_H = 16
"""Heads per program (the smallest tl.dot M; DeepSeek serves 16 or 128 heads per rank)."""
BLOCK_N = 16
"""Tokens per step of the sparse gather."""
NUM_WARPS = 8
"""Warps of the Triton decode kernel when there is at most one program per SM (and always for
sparse decode)."""
NUM_WARPS_MANY = 4
"""Warps of the Triton full-context decode kernel when there are more programs than SMs. On the
H200 (CUDA-graph replay, k5, 16 heads) 4 warps instead of 8: batch 64 at 16K 1.34 -> 1.26 ms,
batch 8 at 32K 364 -> 352 us, 32 requests x 128 heads at 8K (k4) unchanged; batch 1 (132
programs) 74 -> 113 us, hence the gate (benchmarks/results/mla_h200_2026-12-02_warps_graph.json)."""
MAXNREG = 255
"""Register cap passed to ptxas. Without it ptxas 12.8 compiled the full-context loop at 32
registers (kilobytes of spills) for sm_90a; with it (CHUNK 128), 255 registers and no spill
inside the loop (40 bytes of stack around it, k4)."""
CTAS_PER_SM = 2
WIDE_HEADS = 64
"""Heads per program of the 64-head ``wgmma`` kernel (``mla_decode_wgmma64.HEADS``)."""
"""Programs per SM the split count aims at: ``B * splits * head_groups <= SMs * CTAS_PER_SM``."""
MIN_BLOCKS_PER_SPLIT = 2
"""A split gets at least this many 64-token blocks (fewer, longer splits for short contexts:
each split costs a query load and a partial row written and read back)."""
CHUNK = 128
"""Latent channels per chunk of the full-context loop (128, 256 or 512): pass 1 sums the
scores over the chunks, pass 2 unpacks each chunk's codes again for the value dot. Offline
sm_90a, k4: 128 -> 68 KB shared memory, 40 B stack; 256 -> 100 KB, 224 B; 512 -> 164 KB,
480 B."""
_DEFAULT_SMS = 132
MMA_KERNEL = True
"""Full-context decode of 4-bit codes on sm_80+ runs the Gluon kernel of
``mla_decode_mma.py`` (False, or ``KVARN_MLA_MMA=0`` in the environment: this file's Triton
kernel for every case)."""
WGMMA_KERNEL = True
"""On sm_90 (Hopper), full-context decode of 2-, 4- and 5-bit codes runs the ``wgmma`` kernel
of ``mla_decode_wgmma.py`` (each tile unpacked once into shared memory) (False, or
``KVARN_MLA_WGMMA=0``: the ``mma.sync`` kernel at 4 bits, the Triton one at 2 and 5)."""
WGMMA_BITS: tuple[int, ...] = (2, 4, 5)
"""Code widths the ``wgmma`` kernel serves (every width it compiles for; narrow it to send a
width back to the ``mma.sync`` or Triton kernel)."""
WGMMA64_MIN_HEADS: int | None = 64
"""Where the ``wgmma`` kernel serves a call with at least this many query heads, the
64-heads-per-program kernel of ``mla_decode_wgmma64.py`` runs instead of the 16-head one (each
tile unpacked and read once per 64 heads; one program per SM). None, or
``KVARN_MLA_WGMMA64=0``: the 16-head kernel at every head count."""
MMA_NBUF = 2
"""cp.async stages of the Gluon kernel (the current block and the next; 3 measured the same on
the H200)."""
MMA_MAXNREG: int | None = None
"""Register cap of the Gluon kernel (None: the compiler's choice, 255)."""


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
def _load_q(qrot_ptr, qrow, hok, C: tl.constexpr, CH: tl.constexpr):
    """Rotated-query chunk ``[BH, CH]`` (fp32) of latent channels ``[C * CH, (C + 1) * CH)``."""
    d = C * CH + tl.arange(0, CH)
    return tl.load(qrot_ptr + qrow[:, None] * 512 + d[None, :], mask=hok[:, None], other=0.0)


@triton.jit
def _absmax_f16(bits):
    """Largest magnitude of a vector of fp16 bit patterns, as fp32."""
    return tl.max(tl.abs(bits.to(tl.float16, bitcast=True).to(tl.float32)), axis=0)


@triton.jit
def _pool_lat(pool_ptr, pscale_ptr, pb, valid, C: tl.constexpr, CH: tl.constexpr, FP8):
    """Channels ``[C * CH, (C + 1) * CH)`` of the 64 rows of exact-pool block ``pb`` as fp32
    ``[64, CH]`` (rows past ``valid`` are zeros)."""
    tok = tl.arange(0, 64)
    ok = tok < valid
    row = pb.to(tl.int64) * 64 + tok
    d = C * CH + tl.arange(0, CH)
    lat = tl.load(pool_ptr + row[:, None] * 512 + d[None, :], mask=ok[:, None], other=0.0)
    lat = lat.to(tl.float32)
    if FP8:
        lat = lat * tl.load(pscale_ptr + row, mask=ok, other=0.0)[:, None]
    return lat


@triton.jit
def _pool_values(acc, p, alpha, pool_ptr, pscale_ptr, pb, valid, C: tl.constexpr, FP8):
    """``acc * alpha + p @ lat`` for one latent chunk ``acc [BH, CH]`` of a pool block."""
    lat = _pool_lat(pool_ptr, pscale_ptr, pb, valid, C, acc.shape[1], FP8)
    return acc * alpha[:, None] + tl.dot(p, lat)


@triton.jit
def _chunk_words(
    rec32_ptr, base, C: tl.constexpr, CH: tl.constexpr, W: tl.constexpr, EVICT: tl.constexpr
):
    """int32 code words ``[CH, W]`` of channels ``[C * CH, (C + 1) * CH)`` of the record at
    byte ``base``."""
    d = C * CH + tl.arange(0, CH)
    ptr = rec32_ptr + base // 4 + d[:, None] * W + tl.arange(0, W)[None, :]
    return tl.load(ptr, eviction_policy=EVICT)


@triton.jit
def _chunk_scale(rec16_ptr, base, OFF: tl.constexpr, C: tl.constexpr, CH: tl.constexpr):
    """Channel-scale field at byte ``OFF`` of a record, one chunk, as fp32 ``[CH]``."""
    x = tl.load(rec16_ptr + base // 2 + OFF // 2 + C * CH + tl.arange(0, CH))
    return x.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _column_token(t, NP: tl.constexpr):
    """Token held by column ``t`` of a chunk tile of :func:`_chunk_codes` (FAST widths): the
    ``NP`` phase tiles of :func:`words_to_codes_f16` interleaved column by column."""
    e = t % NP
    if NP == 4:
        e = 2 * (e & 1) + (e >> 1)
    return phase_token(t // NP, NP, 0) + e


@triton.jit
def _pair_token(c):
    """Token held by column ``c`` of a chunk tile of :func:`_chunk_codes` (PAIR widths): half
    ``c >> 5`` of the row, code ``8 * g + 4 * h + r`` of that half for ``g = c & 3``, ``r =
    (c >> 2) & 3``, ``h = (c >> 4) & 1`` (the join order of :func:`_pair_codes`)."""
    return (c >> 5) * 32 + (c & 3) * 8 + ((c >> 4) & 1) * 4 + ((c >> 2) & 3)


@triton.jit
def _word(w0, w1, w2, w3, w4, K: tl.constexpr):
    if K == 0:
        x = w0
    elif K == 1:
        x = w1
    elif K == 2:
        x = w2
    elif K == 3:
        x = w3
    else:
        x = w4
    return x


@triton.jit
def _pair(w0, w1, w2, w3, w4, I: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of each half-row (word tiles ``w0..w4 [2, CH]``: word ``k``
    of half ``j`` in row ``j``) joined: ``[2, CH, 2]``."""
    P: tl.constexpr = 4 if BITS == 3 else 0
    START: tl.constexpr = BITS * I - P  # window start, bits into the half-row
    K: tl.constexpr = START // 32 if START > 0 else 0
    SH: tl.constexpr = START - 32 * K
    END: tl.constexpr = BITS * (I + 5)  # first bit after code I + 4, into the half-row
    tl.static_assert(END <= 32 * BITS, "a pair must stay inside its half-row")
    lo = _word(w0, w1, w2, w3, w4, K)
    if END > 32 * (K + 1):
        hi = _word(w0, w1, w2, w3, w4, K + 1)
    else:
        hi = lo
    a, b = pair_codes_f16(lo, hi, SH, BITS, 1 << (BITS - 1), ASM)
    return tl.join(a, b)


@triton.jit
def _pair_group(w0, w1, w2, w3, w4, G: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Codes ``8 * G .. 8 * G + 7`` of each half-row, ``[2, CH, 2, 2, 2]`` (``4 * h + r``)."""
    t0 = _pair(w0, w1, w2, w3, w4, 8 * G, BITS, ASM)
    t1 = _pair(w0, w1, w2, w3, w4, 8 * G + 1, BITS, ASM)
    t2 = _pair(w0, w1, w2, w3, w4, 8 * G + 2, BITS, ASM)
    t3 = _pair(w0, w1, w2, w3, w4, 8 * G + 3, BITS, ASM)
    return tl.join(tl.join(t0, t2), tl.join(t1, t3))


@triton.jit
def _pair_codes(
    rec32_ptr,
    base,
    C: tl.constexpr,
    CH: tl.constexpr,
    BITS: tl.constexpr,
    ASM: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Centered fp16 codes ``[CH, 64]`` of one chunk for 3 or 5 bits (PAIR widths): the
    ``BITS`` words of each half-row (32 codes, ``32 * BITS`` bits) are loaded once as tiles
    ``[2, CH]`` (one per word index), and every 32-bit op of
    :func:`pair_codes_f16` yields codes ``i`` and ``i + 4`` of a half from a fixed window
    (constexpr word, shift and straddle per ``i``); tokens named by :func:`_pair_token`.
    The halves run along dim 0 of the word tiles and are permuted to the columns at the end:
    the tile then has the register layout of the FAST widths (32 columns per thread) and is
    stored to shared memory with 16-byte stores (scalar 2-byte stores with the halves along
    dim 1)."""
    d = C * CH + tl.arange(0, CH)
    ptr = rec32_ptr + base // 4 + d[None, :] * (2 * BITS) + tl.arange(0, 2)[:, None] * BITS
    w0 = tl.load(ptr, eviction_policy=EVICT)
    w1 = tl.load(ptr + 1, eviction_policy=EVICT)
    w2 = tl.load(ptr + 2, eviction_policy=EVICT)
    if BITS == 5:
        w3 = tl.load(ptr + 3, eviction_policy=EVICT)
        w4 = tl.load(ptr + 4, eviction_policy=EVICT)
    else:
        w3 = w2
        w4 = w2
    x0 = _pair_group(w0, w1, w2, w3, w4, 0, BITS, ASM)
    x1 = _pair_group(w0, w1, w2, w3, w4, 1, BITS, ASM)
    x2 = _pair_group(w0, w1, w2, w3, w4, 2, BITS, ASM)
    x3 = _pair_group(w0, w1, w2, w3, w4, 3, BITS, ASM)
    x = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    return tl.reshape(tl.permute(x, (1, 0, 2, 3, 4, 5, 6)), [CH, 64])


@triton.jit
def _chunk_codes(
    w,
    rec32_ptr,
    base,
    C: tl.constexpr,
    CH: tl.constexpr,
    BITS: tl.constexpr,
    FAST: tl.constexpr,
    ASM: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Centered fp16 codes ``[CH, 64]`` of one chunk. FAST: the phase tiles of the word tile
    ``w`` joined column by column (register-local), tokens named by :func:`_column_token`;
    3 and 5 bits: :func:`_pair_codes` (loads its words), tokens named by :func:`_pair_token`;
    other widths: read through the two-word windows, tokens in order."""
    CENTER: tl.constexpr = 1 << (BITS - 1)
    if FAST:
        NP: tl.constexpr = 8 // BITS
        x = words_to_codes_f16(w, 0, BITS, CENTER, ASM)
        if NP >= 2:
            x1 = words_to_codes_f16(w, BITS, BITS, CENTER, ASM)
            if NP >= 4:
                x2 = words_to_codes_f16(w, 2 * BITS, BITS, CENTER, ASM)
                x3 = words_to_codes_f16(w, 3 * BITS, BITS, CENTER, ASM)
                x = tl.join(tl.join(x, x1), tl.join(x2, x3))
            else:
                x = tl.join(x, x1)
            x = tl.reshape(x, [CH, 64])
        return x
    elif BITS == 3 or BITS == 5:
        return _pair_codes(rec32_ptr, base, C, CH, BITS, ASM, EVICT)
    else:
        d = C * CH + tl.arange(0, CH)
        row32 = rec32_ptr + base // 4 + d * 2 * BITS
        return window_codes_f16(row32, tl.arange(0, 64), BITS, CENTER, EVICT)


@triton.jit
def _gather_lat(
    in_pool, in_rec, prow, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr,
    C: tl.constexpr, CH: tl.constexpr, BITS: tl.constexpr, CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr, RS_OFF: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Latent chunk ``C`` (channels ``[C * CH, (C + 1) * CH)``, fp32 ``[N, CH]``) of the
    gathered tokens located by ``mla_common.token_sources``."""
    return latent_cols(
        in_pool, in_rec, prow, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr, C * CH, CH,
        BITS, CS_OFF, ZP_OFF, RS_OFF, FP8,
    )  # fmt: skip


@triton.jit
def _gather_scores(
    s, q, in_pool, in_rec, prow, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr,
    C: tl.constexpr, BITS: tl.constexpr, CS_OFF: tl.constexpr, ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """``s + q @ lat^T`` for the latent chunk ``C`` of the gathered tokens (``q [BH, CH]``)."""
    lat = _gather_lat(
        in_pool, in_rec, prow, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr, C,
        q.shape[1], BITS, CS_OFF, ZP_OFF, RS_OFF, FP8,
    )  # fmt: skip
    return tl.dot(q, tl.trans(lat), s)


@triton.jit
def _gather_values(
    acc, p, alpha, in_pool, in_rec, prow, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr,
    C: tl.constexpr, BITS: tl.constexpr, CS_OFF: tl.constexpr, ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """``acc * alpha + p @ lat`` for the latent chunk ``C`` of the gathered tokens, read again
    (cache hits) rather than kept live across the softmax, where the four chunks' shared-memory
    buffers would overlap."""
    lat = _gather_lat(
        in_pool, in_rec, prow, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr, C,
        acc.shape[1], BITS, CS_OFF, ZP_OFF, RS_OFF, FP8,
    )  # fmt: skip
    return acc * alpha[:, None] + tl.dot(p, lat)


@triton.jit
def _chunk_scores(
    sa,
    qz,
    cmax,
    q,
    w,
    rec16_ptr,
    rec32_ptr,
    base,
    C: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    FAST: tl.constexpr,
    ASM: tl.constexpr,
):
    """Pass 1 of a packed block, one latent chunk ``q [BH, CH]``: the score sums
    ``sa += (q * cs / cmax) @ codes`` (16-bit codes; ``q * cs / cmax`` as two fp16 operands
    ``hi + lo``, about 2^-22: one fp16 operand, 2^-12, is too coarse on records whose
    zero-point term nearly cancels the code term, see ``decode_mma_t._qs_t``) and
    ``qz += q @ zpc``."""
    CH: tl.constexpr = q.shape[1]
    cs = _chunk_scale(rec16_ptr, base, CS_OFF, C, CH)
    zpc = _chunk_scale(rec16_ptr, base, ZP_OFF, C, CH) + cs * (1 << (BITS - 1))
    qs, qt = f16_parts(q * (cs / cmax)[None, :])
    qz = qz + tl.sum(q * zpc[None, :], axis=1)
    codes = _chunk_codes(w, rec32_ptr, base, C, CH, BITS, FAST, ASM, "evict_last")
    return tl.dot(qs, codes, tl.dot(qt, codes, sa)), qz


@triton.jit
def _chunk_values(
    acc,
    pw,
    pz,
    alpha,
    wscale,
    rec16_ptr,
    rec32_ptr,
    base,
    C: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    FAST: tl.constexpr,
    ASM: tl.constexpr,
):
    """Pass 2 of a packed block, one latent chunk ``acc [BH, CH]``: the chunk's words and
    scales are read again (cache hits) and unpacked again rather than kept live across the
    softmax; ``acc = acc * alpha + wscale * (cs * (pw @ codes^T) + zpc * pz)``."""
    CH: tl.constexpr = acc.shape[1]
    w = pz  # no word tile on the window path
    if FAST:
        w = _chunk_words(rec32_ptr, base, C, CH, W, "evict_first")
    codes = _chunk_codes(w, rec32_ptr, base, C, CH, BITS, FAST, ASM, "evict_first")
    va = tl.dot(pw, tl.trans(codes))
    cs = _chunk_scale(rec16_ptr, base, CS_OFF, C, CH)
    zpc = _chunk_scale(rec16_ptr, base, ZP_OFF, C, CH) + cs * (1 << (BITS - 1))
    return acc * alpha[:, None] + wscale[:, None] * (va * cs[None, :] + pz[:, None] * zpc[None, :])


@triton.jit
def _store_chunk(po_ptr, prow, hok, acc, l, C: tl.constexpr):
    CH: tl.constexpr = acc.shape[1]
    d = C * CH + tl.arange(0, CH)
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(po_ptr + prow[:, None] * 512 + d[None, :], out, mask=hok[:, None])


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
    NC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = h < H
    h = tl.where(hok, h, 0)
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
    qr = tl.load(q_ptr + qrow[:, None] * 576 + 512 + r[None, :], mask=hok[:, None], other=0.0)
    qr = qr.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    CH: tl.constexpr = 512 // NC
    q0 = _load_q(qrot_ptr, qrow, hok, 0, CH)
    a0 = tl.zeros([BLOCK_H, CH], tl.float32)
    if NC >= 2:
        q1 = _load_q(qrot_ptr, qrow, hok, 1, CH)
        a1 = tl.zeros([BLOCK_H, CH], tl.float32)
    if NC >= 4:
        q2 = _load_q(qrot_ptr, qrow, hok, 2, CH)
        q3 = _load_q(qrot_ptr, qrow, hok, 3, CH)
        a2 = tl.zeros([BLOCK_H, CH], tl.float32)
        a3 = tl.zeros([BLOCK_H, CH], tl.float32)
    if SPARSE:
        # BLOCK_N selected tokens at a time, each from its pool row or record; the 512 latent
        # channels in NC fp32 chunks (tf32 dots on the GPU), so no dot operand is wider than
        # [BLOCK_N, CH]. num_stages=1: the pipeliner's staging buffers for the gathered
        # scales and codes took 45 KB of shared memory (over sm_120's limit).
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1):
            n = n0 + tl.arange(0, BLOCK_N)
            inb = n < hi
            logical = tl.load(idx_ptr + b * idx_stride + tl.where(inb, n, 0), mask=inb, other=-1)
            ok = (logical >= 0) & (logical < seq_len)
            lg = tl.where(ok, logical, 0)
            lb = lg // 64
            ok = ok & (lb < max_blocks)
            pb = tl.load(bt_ptr + b * bt_stride + tl.where(ok, lb, 0), mask=ok, other=0)
            slot = pb.to(tl.int64) * 64 + lg % 64
            in_pool, in_rec, prow_, rbase, off = token_sources(slot, ok, map_ptr, REC)
            rope = token_rope(in_pool, in_rec, prow_, rbase, off, rec16_ptr, prope_ptr, ROPE_OFF)
            s = tl.dot(qr, tl.trans(bf16_bits_to_f32(rope)))
            src = (in_pool, in_rec, prow_, rbase, off, rec_ptr, rec16_ptr, pool_ptr, pscale_ptr)
            s = _gather_scores(s, q0, *src, 0, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
            if NC >= 2:
                s = _gather_scores(s, q1, *src, 1, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
            if NC >= 4:
                s = _gather_scores(s, q2, *src, 2, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
                s = _gather_scores(s, q3, *src, 3, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
            s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            a0 = _gather_values(a0, p, alpha, *src, 0, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
            if NC >= 2:
                a1 = _gather_values(a1, p, alpha, *src, 1, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
            if NC >= 4:
                a2 = _gather_values(a2, p, alpha, *src, 2, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
                a3 = _gather_values(a3, p, alpha, *src, 3, BITS, CS_OFF, ZP_OFF, RS_OFF, FP8)
            m = m_new
    else:
        # Whole blocks, the 512 latent channels in NC chunks of CH. Widths dividing 8 (FAST)
        # load a chunk's codes as int32 words [CH, W] and unpack them by phase (the field at
        # bit e * BITS of every byte) into one tile [CH, 64] whose columns are the tokens
        # tokc; widths 3 and 5 load each half-row's words once and unpack two codes per op
        # (_pair_codes, columns tokc); other widths read each code's two-word window
        # (window_codes_f16), tokens in order. Pass 1 sums the scores over the chunks; pass 2
        # reads each chunk's words again (cache hits) for the value dot, so no unpacked tile
        # stays live across the softmax.
        FAST: tl.constexpr = (8 % BITS) == 0
        NP: tl.constexpr = 8 // BITS if FAST else 1
        W: tl.constexpr = 2 * BITS if FAST else 1
        tok = tl.arange(0, 64)
        if FAST:
            tokc = _column_token(tok, NP)  # token of each column of a chunk's code tile
        elif BITS == 3 or BITS == 5:
            tokc = _pair_token(tok)
        else:
            tokc = tok
        bt_row = bt_ptr + b * bt_stride
        # Software pipeline: the pass-1 code words of block u + 1, its block-pool map entry
        # and the block-table entry of u + 2 are loaded during block u (the small scale and
        # RoPE loads of block u are issued at its start). The words of a pool block are read
        # too (unused; a request has few pool blocks).
        blk = tl.load(bt_row + lo)
        blk_n = tl.load(bt_row + tl.minimum(lo + 1, hi - 1))
        pb = tl.load(map_ptr + blk)
        base = blk.to(tl.int64) * REC
        w0 = blk  # no word tiles on the window path
        w1 = blk
        w2 = blk
        w3 = blk
        if FAST:
            w0 = _chunk_words(rec32_ptr, base, 0, CH, W, "evict_last")
        if NC >= 2 and FAST:
            w1 = _chunk_words(rec32_ptr, base, 1, CH, W, "evict_last")
        if NC >= 4 and FAST:
            w2 = _chunk_words(rec32_ptr, base, 2, CH, W, "evict_last")
            w3 = _chunk_words(rec32_ptr, base, 3, CH, W, "evict_last")
        for u in range(lo, hi):
            blk_nn = tl.load(bt_row + tl.minimum(u + 2, hi - 1))
            pb_n = tl.load(map_ptr + blk_n)
            base_n = blk_n.to(tl.int64) * REC
            if FAST:
                w0_n = _chunk_words(rec32_ptr, base_n, 0, CH, W, "evict_last")
            if NC >= 2 and FAST:
                w1_n = _chunk_words(rec32_ptr, base_n, 1, CH, W, "evict_last")
            if NC >= 4 and FAST:
                w2_n = _chunk_words(rec32_ptr, base_n, 2, CH, W, "evict_last")
                w3_n = _chunk_words(rec32_ptr, base_n, 3, CH, W, "evict_last")
            valid = tl.minimum(seq_len - u * 64, 64)
            if pb >= 0:
                # exact-pool block: fp32 latent chunks (tf32 dots on the GPU), read twice
                prow_ = pb.to(tl.int64) * 64 + tok
                rope = tl.load(
                    prope_ptr + prow_[:, None] * 64 + r[None, :],
                    mask=(tok < valid)[:, None],
                    other=0,
                )
                s = tl.dot(qr, tl.trans(bf16_bits_to_f32(rope)))
                s = tl.dot(q0, tl.trans(_pool_lat(pool_ptr, pscale_ptr, pb, valid, 0, CH, FP8)), s)
                if NC >= 2:
                    lat1 = _pool_lat(pool_ptr, pscale_ptr, pb, valid, 1, CH, FP8)
                    s = tl.dot(q1, tl.trans(lat1), s)
                if NC >= 4:
                    lat2 = _pool_lat(pool_ptr, pscale_ptr, pb, valid, 2, CH, FP8)
                    s = tl.dot(q2, tl.trans(lat2), s)
                    lat3 = _pool_lat(pool_ptr, pscale_ptr, pb, valid, 3, CH, FP8)
                    s = tl.dot(q3, tl.trans(lat3), s)
                s = tl.where(tok[None, :] < valid, s * sm_scale, float("-inf"))
                # valid >= 1 token: m_new is finite
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                a0 = _pool_values(a0, p, alpha, pool_ptr, pscale_ptr, pb, valid, 0, FP8)
                if NC >= 2:
                    a1 = _pool_values(a1, p, alpha, pool_ptr, pscale_ptr, pb, valid, 1, FP8)
                if NC >= 4:
                    a2 = _pool_values(a2, p, alpha, pool_ptr, pscale_ptr, pb, valid, 2, FP8)
                    a3 = _pool_values(a3, p, alpha, pool_ptr, pscale_ptr, pb, valid, 3, FP8)
                m = m_new
            else:
                # Scales fold into the dots (record: x[d, t] = (code * cs[d] + zp[d]) * rs[t]):
                #   score[t] = rs[t] * (cmax * ((q * cs / cmax) @ (code - C)) + q @ zpc) + rope
                #   out[d] += cs[d] * (pw @ (code - C)^T)[d] + zpc[d] * sum(pw)
                # with centered codes (C = 2^(BITS-1)), zpc = zp + C * cs, pw = p * rs (fp16
                # operands, fp32 accumulation; p relative to the block's max score and rs to
                # its largest row scale, so both fp16 operands are normalized).
                rb16 = rec16_ptr + base // 2
                rs = tl.load(rb16 + RS_OFF // 2 + tokc, mask=tokc < valid, other=0)
                rope = tl.load(rb16 + ROPE_OFF // 2 + tokc[:, None] * 64 + r[None, :])
                rs = rs.to(tl.float16, bitcast=True).to(tl.float32)
                rmax = tl.max(rs, axis=0)
                rmax = tl.where(rmax > 0.0, rmax, 1.0)
                cmax = tl.max(tl.abs(_chunk_scale(rec16_ptr, base, CS_OFF, 0, 512)), axis=0)
                cmax = tl.where(cmax > 0.0, cmax, 1.0)
                # pass 1: scores, summed over the chunks
                sa = tl.zeros([BLOCK_H, 64], tl.float32)
                qz = tl.zeros([BLOCK_H], tl.float32)
                sa, qz = _chunk_scores(
                    sa, qz, cmax, q0, w0, rec16_ptr, rec32_ptr, base, 0, BITS, CS_OFF, ZP_OFF,
                    FAST, ASM,
                )  # fmt: skip
                if NC >= 2:
                    sa, qz = _chunk_scores(
                        sa, qz, cmax, q1, w1, rec16_ptr, rec32_ptr, base, 1, BITS, CS_OFF,
                        ZP_OFF, FAST, ASM,
                    )  # fmt: skip
                if NC >= 4:
                    sa, qz = _chunk_scores(
                        sa, qz, cmax, q2, w2, rec16_ptr, rec32_ptr, base, 2, BITS, CS_OFF,
                        ZP_OFF, FAST, ASM,
                    )  # fmt: skip
                    sa, qz = _chunk_scores(
                        sa, qz, cmax, q3, w3, rec16_ptr, rec32_ptr, base, 3, BITS, CS_OFF,
                        ZP_OFF, FAST, ASM,
                    )  # fmt: skip
                s = (sa * cmax + qz[:, None]) * rs[None, :]
                s = s + tl.dot(qr, tl.trans(bf16_bits_to_f32(rope)))
                s = tl.where(tokc[None, :] < valid, s * sm_scale, float("-inf"))
                # valid >= 1 token: m_blk is finite. Block-relative weights p = exp(s - m_blk)
                # (<= 1); fp16 value weights pw = p * rs / rmax.
                m_blk = tl.max(s, axis=1)
                m_new = tl.maximum(m, m_blk)
                alpha = tl.exp(m - m_new)
                beta = tl.exp(m_blk - m_new)
                p = tl.exp(s - m_blk[:, None])
                pw = (p * (rs / rmax)[None, :]).to(tl.float16)
                pz = tl.sum(pw.to(tl.float32), axis=1)
                l = l * alpha + beta * tl.sum(p, axis=1)
                ws = beta * rmax
                # pass 2: values, chunk by chunk
                a0 = _chunk_values(
                    a0, pw, pz, alpha, ws, rec16_ptr, rec32_ptr, base, 0, BITS, W, CS_OFF,
                    ZP_OFF, FAST, ASM,
                )  # fmt: skip
                if NC >= 2:
                    a1 = _chunk_values(
                        a1, pw, pz, alpha, ws, rec16_ptr, rec32_ptr, base, 1, BITS, W, CS_OFF,
                        ZP_OFF, FAST, ASM,
                    )  # fmt: skip
                if NC >= 4:
                    a2 = _chunk_values(
                        a2, pw, pz, alpha, ws, rec16_ptr, rec32_ptr, base, 2, BITS, W, CS_OFF,
                        ZP_OFF, FAST, ASM,
                    )  # fmt: skip
                    a3 = _chunk_values(
                        a3, pw, pz, alpha, ws, rec16_ptr, rec32_ptr, base, 3, BITS, W, CS_OFF,
                        ZP_OFF, FAST, ASM,
                    )  # fmt: skip
                m = m_new
            blk_n = blk_nn
            pb = pb_n
            base = base_n
            if FAST:
                w0 = w0_n
            if NC >= 2 and FAST:
                w1 = w1_n
            if NC >= 4 and FAST:
                w2 = w2_n
                w3 = w3_n
    _store_chunk(po_ptr, prow, hok, a0, l, 0)
    if NC >= 2:
        _store_chunk(po_ptr, prow, hok, a1, l, 1)
    if NC >= 4:
        _store_chunk(po_ptr, prow, hok, a2, l, 2)
        _store_chunk(po_ptr, prow, hok, a3, l, 3)
    # l == 0: nothing read; NaN (a NaN or infinite query): kept, so the output is NaN
    lse = tl.where(l != 0.0, m + tl.log(tl.where(l != 0.0, l, 1.0)), float("-inf"))
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
def _mma_module():
    mods = gluon_modules("mla_decode_mma")
    return None if mods is None else mods[0]


@functools.cache
def _wgmma_module():
    mods = gluon_modules("mla_decode_wgmma")
    return None if mods is None else mods[0]


def _gluon_call(q: torch.Tensor, sparse: bool) -> bool:
    """Whether a Gluon kernel may serve this call (full context, sm_80+, not switched off)."""
    return MMA_KERNEL and not sparse and cuda_feature(q, "KVARN_MLA_MMA", (8, 0))


def _use_mma_kernel(bits: int, q: torch.Tensor, sparse: bool) -> bool:
    """Whether the ``mma.sync`` Gluon kernel could serve this call (4-bit codes; on sm_90 the
    ``wgmma`` kernel takes precedence, :func:`_use_wgmma_kernel`)."""
    if not _gluon_call(q, sparse):
        return False
    mod = _mma_module()
    return mod is not None and mod.mla_mma_supported(bits)


@functools.cache
def _wgmma64_module():
    mods = gluon_modules("mla_decode_wgmma64")
    return None if mods is None else mods[0]


def _use_wgmma64_kernel(bits: int, q: torch.Tensor, sparse: bool) -> bool:
    """Whether the 64-head ``wgmma`` kernel serves this call: one the ``wgmma`` kernel serves,
    with at least ``WGMMA64_MIN_HEADS`` query heads."""
    if WGMMA64_MIN_HEADS is None or q.shape[1] < WGMMA64_MIN_HEADS:
        return False
    if os.environ.get("KVARN_MLA_WGMMA64") == "0" or not _use_wgmma_kernel(bits, q, sparse):
        return False
    mod = _wgmma64_module()
    return mod is not None and mod.mla_wgmma64_supported(bits)


def _use_wgmma_kernel(bits: int, q: torch.Tensor, sparse: bool) -> bool:
    """Whether the ``wgmma`` kernel serves this call: a Gluon call of a code width in
    ``WGMMA_BITS`` on an sm_90 device."""
    if not WGMMA_KERNEL or not _gluon_call(q, sparse):
        return False
    if os.environ.get("KVARN_MLA_WGMMA") == "0" or device_capability(q.device.index)[0] != 9:
        return False
    mod = _wgmma_module()
    return bits in WGMMA_BITS and mod is not None and mod.mla_wgmma_supported(bits)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def combine_rows(rows: int, device) -> int:
    """Rows merged per program of the combine kernel: 16, or fewer (a power of two, down to 1)
    when 16 would leave SMs idle. One program reads every live split of its rows in turn, so
    at batch 1 with 128 splits one 16-row program took 43 us on the H200."""
    per = rows // _sm_count(torch.device(device))
    r = 1
    while r * 2 <= min(per, BLOCK_H):
        r *= 2
    return r


MAX_AUTO_SPLITS = 256
"""Most splits :func:`mla_decode_workspace` picks by itself (batch 1 with 16 heads: 8 MB)."""


def mla_decode_workspace(
    batch: int, num_heads: int, num_splits: int | None = None, device=None
) -> MlaDecodeWorkspace:
    """Workspace for :func:`mla_decode` (the reference's, see
    :func:`kvarn_ops.reference.mla.mla_decode_workspace`).

    ``num_splits=None`` picks enough split-K partitions for one program per SM at this batch
    and head count (at most ``MAX_AUTO_SPLITS``), and no fewer than the launcher runs when
    it may run more (:func:`live_splits`: up to 32, as many as fill the SMs with the kernels'
    programs). On the H200 (132 SMs, 16 heads, 32K, k4, CUDA-graph replay) batch 1 took 0.128
    ms with 32 splits, 0.069 ms with 128 and 0.089 ms with 256 (the combine merges twice the
    rows, each split reads 2 blocks); the Triton kernel 0.156 / 0.066 / 0.082 ms. The part
    rows take ``B * H * splits * 2 KB``: a batch of 256 requests with 128 heads gets one split
    (64 MB; a floor of 32 splits, which the launcher could not use there, took 2 GiB)."""
    check_count("batch", batch)
    check_count("num_heads", num_heads)
    if num_splits is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        # the head groups of the kernel a large head count takes on sm_90 (64 heads, one
        # program per SM) need more splits to fill the GPU than 16-head groups do
        wide = WGMMA64_MIN_HEADS is not None and num_heads >= WGMMA64_MIN_HEADS
        per = WIDE_HEADS if wide else BLOCK_H
        groups = max(1, batch * triton.cdiv(num_heads, per))
        fill = triton.cdiv(_sm_count(dev), groups)
        cap = live_splits(batch, num_heads, 1 << 30, dev)
        if wide:
            cap = max(cap, live_splits(batch, num_heads, 1 << 30, dev, WIDE_HEADS, 1))
        num_splits = min(MAX_AUTO_SPLITS, max(fill, min(32, cap)))
    return _ref.mla_decode_workspace(batch, num_heads, num_splits, device)


def live_splits(
    batch: int,
    heads: int,
    num_splits: int,
    device,
    block_h: int = BLOCK_H,
    ctas_per_sm: int = CTAS_PER_SM,
) -> int:
    """Splits launched per (request, group of ``block_h`` heads): at most the workspace's
    ``num_splits``, and no more than fill the SMs ``ctas_per_sm`` programs deep (host
    arithmetic only)."""
    groups = max(1, batch * triton.cdiv(heads, block_h))
    return max(1, min(num_splits, (_sm_count(torch.device(device)) * ctas_per_sm) // groups))


def _decode_op_impl(
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
    launch(
        _mla_qrot_kernel, (triton.cdiv(bh, BLOCK_H),), q, ws_q_rot, bh, BLOCK_H=BLOCK_H, num_warps=4
    )
    sparse = indices is not None
    idx = indices if sparse else seq_lens
    wgmma = _use_wgmma_kernel(offs["BITS"], q, sparse)
    wide = wgmma and _use_wgmma64_kernel(offs["BITS"], q, sparse)
    if wide:
        # 64 heads per program, one program per SM
        ns = live_splits(bsz, heads, s, q.device, WIDE_HEADS, 1)
    else:
        ns = live_splits(bsz, heads, s, q.device)
    if wgmma or _use_mma_kernel(offs["BITS"], q, sparse):
        # the Gluon kernels: one argument list, their own launch options
        gluon_args = (
            q,
            ws_q_rot,
            packed.view(torch.float16),
            packed.view(torch.int32),
            packed.view(torch.bfloat16),
            block_pool_map,
            pl,
            ps,
            pool_rope,
            block_table,
            seq_lens,
            ws_part_out,
            ws_part_lse,
            heads,
            s,
            block_table.stride(0),
            block_table.shape[1],
            softmax_scale * 1.4426950408889634,
        )
        consts = {k: v for k, v in offs.items() if k != "BITS"}
        consts.update(FP8=fp8, MIN_BLOCKS=MIN_BLOCKS_PER_SPLIT)
        grid = (bsz, ns, triton.cdiv(heads, WIDE_HEADS if wide else BLOCK_H))
        if wide:
            mod = _wgmma64_module()
            launch(
                mod.mla_wgmma64_kernel,
                grid,
                *gluon_args,
                num_warps=mod.NUM_WARPS,
                BITS=offs["BITS"],
                **consts,
            )
        elif wgmma:
            mod = _wgmma_module()
            launch(
                mod.mla_wgmma_kernel,
                grid,
                *gluon_args,
                num_warps=mod.NUM_WARPS,
                BITS=offs["BITS"],
                **consts,
            )
        else:
            opts = {} if MMA_MAXNREG is None else {"maxnreg": MMA_MAXNREG}
            launch(
                _mma_module().mla_mma_kernel,
                grid,
                *gluon_args,
                NBUF=MMA_NBUF,
                num_warps=4,
                **consts,
                **opts,
            )
    else:
        grid = (bsz, ns, triton.cdiv(heads, BLOCK_H))
        many = not sparse and grid[0] * grid[1] * grid[2] > _sm_count(q.device)
        launch(
            _mla_decode_kernel,
            grid,
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
            NC=512 // CHUNK,
            num_warps=NUM_WARPS_MANY if many else NUM_WARPS,
            maxnreg=MAXNREG,
            **offs,
        )
    rows = combine_rows(bh, q.device)
    launch(
        _mla_combine_kernel,
        (triton.cdiv(bh, rows),),
        ws_part_out,
        ws_part_lse,
        out,
        bh,
        s,
        ns,
        BLOCK_H=rows,
        num_warps=4,
    )


_decode_op = torch.library.custom_op(
    "kvarn::mla_decode", mutates_args=("out", "ws_q_rot", "ws_part_out", "ws_part_lse")
)(_decode_op_impl)


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


def _mla_decode_switches() -> tuple:
    """What :func:`mla_decode`'s path reads besides its arguments (part of every plan's
    signature, :mod:`._fastlaunch`): environment switches, module settings and the kernel
    choices that tests and benchmarks replace."""
    env = os.environ.get
    return (
        env("KVARN_MLA_MMA"), env("KVARN_MLA_WGMMA"), env("KVARN_MLA_WGMMA64"), BLOCK_H,
        BLOCK_N, NUM_WARPS, NUM_WARPS_MANY, MAXNREG, CTAS_PER_SM, WIDE_HEADS,
        MIN_BLOCKS_PER_SPLIT, CHUNK, MMA_KERNEL, WGMMA_KERNEL, WGMMA_BITS, WGMMA64_MIN_HEADS,
        MMA_NBUF, MMA_MAXNREG, _use_mma_kernel, _use_wgmma_kernel, _use_wgmma64_kernel,
        combine_rows, live_splits, _mla_decode_kernel, _mla_combine_kernel,
    )  # fmt: skip


_PLANS = PlanCache(_mla_decode_switches)
"""Recorded launches of :func:`mla_decode` calls (host time: see :mod:`._fastlaunch`)."""


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

    A repeated call of one signature (shapes, strides, dtypes, alignment, layout, scale)
    replays the launches of the first without its checks (:mod:`._fastlaunch`).
    """
    if workspace is None:
        raise ValueError(
            "workspace: required; create it once with mla_decode_workspace(B, H, "
            "num_splits, device)"
        )
    tensors: tuple = ()
    key = None
    if type(workspace) is MlaDecodeWorkspace and type(softmax_scale) in (float, int):
        tensors = (q, packed, block_table, seq_lens, block_pool_map, pool_latent, pool_scale,
                   pool_rope, out, workspace.q_rot, workspace.part_out, workspace.part_lse,
                   indices)  # fmt: skip
        key = _PLANS.key(tensors, (id(layout), softmax_scale))
        if _PLANS.replay(key, tensors):
            return
    with _PLANS.recording(key, tensors, keep=(layout,)):
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
            softmax_scale,
        )
        check_device(q)
        if CHUNK not in (128, 256, 512):
            raise ValueError(f"CHUNK: must be 128, 256 or 512 latent channels, got {CHUNK}")
        launch_or_op(
            _decode_op,
            _decode_op_impl,
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
