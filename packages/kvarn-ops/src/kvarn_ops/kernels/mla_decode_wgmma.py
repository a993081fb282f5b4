"""MLA decode main kernel for sm_90 (Gluon, ``wgmma``): each latent tile (2, 4 or 5 bits) is
unpacked once into shared memory and both products read it from there, for full-context decode
(no ``indices``) of ``kvarn_mla_k{2,4,5}_g64``, 16 heads per program (from 64 heads the
64-head kernel of ``mla_decode_wgmma64.py`` takes over; it shares this file's helpers).

The ``mma.sync`` kernel (``mla_decode_mma.py``) puts the 16 heads on the MMA's M axis, so the
code tile is a B operand of both products, in two orientations: it is unpacked twice per block
and every warp repeats the softmax (about 2,700 instructions per warp and block; latency
bound at 17% of copy bandwidth on the H200). Here the tokens and the channels are the M axis:

- the block's codes become the fp16 tile ``T[c, t] = fp16(2^-e (cs[c] code[c, t] + zp[c]))``
  (one ``fma.rn.f16x2`` per two codes, one rounding; ``2^e`` a power of two per block that
  puts the largest possible magnitude ``max_c (2^b - 1) |cs[c]| + |zp[c]|`` in
  ``[2^14, 2^15)``, so no record overflows or underflows fp16), stored once into shared
  memory as four [128, 64] channel buffers, tokens contiguous, 128-byte swizzle (one buffer
  took a barrier between the stores of its slices). Each ``fma`` makes the codes of two
  tokens 16 or 20 bits apart in the record, and the tile keeps them side by side in that
  permuted token order (:func:`tile_token`; the RoPE rows, row scales and token masks follow
  it), so no byte permute repacks them. 4-bit codes (word ``j``: tokens ``8 j .. 8 j + 7``):
  nibbles ``k`` and ``k + 4`` are 16 bits apart: a shift, a ``lop3`` into the mantissas of
  1024.0, a ``sub.f16x2`` leaves the codes. 5-bit codes (a channel's 64 codes are 10 words,
  tokens ``32 h .. 32 h + 31`` in words ``5 h .. 5 h + 4``): codes ``i`` and ``i + 4`` sit 20
  bits apart, so one 32-bit window (a shift, or a funnel shift where it straddles two words)
  and one ``lop3`` put them into the mantissas of 1024.0 as ``code`` and ``16 code``, and an
  exact ``fma.rn.f16x2`` by ``(1, 1/16)`` less ``(1024, 64)`` leaves the codes. 2-bit codes (4
  words a channel, word ``j`` tokens ``16 j .. 16 j + 15``): codes ``i`` and ``i + 8`` sit 16
  bits apart: a shift, a ``lop3``, a ``sub.f16x2``. Then the scaling ``fma``;
- scores ``S^T[64 tokens, 16 heads] = T^T @ q^T`` (``wgmma`` m64n16k16, ``T`` read transposed
  from shared memory; two independent chains over the channel halves), times ``2^e rs[t]`` in
  fp32, plus the RoPE part ``rope @ q_rope^T`` (bf16 operands, the query's RoPE part as two
  bf16 terms);
- one softmax step over the tokens (the M axis, 16 tokens per warp): each warp's maximum and
  sum go to shared memory together and one barrier later every thread combines the four
  (:func:`_block_softmax`; a reduction over the M axis took two barriers for each);
- values ``O^T[512, 16] += T @ pw^T`` with ``pw = fp16(p rs / rmax)`` (``wgmma`` m64n16k16, four
  [128, 16] accumulators, one per tile buffer), the running accumulator kept in units of
  ``rmax 2^e`` of the latest block (its rescale folded into the softmax's; ``rmax`` reduced
  within each warp from a second copy of the row scales).

Four barriers per packed block: the top one (the previous value product has read the tile;
it also carries each warp's share of the tile's exponent ``e``), the tile complete, the
softmax exchange, the weights stored.

The latent tile ``cs * code + zp`` is rounded once per element to fp16 (relative 2^-11 of the
latent itself, as a bf16 or fp16 latent cache would be): on records whose zero-point term nearly
cancels the code term, the fused multiply-add cancels exactly before rounding, where the
``mma.sync`` kernels need the query in two fp16 parts. The query latent is one fp16 operand.

One program: one request, one split of its 64-token blocks, 16 heads, one warpgroup (four
warps). Records are read into registers one block ahead (code words, channel vectors, row
scales, RoPE rows). Blocks mapped to the exact pool (``block_pool_map``: the filling tail,
sinks, rehydrated blocks) take the same path with the tile built from the pool rows (fp8 pools
scaled per token through ``rs``). Partial rows and natural-log log-sum-exps go to the same
workspace as the other kernels', merged by the Triton combine kernel.

Speed (H200, CUDA-graph replay, 16 heads; BENCHMARKS.md): batch 64 at 16K 0.287 ms at 4 bits
(36.1% of copy bandwidth; the ``mma.sync`` kernel 0.603 ms), 0.306 ms at 5 bits (39.1%),
batch 8 at 32K 0.092 ms. 255 registers (0-32 B of spill frame), about 100 KB of shared memory,
two programs per SM. The shared-memory views are taken inside the loop through a
loop-dependent zero index (``z``): with loop-invariant views the compiler hoisted all 72
``wgmma`` descriptors out of the loop and spilled them (216 B, 17% of the stall samples on
reloading them). Neither eight warps per program, an L2 prefetch of the record two blocks
ahead, nor issuing the next block's scale arithmetic under the value product made it faster:
the block's serial chain (unpack, scores, softmax, values, each behind a barrier) bounds it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from kvarn_ops.kernels.decode_mma import _joined, _stack4

__all__ = ["MLA_WGMMA_BITS", "mla_wgmma_kernel", "mla_wgmma_supported"]

MLA_WGMMA_BITS = (2, 4, 5)

_ACC: gl.constexpr = gl.NVMMADistributedLayout(
    version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]
)
_TOK: gl.constexpr = gl.SliceLayout(1, _ACC)  # [64] tokens of S^T, or [512] channels of O^T
_HEAD: gl.constexpr = gl.SliceLayout(0, _ACC)  # [16] heads
_SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
# code words of a 128-channel chunk [128, 8]: one channel's 8 words (32 B) per thread (4-bit
# codes: all of them; 5-bit: the first 8 of 10, the last two in [128, 2])
_LW: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[32, 1], warps_per_cta=[4, 1], order=[1, 0]
)
_LW2: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 2], threads_per_warp=[32, 1], warps_per_cta=[4, 1], order=[1, 0]
)
# 2-bit codes: a channel's 4 words (16 B) per thread
_LW4: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[4, 1], order=[1, 0]
)
_CH: gl.constexpr = gl.SliceLayout(1, _LW)
# [64, 64] RoPE rows and [128, 64] pool latents (16-byte runs), [16, 512] / [16, 64] queries
_LR: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0]
)
_LQ: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0]
)
# a block's 64 row scales [1, 64] in every warp (their maximum without a cross-warp step)
_RW: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 2], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0]
)
# every thread: the four warps' partial maxima (or sums) of its columns of S^T [64, 16]
_REP: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]],
    lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
    warp_bases=[[0, 0], [0, 0]],
    block_bases=[],
    shape=[4, 16],
)
_S2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
# every thread: the four warps' partial maxima of the tile's channel magnitudes
_REP4: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2]], lane_bases=[[0], [0], [0], [0], [0]], warp_bases=[[0], [0]],
    block_bases=[], shape=[4],
)  # fmt: skip
_S1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
NUM_WARPS = 4

TILE_PERM4 = gl.constexpr((0, 1, 3, 2))
"""Permutation of the 4-bit unpack's [C, 8 j, 2 r, 4 k] (token ``8 j + 4 r + k``) into the
tile's [C, j, k, r]: position ``8 j + 2 k + r`` (:func:`tile_token`)."""
TILE_PERM5 = gl.constexpr((0, 4, 3, 2, 1))
"""Permutation of the 5-bit unpack's [C, 2 r, 4 i, 4 G, 2 h] (token ``32 h + 8 G + 4 r + i``)
into the tile's [C, h, G, i, r]: position ``32 h + 8 G + 2 i + r`` (:func:`tile_token`)."""
TILE_PERM2 = gl.constexpr((0, 4, 3, 2, 1))
"""Permutation of the 2-bit unpack's [C, 2 r, 4 a, 2 b, 4 j] (token ``16 j + 8 r + 4 b + a``)
into the tile's [C, j, b, a, r]: position ``16 j + 8 b + 2 a + r`` (:func:`tile_token`)."""


def tile_token(q: int, bits: int) -> int:
    """The token at position ``q`` of a ``bits``-bit block's fp16 tile. The tile keeps the
    two codes of each unpacked fp16 pair side by side (one 32-bit register, stored without a
    byte permute): 4- and 5-bit pairs are tokens ``i, i + 4`` and 2-bit pairs ``i, i + 8``
    (the two codes 16 or 20 bits apart in the record), so the tiles hold their tokens in a
    fixed permuted order. Both products sum over the tokens, so the order only has to be the
    same for the codes, the RoPE rows, the row scales and the token mask (:func:`_tile_token`,
    the same formula)."""
    if bits in (4, 5):
        return (q & ~7) | ((q & 1) << 2) | ((q >> 1) & 3)
    if bits == 2:
        return (q & ~15) | ((q & 1) << 3) | (((q >> 3) & 1) << 2) | ((q >> 1) & 3)
    return q


def mla_wgmma_supported(bits: int) -> bool:
    """Whether a latent code width takes this kernel (full-context decode, sm_90 only)."""
    return bits in MLA_WGMMA_BITS


@gluon.constexpr_function
def dq_asm(bits, i):
    """PTX of the ``bits``-bit pair ``i``, ``i + 16 / bits`` of a word (4 bits: ``i < 4``,
    tokens ``8 j + i`` and ``+ 4`` of word ``j``; 2 bits: ``i < 8``, tokens ``16 j + i`` and
    ``+ 8``; the two codes sit 16 bits apart): ``$1`` the word (``$2``, its copy, unused),
    ``$3`` / ``$4`` the fp16 pairs of the channel's scale and zero point; ``$0`` the fp16
    pair ``fma(code, cs, zp)``: a shift (none for ``i = 0``), a ``lop3`` into the mantissas
    of 1024.0, an exact ``sub.f16x2`` of 1024, the scaling ``fma``."""
    m = (1 << bits) - 1
    win = f"shr.u32 t, $1, {bits * i}; " if i > 0 else "mov.b32 t, $1; "
    return (
        "{ .reg .b32 t, o; " + win + f"lop3.b32 t, t, 0x000{m:X}000{m:X}, 0x64006400, 0xea; "
        "mov.b32 o, 0x64006400; sub.f16x2 t, t, o; fma.rn.f16x2 $0, t, $3, $4; }"
    )


@gluon.jit
def _pair16(w, cs2, zp2, BITS: gl.constexpr, I: gl.constexpr):
    """``BITS``-bit codes ``I`` and ``I + 16 / BITS`` of words ``w`` (:func:`dq_asm`) as the
    fp16 pair ``fma(code, cs, zp)``: a trailing axis of 2 on ``w``'s shape."""
    return gl.inline_asm_elementwise(
        dq_asm(BITS, I), "=r,r,r,r,r", [_joined(w, w), cs2, zp2], dtype=gl.float16,
        is_pure=True, pack=2,
    )  # fmt: skip


@gluon.jit
def _chunk_tile(w, w89, cs, zp, BITS: gl.constexpr, CH: gl.constexpr):
    """The fp16 tile rows [C channels, 64 tokens] of one chunk's code words ``w`` [C, 8]
    ([C, 4] at 2 bits; at 5 bits also ``w89`` [C, 2]) and its (scaled) fp16 channel scales and
    zero points [C]; ``CH`` is the channels' layout (one channel's words per thread)."""
    if BITS == 5:
        return _chunk_tile5(w, w89, cs, zp, CH)
    elif BITS == 2:
        return _chunk_tile2(w, cs, zp, CH)
    else:
        return _chunk_tile4(w, cs, zp)


@gluon.jit
def _chunk_tile4(w, cs, zp):
    csb = gl.broadcast(gl.expand_dims(cs, 1), w)[0]
    zpb = gl.broadcast(gl.expand_dims(zp, 1), w)[0]
    cs2 = _joined(csb, csb)
    zp2 = _joined(zpb, zpb)
    x = _stack4(
        _pair16(w, cs2, zp2, 4, 0),
        _pair16(w, cs2, zp2, 4, 1),
        _pair16(w, cs2, zp2, 4, 2),
        _pair16(w, cs2, zp2, 4, 3),
    )  # [C, 8 j, 2 r, 4 k]: token 8 j + 4 r + k
    # tile position 8 j + 2 k + r: each register's fp16 pair (r) stays adjacent
    return gl.reshape(gl.permute(x, TILE_PERM4.value), [w.shape[0], 64])


@gluon.constexpr_function
def pair5_word(i):
    """Word (of the five of a half-row) where 5-bit code ``i``'s pair window starts."""
    return (5 * i) // 32


@gluon.constexpr_function
def pair5_straddles(i):
    """Whether the window of codes ``i`` and ``i + 4`` (bits ``5 i .. 5 i + 24``) runs into
    the next word."""
    return (5 * i) % 32 + 25 > 32


@gluon.constexpr_function
def dq5_asm(i):
    """PTX of :func:`_pair5` for codes ``i`` and ``i + 4`` of a half-row: ``$1`` the word
    the window starts in, ``$2`` the next one, ``$3`` / ``$4`` the fp16 pairs of the channel's
    scale and zero point; ``$0`` the fp16 pair ``fma(code, cs, zp)`` of both codes."""
    sh = (5 * i) % 32
    if pair5_straddles(i):
        win = f"shf.r.clamp.b32 t, $1, $2, {sh}; "
    elif sh > 0:
        win = f"shr.u32 t, $1, {sh}; "
    else:
        win = "mov.b32 t, $1; "
    return (
        "{ .reg .b32 t, o, s; " + win + "lop3.b32 t, t, 0x01F0001F, 0x64006400, 0xea; "
        "mov.b32 o, 0x2C003C00; mov.b32 s, 0xD400E400; fma.rn.f16x2 t, t, o, s; "
        "fma.rn.f16x2 $0, t, $3, $4; }"
    )


@gluon.jit
def _pair5(ws, cs2, zp2, I: gl.constexpr):
    """Codes ``I`` and ``I + 4`` of the half-row in words ``ws`` (a tuple of five [128]) as
    the fp16 pair ``fma(code, cs, zp)`` [128, 2]: code ``I`` at window bits 0-4, code
    ``I + 4`` at 20-24, masked into the mantissas of 1024.0 (``1024 + code``,
    ``1024 + 16 code``), an exact ``fma.rn.f16x2`` by ``(1, 1/16)`` less ``(1024, 64)``, then
    the scaling one (:func:`dq5_asm`)."""
    K: gl.constexpr = pair5_word(I)
    lo = ws[K]
    if pair5_straddles(I):
        hi = ws[K + 1]
    else:
        hi = lo
    return gl.inline_asm_elementwise(
        dq5_asm(I), "=r,r,r,r,r", [_joined(lo, hi), cs2, zp2], dtype=gl.float16,
        is_pure=True, pack=2,
    )  # fmt: skip


@gluon.jit
def _group5(ws, cs2, zp2, G: gl.constexpr):
    """Codes ``8 G .. 8 G + 7`` of a half-row: ``[128, 2 r, 4 i]``, code ``8 G + i + 4 r``."""
    return _stack4(
        _pair5(ws, cs2, zp2, 8 * G),
        _pair5(ws, cs2, zp2, 8 * G + 1),
        _pair5(ws, cs2, zp2, 8 * G + 2),
        _pair5(ws, cs2, zp2, 8 * G + 3),
    )


@gluon.jit
def _half5(ws, cs2, zp2):
    """The 32 codes of a half-row: ``[128, 2 r, 4 i, 4 G]``, code ``8 G + 4 r + i``."""
    return _stack4(
        _group5(ws, cs2, zp2, 0),
        _group5(ws, cs2, zp2, 1),
        _group5(ws, cs2, zp2, 2),
        _group5(ws, cs2, zp2, 3),
    )


@gluon.jit
def _halves(x):
    """Elements of even and of odd index along the last axis."""
    return gl.split(gl.reshape(x, x.shape[:-1] + [x.shape[-1] // 2, 2]))


@gluon.jit
def _ch(x, CH: gl.constexpr):
    return gl.convert_layout(x, CH, assert_trivial=True)


@gluon.jit
def _chunk_tile5(w, w89, cs, zp, CH: gl.constexpr):
    """:func:`_chunk_tile` for 5-bit codes: words ``w`` [128, 8] (0-7 of each channel) and
    ``w89`` [128, 2] (8-9)."""
    ev, od = _halves(w)
    e0, e1 = _halves(ev)
    o0, o1 = _halves(od)
    a0, a4 = gl.split(e0)
    a2, a6 = gl.split(e1)
    a1, a5 = gl.split(o0)
    a3, a7 = gl.split(o1)
    a8, a9 = gl.split(w89)
    cs2 = _joined(cs, cs)
    zp2 = _joined(zp, zp)
    x = gl.join(
        _half5((_ch(a0, CH), _ch(a1, CH), _ch(a2, CH), _ch(a3, CH), _ch(a4, CH)), cs2, zp2),
        _half5((_ch(a5, CH), _ch(a6, CH), _ch(a7, CH), _ch(a8, CH), _ch(a9, CH)), cs2, zp2),
    )  # [C, 2 r, 4 i, 4 G, 2 h]: token 32 h + 8 G + 4 r + i
    # tile position 32 h + 8 G + 2 i + r: each register's fp16 pair (r) stays adjacent
    return gl.reshape(gl.permute(x, TILE_PERM5.value), [w.shape[0], 64])


@gluon.jit
def _word2(w, cs2, zp2):
    """The 16 codes of one 2-bit word: ``[128, 2 r, 4 a, 2 b]``, code ``8 r + 4 b + a``."""
    return gl.join(
        _stack4(_pair16(w, cs2, zp2, 2, 0), _pair16(w, cs2, zp2, 2, 1), _pair16(w, cs2, zp2, 2, 2),
                _pair16(w, cs2, zp2, 2, 3)),
        _stack4(_pair16(w, cs2, zp2, 2, 4), _pair16(w, cs2, zp2, 2, 5), _pair16(w, cs2, zp2, 2, 6),
                _pair16(w, cs2, zp2, 2, 7)),
    )  # fmt: skip


@gluon.jit
def _chunk_tile2(w, cs, zp, CH: gl.constexpr):
    """:func:`_chunk_tile` for 2-bit codes: words ``w`` [128, 4] (word ``j``: tokens ``16 j ..
    16 j + 15``)."""
    ev, od = _halves(w)
    a0, a2 = gl.split(ev)
    a1, a3 = gl.split(od)
    cs2 = _joined(cs, cs)
    zp2 = _joined(zp, zp)
    # each word's codes with the two fp16 halves of the register in the last axis
    x = _stack4(
        _word2(_ch(a0, CH), cs2, zp2),
        _word2(_ch(a1, CH), cs2, zp2),
        _word2(_ch(a2, CH), cs2, zp2),
        _word2(_ch(a3, CH), cs2, zp2),
    )  # [C, 2 r, 4 a, 2 b, 4 j]: token 16 j + 8 r + 4 b + a
    # tile position 16 j + 8 b + 2 a + r: each register's fp16 pair (r) stays adjacent
    return gl.reshape(gl.permute(x, TILE_PERM2.value), [w.shape[0], 64])


@gluon.jit
def _load_words(rec32_ptr, blk, CQ: gl.constexpr, REC: gl.constexpr, BITS: gl.constexpr,
                C: gl.constexpr, LW: gl.constexpr, LW2: gl.constexpr,
                LW4: gl.constexpr):  # fmt: skip
    """Chunk ``CQ``'s code words (chunks of ``C`` channels, one channel's words per thread):
    ``[C, 8]`` in ``LW`` (``[C, 4]`` in ``LW4`` at 2 bits; a channel's 2 * BITS words start at
    word ``2 * BITS * c``), and at 5 bits words 8-9 ``[C, 2]`` in ``LW2`` (else a constant)."""
    row = rec32_ptr + blk * (REC // 4) + (C * CQ) * (2 * BITS)
    if BITS == 2:
        c4 = gl.arange(0, C, layout=gl.SliceLayout(1, LW4))
        j4 = gl.arange(0, 4, layout=gl.SliceLayout(0, LW4))
        w = gl.load(row + c4[:, None] * 4 + j4[None, :])
    else:
        c = gl.arange(0, C, layout=gl.SliceLayout(1, LW))
        j = gl.arange(0, 8, layout=gl.SliceLayout(0, LW))
        w = gl.load(row + c[:, None] * (2 * BITS) + j[None, :])
    c2 = gl.arange(0, C, layout=gl.SliceLayout(1, LW2))
    if BITS == 5:
        j2 = gl.arange(0, 2, layout=gl.SliceLayout(0, LW2))
        w89 = gl.load(row + c2[:, None] * 10 + 8 + j2[None, :])
    else:
        w89 = gl.full([C, 2], 0, gl.int32, LW2)
    return w, w89


@gluon.jit
def _load_chan(rec16_ptr, blk, OFF: gl.constexpr, CQ: gl.constexpr, REC: gl.constexpr,
               C: gl.constexpr, CH: gl.constexpr):  # fmt: skip
    c = gl.arange(0, C, layout=CH)
    return gl.load(rec16_ptr + blk * (REC // 2) + OFF // 2 + C * CQ + c).to(gl.float32)


@gluon.jit
def _tile_token(q, BITS: gl.constexpr):
    """:func:`tile_token` of positions ``q`` (an int32 tensor)."""
    if BITS == 5 or BITS == 4:
        return (q & ~7) | ((q & 1) << 2) | ((q >> 1) & 3)
    elif BITS == 2:
        return (q & ~15) | ((q & 1) << 3) | (((q >> 3) & 1) << 2) | ((q >> 1) & 3)
    else:
        return q


@gluon.jit
def _load_rope(base_ptr, valid, LR: gl.constexpr, BITS: gl.constexpr):
    """[64 tokens, 64 dims] bf16 rows at ``base_ptr`` (row stride 64; rows past ``valid``
    read as 0), in layout ``LR``, in the tile's token order (:func:`tile_token`)."""
    t = _tile_token(gl.arange(0, 64, layout=gl.SliceLayout(1, LR)), BITS)
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    return gl.load(base_ptr + t[:, None] * 64 + d[None, :], mask=(t < valid)[:, None], other=0.0)


@gluon.jit
def _load_record(rec16_ptr, rec32_ptr, recbf_ptr, map_ptr, blk, t64, REC: gl.constexpr,
                 CS_OFF: gl.constexpr, ZP_OFF: gl.constexpr, RS_OFF: gl.constexpr,
                 ROPE_OFF: gl.constexpr, BITS: gl.constexpr):  # fmt: skip
    """Block ``blk``'s record in registers: code words (two tensors a chunk) and channel scales
    and zero points of the four chunks, RoPE rows, row scales, and its pool-map entry."""
    r16 = rec16_ptr + blk * (REC // 2)
    w0, v0 = _load_words(rec32_ptr, blk, 0, REC, BITS, 128, gl.constexpr(_LW),
                         gl.constexpr(_LW2), gl.constexpr(_LW4))  # fmt: skip
    w1, v1 = _load_words(rec32_ptr, blk, 1, REC, BITS, 128, gl.constexpr(_LW),
                         gl.constexpr(_LW2), gl.constexpr(_LW4))  # fmt: skip
    w2, v2 = _load_words(rec32_ptr, blk, 2, REC, BITS, 128, gl.constexpr(_LW),
                         gl.constexpr(_LW2), gl.constexpr(_LW4))  # fmt: skip
    w3, v3 = _load_words(rec32_ptr, blk, 3, REC, BITS, 128, gl.constexpr(_LW),
                         gl.constexpr(_LW2), gl.constexpr(_LW4))  # fmt: skip
    return (
        w0,
        w1,
        w2,
        w3,
        v0,
        v1,
        v2,
        v3,
        _load_chan(rec16_ptr, blk, CS_OFF, 0, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, CS_OFF, 1, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, CS_OFF, 2, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, CS_OFF, 3, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, ZP_OFF, 0, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, ZP_OFF, 1, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, ZP_OFF, 2, REC, 128, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, ZP_OFF, 3, REC, 128, gl.constexpr(_CH)),
        _load_rope(recbf_ptr + blk * (REC // 2) + ROPE_OFF // 2, 64, gl.constexpr(_LR), BITS),
        gl.load(r16 + RS_OFF // 2 + t64).to(gl.float32),
        gl.load(r16 + RS_OFF // 2 + gl.arange(0, 64, layout=gl.SliceLayout(0, _RW))[None, :]).to(
            gl.float32
        ),
        gl.load(map_ptr + blk),
    )


@gluon.jit
def _chan_mag(cs, zp, BITS: gl.constexpr):
    return gl.abs(cs) * ((1 << BITS) - 1) + gl.abs(zp)


@gluon.jit
def _pow2_scale(amax):
    """``2^(14 - floor(log2 amax))`` (1 where ``amax`` is 0): the tile's factor."""
    e = gl.floor(gl.log2(gl.where(amax > 0.0, amax, 1.0)))
    return gl.where(amax > 0.0, gl.exp2(14.0 - e), 1.0)


@gluon.jit
def _block_softmax(sc, m, l, red_m, red_l, REP: gl.constexpr):
    """One online-softmax step over the 64 tokens of ``sc`` [64, N] (base-2 logits, the M
    axis of a ``wgmma`` accumulator: 16 tokens per warp, four warps along M): ``(p, m_new,
    l_new, alpha)`` with ``p = exp2(sc - m_new)``. Each warp reduces its 16 tokens (maximum,
    then the sum of ``exp2(sc - its maximum)``) and writes both to shared memory (``red_m``,
    ``red_l``: [4, N]); after one barrier every thread reads the four warps' values of its
    columns (``REP``: that [4, N] layout). A maximum and a sum over the M axis took a
    shared-memory round trip and two barriers each. ``p`` is the warp's terms rescaled by
    ``exp2(m_warp - m_new)``."""
    N: gl.constexpr = sc.shape[1]
    x3 = gl.reshape(sc, [4, 16, N])  # [warp, token of the warp, column]
    mx = gl.max(x3, axis=1)
    # including the running maximum keeps a warp of masked tokens (-inf) finite
    mw = gl.maximum(mx, gl.expand_dims(gl.convert_layout(m, gl.SliceLayout(0, mx.type.layout)), 0))
    p3 = gl.exp2(x3 - gl.expand_dims(mw, 1))
    red_m.store(mw)
    red_l.store(gl.sum(p3, axis=1))
    gl.thread_barrier()
    ma = red_m.load(REP)
    mr = gl.max(ma, axis=0)
    lr = gl.sum(red_l.load(REP) * gl.exp2(ma - gl.expand_dims(mr, 0)), axis=0)
    m_new = gl.convert_layout(mr, m.type.layout, assert_trivial=True)
    alpha = gl.exp2(m - m_new)
    l_new = l * alpha + gl.convert_layout(lr, m.type.layout, assert_trivial=True)
    fw = gl.exp2(
        mw - gl.expand_dims(gl.convert_layout(m_new, gl.SliceLayout(0, mx.type.layout)), 0)
    )
    p = gl.reshape(p3 * gl.expand_dims(fw, 1), [64, N])
    return gl.convert_layout(p, sc.type.layout, assert_trivial=True), m_new, l_new, alpha


@gluon.jit
def _warp_max(x, NW: gl.constexpr):
    """Per-warp maxima [NW] of ``x`` [C] (channels spread over ``NW`` warps, 32 a warp)."""
    return gl.max(gl.reshape(x, [NW, x.shape[0] // NW]), axis=1)


@gluon.jit
def _pool_chunk(pool_ptr, row0, valid, CQ: gl.constexpr, LR: gl.constexpr, BITS: gl.constexpr):
    """Pool latents [128 channels, 64 tokens] fp32 of chunk ``CQ`` (tokens past ``valid``: 0),
    read along the rows' channels in layout ``LR`` ([64, 128]), in the tile's token order."""
    t = _tile_token(gl.arange(0, 64, layout=gl.SliceLayout(1, LR)), BITS)
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, LR))
    ptr = pool_ptr + (row0 + t)[:, None] * 512 + (128 * CQ + c)[None, :]
    x = gl.load(ptr, mask=(t < valid)[:, None], other=0.0).to(gl.float32)
    return gl.permute(x, (1, 0))


@gluon.jit
def _pool_amax(pool_ptr, row0, valid, CQ: gl.constexpr, LR: gl.constexpr, amax):
    x = gl.abs(_pool_chunk(pool_ptr, row0, valid, CQ, LR, 4))
    return gl.maximum(amax, gl.max(gl.max(x, axis=1), axis=0))


@gluon.jit
def _pool_inv(pool_ptr, row0, valid, LR: gl.constexpr):
    """The power-of-two factor of a block in the exact pool (its rows ``row0 ..``, ``valid``
    tokens; :func:`_pow2_scale` of their largest magnitude)."""
    amax = _pool_amax(pool_ptr, row0, valid, 0, LR, 0.0)
    amax = _pool_amax(pool_ptr, row0, valid, 1, LR, amax)
    amax = _pool_amax(pool_ptr, row0, valid, 2, LR, amax)
    amax = _pool_amax(pool_ptr, row0, valid, 3, LR, amax)
    return _pow2_scale(amax)


@gluon.jit
def _pool_store(dst, pool_ptr, row0, valid, CQ: gl.constexpr, inv, LR: gl.constexpr,
                BITS: gl.constexpr):  # fmt: skip
    """Tile rows of channel chunk ``CQ`` of a block in the exact pool, into ``dst`` [128, 64]."""
    dst.store((_pool_chunk(pool_ptr, row0, valid, CQ, LR, BITS) * inv).to(gl.float16))


@gluon.jit
def _scaled_tile(w, w89, cs, zp, inv, BITS: gl.constexpr, CH: gl.constexpr):
    """:func:`_chunk_tile` of the channel scales and zero points times the block's factor."""
    return _chunk_tile(w, w89, (cs * inv).to(gl.float16), (zp * inv).to(gl.float16), BITS, CH)


@gluon.jit
def _split_blocks(seq_ptr, b, max_blocks, MIN_BLOCKS: gl.constexpr):
    """``(seq_len, lo, hi)``: request ``b``'s length and the 64-token blocks ``[lo, hi)`` of
    this program's split (``program_id(1)`` of ``num_programs(1)``; at least ``MIN_BLOCKS``
    blocks a split)."""
    split = gl.program_id(1)
    num_splits = gl.num_programs(1)
    seq_len = gl.load(seq_ptr + b)
    n_blk = gl.minimum((seq_len + 63) // 64, max_blocks)
    per = gl.maximum((n_blk + num_splits - 1) // num_splits, MIN_BLOCKS)
    lo = split * per
    return seq_len, lo, gl.minimum(lo + per, n_blk)


@gluon.jit
def mla_wgmma_kernel(
    q_ptr,
    qrot_ptr,
    rec16_ptr,
    rec32_ptr,
    recbf_ptr,
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
    REC: gl.constexpr,
    CS_OFF: gl.constexpr,
    ZP_OFF: gl.constexpr,
    RS_OFF: gl.constexpr,
    ROPE_OFF: gl.constexpr,
    FP8: gl.constexpr,
    MIN_BLOCKS: gl.constexpr,
    BITS: gl.constexpr,
):
    """Grid ``(B, splits, ceil(H / 16))``, four warps (one warpgroup): split
    ``program_id(1)`` of request ``program_id(0)``'s blocks for 16 heads; writes normalized
    partial rows and natural-log log-sum-exps to the workspace of ``mla_decode``.
    ``qk_scale`` is the softmax scale times log2(e)."""
    b = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    h0 = gl.program_id(2) * 16
    seq_len, lo, hi = _split_blocks(seq_ptr, b, max_blocks, MIN_BLOCKS)
    hh = h0 + gl.arange(0, 16, layout=_HEAD)
    hok = hh < H
    qrow = b * H + gl.where(hok, hh, 0)
    if lo >= hi:
        # nothing to read: the combine skips this split's (unwritten) partial row
        gl.store(plse_ptr + qrow * S + split, gl.full([16], float("-inf"), gl.float32, _HEAD),
                 mask=hok)  # fmt: skip
        return
    bt_row = bt_ptr + b * bt_stride

    # the tile as four 128-channel buffers: stores to one buffer's slices are ordered by a
    # barrier each (three more a block), stores to different buffers are not; each buffer
    # [1, ...]: see the loop's index ``z``
    tiles0 = gl.allocate_shared_memory(gl.float16, [1, 128, 64], _SW)
    tiles1 = gl.allocate_shared_memory(gl.float16, [1, 128, 64], _SW)
    tiles2 = gl.allocate_shared_memory(gl.float16, [1, 128, 64], _SW)
    tiles3 = gl.allocate_shared_memory(gl.float16, [1, 128, 64], _SW)
    rope_ss = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], _SW)
    pss = gl.allocate_shared_memory(gl.float16, [1, 16, 64], _SW)
    qss = gl.allocate_shared_memory(gl.float16, [1, 16, 512], _SW)
    qr_his = gl.allocate_shared_memory(gl.bfloat16, [1, 16, 64], _SW)
    qr_los = gl.allocate_shared_memory(gl.bfloat16, [1, 16, 64], _SW)
    amax_s = gl.allocate_shared_memory(gl.float32, [4], _S1)
    red_m = gl.allocate_shared_memory(gl.float32, [4, 16], _S2)
    red_l = gl.allocate_shared_memory(gl.float32, [4, 16], _S2)
    # queries -> shared memory: the latent part as fp16 (times the softmax scale), the RoPE
    # part as two bf16 terms
    qs = qss.index(0)
    qr_hi = qr_his.index(0)
    qr_lo = qr_los.index(0)
    qh = h0 + gl.arange(0, 16, layout=gl.SliceLayout(1, _LQ))
    qd = gl.arange(0, 512, layout=gl.SliceLayout(0, _LQ))
    qok = (qh < H)[:, None]
    qr = (b * H + qh).to(gl.int64)
    x = gl.load(qrot_ptr + qr[:, None] * 512 + qd[None, :], mask=qok, other=0.0) * qk_scale
    xh = x.to(gl.float16)
    qs.store(xh)
    qd64 = gl.arange(0, 64, layout=gl.SliceLayout(0, _LQ))
    x = gl.load(q_ptr + qr[:, None] * 576 + 512 + qd64[None, :], mask=qok, other=0.0)
    x = x.to(gl.float32) * qk_scale
    xh = x.to(gl.bfloat16)
    qr_hi.store(xh)
    qr_lo.store((x - xh.to(gl.float32)).to(gl.bfloat16))

    # the token at each tile position (row of S^T)
    t64 = _tile_token(gl.arange(0, 64, layout=_TOK), BITS)
    m = gl.full([16], -1.0e30, gl.float32, _HEAD)
    l = gl.full([16], 0.0, gl.float32, _HEAD)
    f_run = qk_scale * 0.0 + 1.0
    # the value accumulator O^T [512, 16] as four [128, 16] channel chunks
    o0 = warpgroup_mma_init(gl.full([128, 16], 0.0, gl.float32, _ACC))
    o1 = warpgroup_mma_init(gl.full([128, 16], 0.0, gl.float32, _ACC))
    o2 = warpgroup_mma_init(gl.full([128, 16], 0.0, gl.float32, _ACC))
    o3 = warpgroup_mma_init(gl.full([128, 16], 0.0, gl.float32, _ACC))
    zs = gl.full([64, 16], 0.0, gl.float32, _ACC)

    # block lo's record in registers
    tw = gl.arange(0, 64, layout=gl.SliceLayout(0, _RW))[None, :]
    w0, w1, w2, w3, v0, v1, v2, v3, c0, c1, c2, c3, z0, z1, z2, z3, rope, rs, rsw, pb = (
        _load_record(
            rec16_ptr, rec32_ptr, recbf_ptr, map_ptr, gl.load(bt_row + lo).to(gl.int64), t64,
            REC, CS_OFF, ZP_OFF, RS_OFF, ROPE_OFF, BITS,
        )
    )  # fmt: skip
    for u in range(lo, hi):
        valid = gl.minimum(seq_len - u * 64, 64)
        # Shared-memory views through an index that is 0 (a request never has 2^30 blocks)
        # but depends on the loop: otherwise the compiler hoists all 72 64-bit wgmma
        # descriptors out of the loop, where they do not fit the registers (216 B spilled,
        # reloaded and moved to uniform registers every block: a fifth of the stall samples
        # on the H200); built in the loop they are uniform adds.
        z = u >> 30
        t0 = tiles0.index(z)
        t1 = tiles1.index(z)
        t2 = tiles2.index(z)
        t3 = tiles3.index(z)
        rope_s = rope_ss.index(z)
        ps = pss.index(z)
        qs = qss.index(z)
        qr_hi = qr_his.index(z)
        qr_lo = qr_los.index(z)
        # each warp's largest channel magnitude of the record, exchanged through the barrier
        # that also waits for the previous block's value product to have read the tile
        am01 = gl.maximum(
            _warp_max(_chan_mag(c0, z0, BITS), 4), _warp_max(_chan_mag(c1, z1, BITS), 4)
        )
        am23 = gl.maximum(
            _warp_max(_chan_mag(c2, z2, BITS), 4), _warp_max(_chan_mag(c3, z3, BITS), 4)
        )
        amax_s.store(gl.maximum(am01, am23))
        o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
        gl.thread_barrier()
        if pb < 0:
            inv = _pow2_scale(gl.max(amax_s.load(_REP4), axis=0))
            t0.store(_scaled_tile(w0, v0, c0, z0, inv, BITS, gl.constexpr(_CH)))
            t1.store(_scaled_tile(w1, v1, c1, z1, inv, BITS, gl.constexpr(_CH)))
            t2.store(_scaled_tile(w2, v2, c2, z2, inv, BITS, gl.constexpr(_CH)))
            t3.store(_scaled_tile(w3, v3, c3, z3, inv, BITS, gl.constexpr(_CH)))
            rope_s.store(rope)
            rw = rs
            rwm = rsw
        else:
            # a block in the exact pool: the tile from its rows
            row0 = pb.to(gl.int64) * 64
            inv = _pool_inv(pool_ptr, row0, valid, gl.constexpr(_LR))
            _pool_store(t0, pool_ptr, row0, valid, 0, inv, gl.constexpr(_LR), BITS)
            _pool_store(t1, pool_ptr, row0, valid, 1, inv, gl.constexpr(_LR), BITS)
            _pool_store(t2, pool_ptr, row0, valid, 2, inv, gl.constexpr(_LR), BITS)
            _pool_store(t3, pool_ptr, row0, valid, 3, inv, gl.constexpr(_LR), BITS)
            rope_s.store(_load_rope(prope_ptr + row0 * 64, valid, gl.constexpr(_LR), BITS))
            if FP8:
                rw = gl.load(pscale_ptr + row0 + t64, mask=t64 < valid, other=0.0)
                rwm = gl.load(pscale_ptr + row0 + tw, mask=tw < valid, other=0.0)
            else:
                rw = gl.full([64], 1.0, gl.float32, _TOK)
                rwm = gl.full([1, 64], 1.0, gl.float32, _RW)
        # the next block's record (this one's registers are free now), read during the products
        nb = gl.load(bt_row + gl.minimum(u + 1, hi - 1)).to(gl.int64)
        w0, w1, w2, w3, v0, v1, v2, v3, c0, c1, c2, c3, z0, z1, z2, z3, rope, rs, rsw, pb = (
            _load_record(
                rec16_ptr, rec32_ptr, recbf_ptr, map_ptr, nb, t64,
                REC, CS_OFF, ZP_OFF, RS_OFF, ROPE_OFF, BITS,
            )
        )  # fmt: skip

        fence_async_shared()
        gl.thread_barrier()

        # scores S^T [64 tokens, 16 heads], base-2 logits
        # (the latent part as two independent chains over the channel halves)
        sa = warpgroup_mma(t0.permute((1, 0)), qs.slice(0, 128, dim=1).permute((1, 0)), zs,
                           use_acc=False, is_async=True)  # fmt: skip
        sb = warpgroup_mma(t2.permute((1, 0)), qs.slice(256, 128, dim=1).permute((1, 0)), zs,
                           use_acc=False, is_async=True)  # fmt: skip
        sa = warpgroup_mma(t1.permute((1, 0)), qs.slice(128, 128, dim=1).permute((1, 0)), sa,
                           is_async=True)  # fmt: skip
        sb = warpgroup_mma(t3.permute((1, 0)), qs.slice(384, 128, dim=1).permute((1, 0)), sb,
                           is_async=True)  # fmt: skip
        sr = warpgroup_mma(rope_s, qr_hi.permute((1, 0)), zs, use_acc=False, is_async=True)
        sr = warpgroup_mma(rope_s, qr_lo.permute((1, 0)), sr, is_async=True)
        sa, sb, sr = warpgroup_mma_wait(num_outstanding=0, deps=(sa, sb, sr))
        s = sa + sb
        e2 = 1.0 / inv
        okt = t64 < valid
        rw = gl.where(okt, rw, 0.0)
        sc = s * gl.expand_dims(rw * e2, 1) + sr
        sc = gl.where(gl.expand_dims(okt, 1), sc, float("-inf"))
        p, m, l, alpha = _block_softmax(sc, m, l, red_m, red_l, gl.constexpr(_REP))
        # the largest row scale: within each warp
        rmax = gl.max(gl.max(gl.where(tw < valid, rwm, 0.0), axis=1), axis=0)
        rmax = gl.where(rmax > 0.0, rmax, 1.0)
        pw = (p * gl.expand_dims(rw / rmax, 1)).to(gl.float16)
        ps.store(gl.permute(pw, (1, 0)))
        f_new = rmax * e2
        rescale = gl.expand_dims(alpha * (f_run / f_new), 0)
        o0 = o0 * rescale
        o1 = o1 * rescale
        o2 = o2 * rescale
        o3 = o3 * rescale
        f_run = f_new
        fence_async_shared()
        gl.thread_barrier()
        o0 = warpgroup_mma(t0, ps.permute((1, 0)), o0, is_async=True)
        o1 = warpgroup_mma(t1, ps.permute((1, 0)), o1, is_async=True)
        o2 = warpgroup_mma(t2, ps.permute((1, 0)), o2, is_async=True)
        o3 = warpgroup_mma(t3, ps.permute((1, 0)), o3, is_async=True)

    o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))

    seen = l != 0.0  # l NaN (a NaN or infinite query) is kept: the output is NaN
    scale = gl.where(seen, f_run / gl.where(seen, l, 1.0), 0.0)
    lse = gl.where(seen, (m + gl.log2(gl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(plse_ptr + qrow * S + split, lse, mask=hok)
    ch = gl.arange(0, 128, layout=_TOK)
    ptr = po_ptr + gl.expand_dims((qrow * S + split) * 512, 0) + gl.expand_dims(ch, 1)
    sc2 = gl.expand_dims(scale, 0)
    ok2 = gl.expand_dims(hok, 0)
    gl.store(ptr, o0 * sc2, mask=ok2)
    gl.store(ptr + 128, o1 * sc2, mask=ok2)
    gl.store(ptr + 256, o2 * sc2, mask=ok2)
    gl.store(ptr + 384, o3 * sc2, mask=ok2)
