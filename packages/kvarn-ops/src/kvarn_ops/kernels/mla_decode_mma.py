"""MLA decode main kernel that unpacks 4-bit latent codes straight into tensor-core operand
registers (Gluon), for full-context decode (no ``indices``) of ``kvarn_mla_k4_g64``.

The Triton kernel (``mla_decode.py``) moves every unpacked ``[128, 64]`` code tile through
shared memory into the operand layout of ``tl.dot``, twice per block (scores, values), and
reaches 1.5-10% of copy bandwidth on the H200. This kernel applies the method of the dense
Gluon kernel (``decode_mma.py``) to the latent record: each thread reads exactly the code words
whose codes belong in its own ``mma.sync.m16n8k16`` operand registers, and every layout
conversion of codes is a renaming of registers (``assert_trivial``).

One program: one request, one split of its 64-token blocks, 16 heads (the MMA's M), four warps.
Warp ``w`` owns latent channels ``[128 w, 128 w + 128)`` (the records' codes are channel-major:
channel ``d``'s 64 codes are 8 consecutive 32-bit words, word ``j`` holding tokens ``8 j ..
8 j + 7``, LSB first):

- scores: the dense kernel's K path on the warp's 128 channels (a batched, 3-D ``mma_v2`` with
  the warp index as batch), ``S_w = (q_rot * cs / cmax_w) @ code`` (exact codes; the
  operand ``q_rot * cs / cmax_w`` as two fp16 parts ``hi + lo``, two MMAs per code operand),
  plus the zero-point row term ``q_rot @ zp`` and 16 of the 64 RoPE dims (bf16 MMAs, the
  query's RoPE part split into two bf16 terms, so fp16 and bf16 queries stay exact to 16
  bits); the four warps' partial scores are summed
  through shared memory (``gl.sum`` over the warp axis), then every warp runs the same online
  softmax on the 16 x 64 block;
- values: ``out[:, d] += rmax * (cs[d] * (pw @ code^T)[d] + zp[d] * sum(pw))`` with ``pw =
  fp16(p * rs / rmax)`` (exact fp16 codes ``0..15``), on the warp's 128 channels. The B operand
  of this dot holds token pairs of one channel, so each thread reads two words of each of its
  16 channels (the score dot reads one word of each of 32 channels): both come from one staged
  copy of the block's words, whose shared-memory layout is swizzled so that both reads are free
  of bank conflicts.

Token order: score column ``n = 8 j + g`` is physical token ``8 g + j`` (all codes of a word in
one thread), the value dot uses the same order; channel orders are renamed per dot and the
output is written to the workspace in physical channel order.

Records: the whole record (codes, channel scales, zero points, row scales, RoPE rows; RoPE
rows and row scales permuted into the score columns' token order on the way) is copied into
shared memory by ``cp.async`` ``NBUF - 1`` blocks ahead. Blocks mapped to the exact pool
(``block_pool_map``: the filling tail, sinks, rehydrated blocks) are skipped by that loop and
read afterwards by a loop of their own (attention does not depend on the order of blocks):
fp16 MMAs on the pool rows (fp8 pools exact, bf16 pools rounded to fp16), scaled per token for
fp8 pools. Their code is register hungry (gathered operands); in the packed loop it made ptxas
spill there too.

Numerics: the score operand is ``q_rot * qk_scale * cs / cmax_w`` as two fp16 parts (``cmax_w``
the largest channel scale of the warp's 128 channels, ``qk_scale`` the softmax scale in base 2),
the value operand ``fp16(p * rs / rmax)``; zero-point terms, softmax and the running
accumulators are fp32. Partial rows and natural-log log-sum-exps go to the same workspace as
the Triton kernel's, merged by its combine kernel.

Speed (H200, BENCHMARKS.md): about 2x the Triton kernel at batch >= 8; 255 registers per
thread, so two programs per SM, and latency bound (a program takes about 9 us per block).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kvarn_ops.kernels.decode_mma import _k_codes, _pair_bits, _stack8

__all__ = ["MLA_MMA_BITS", "mla_mma_kernel", "mla_mma_supported"]

MLA_MMA_BITS = 4
WARPS = 4
"""Warps per program: warp ``w`` owns latent channels ``[128 w, 128 w + 128)``."""

# four warps, one m16n8k16 tile column each: the warp index is the batch axis of every tensor
_M3: gl.constexpr = gl.NVMMADistributedLayout(
    version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]
)
_A3: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_M3, k_width=2)
_B3: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=_M3, k_width=2)
_COLS3: gl.constexpr = gl.SliceLayout(1, _M3)  # [W, N]: a column vector per warp
_ROWS3: gl.constexpr = gl.SliceLayout(2, _M3)  # [W, 16]
_S2: gl.constexpr = gl.SliceLayout(0, _M3)  # [16, N], the same in every warp
_R2: gl.constexpr = gl.SliceLayout(1, _S2)  # [16]
_C2: gl.constexpr = gl.SliceLayout(0, _S2)  # [N]

# staged code words [W, r, L]: channel 128 W + 32 (L & 3) + r, word L >> 2 (lane-major: the
# score read of one register by 32 lanes is one row). Rows are swizzled (bit 2 of the column
# flips on odd rows) so the value read, whose lanes span two rows, is conflict free too.
_SHK: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=2, order=[2, 1, 0])
_SHV: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
_VEC: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0]
)
_SH2D: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
_CPK3: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 32, 1], threads_per_warp=[1, 1, 32], warps_per_cta=[4, 1, 1],
    order=[2, 1, 0],
)  # fmt: skip
_RDK3: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8, 1], threads_per_warp=[1, 1, 32], warps_per_cta=[4, 1, 1],
    order=[2, 1, 0],
)  # fmt: skip
# the value read of chunk CQ's rows [W, 8 r', 32 L]: lane (g, c) = (lane >> 2, lane & 3) reads
# L = (g & 3) + 4 x + 8 c of row r' = (g >> 2) + 2 nt (registers x, nt)
_RDV3: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 4], [0, 2, 0], [0, 4, 0]],
    lane_bases=[[0, 0, 8], [0, 0, 16], [0, 0, 1], [0, 0, 2], [0, 1, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[],
    shape=[4, 8, 32],
)
# K word tile of a 32-channel chunk, [W, 8 c + i, w], and its nibbles (decode_mma's _K3 with
# the warp axis in front)
_K4: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8, 1, 8], threads_per_warp=[1, 4, 8, 1], warps_per_cta=[4, 1, 1, 1],
    order=[3, 1, 2, 0],
)  # fmt: skip
_KW3: gl.constexpr = gl.SliceLayout(3, _K4)
# channel vectors staged as [W, 4, 32] (channel 128 W + 32 c + j); the score dot reads runs
# [W, 4 c, 8 i] (channel 32 c + 8 CQ + i), the value dot [W, 4 gl, 8 jj] (channel
# 32 gl + 8 CQ + jj) in the lanes that own those accumulator columns
_CP32: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 1, 8], threads_per_warp=[1, 4, 8], warps_per_cta=[4, 1, 1],
    order=[2, 1, 0],
)  # fmt: skip
_RUN8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[],
    shape=[4, 4, 8],
)
_VRUN: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 0, 2], [0, 0, 4]],
    lane_bases=[[0, 2, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[],
    shape=[4, 4, 8],
)


# RoPE rows staged per warp as [W, 64 n, 16 k] (logical token n, dim 16 W + k; 16-byte copies
# along k); row scales as [8 a, 8 b] (token 8 a + b), read into the score columns' lanes
_CPR: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 1, 8], threads_per_warp=[1, 16, 2], warps_per_cta=[4, 1, 1],
    order=[2, 1, 0],
)  # fmt: skip
_CPS: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[8, 4], warps_per_cta=[1, 4], order=[1, 0]
)
_RS8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [0, 1], [0, 2], [0, 4]],
    lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
    warp_bases=[[0, 0], [0, 0]],
    block_bases=[],
    shape=[8, 8],
)


def mla_mma_supported(bits: int) -> bool:
    """Whether a latent code width takes this kernel (full-context decode, sm_80 and newer)."""
    return bits == MLA_MMA_BITS


@gluon.jit
def _pair_code(a, b, BYTE: gl.constexpr):
    """Low nibbles of byte ``BYTE`` of ``a`` (low half) and ``b`` (high half) as exact fp16
    values 0..15 in one register: masked into the mantissas of 1024.0, then 1024 subtracted
    (``decode_mma._pair_bits``)."""
    return _pair_bits(a, b, BYTE, 0x000F000F, 0x64006400, 0x64006400)


@gluon.jit
def _v_operand(vt):
    """Value B operand [W, 64 tokens (logical), 32 channels (logical chunk)] of exact codes
    from the words ``vt`` [W, 8 r', 32 L] read with ``_RDV3``: logical token ``16 kt + 8 z +
    2 c + x`` is physical token ``16 c + 8 x + 2 kt + z``, i.e. nibble ``2 kt + z`` of word
    ``2 c + x``; logical channel ``8 nt + 4 gh + gl`` is row ``r' = gh + 2 nt``, ``L & 3 = gl``."""
    # [W, r'2 r'1 r'0, L4 L3 L2 L1 L0] -> x = L2 last
    v = gl.reshape(vt, [4, 2, 2, 2, 2, 2, 2, 4])  # [W, nt1, nt0, gh, c1, c0, x, gl]
    va, vb = gl.split(gl.permute(v, [0, 1, 2, 3, 4, 5, 7, 6]))  # [W, nt1, nt0, gh, c1, c0, gl]
    va4 = va >> 4
    vb4 = vb >> 4
    c = _stack8(
        _pair_code(va, vb, 0),
        _pair_code(va4, vb4, 0),
        _pair_code(va, vb, 1),
        _pair_code(va4, vb4, 1),
        _pair_code(va, vb, 2),
        _pair_code(va4, vb4, 2),
        _pair_code(va, vb, 3),
        _pair_code(va4, vb4, 3),
    )  # [W, nt1, nt0, gh, c1, c0, gl, x, J = 2 kt + z]
    c = gl.reshape(c, [4, 2, 2, 2, 2, 2, 4, 2, 2, 2, 2])  # ..., x, kt1, kt0, z
    # -> [W, kt1, kt0, z, c1, c0, x, nt1, nt0, gh, gl]
    c = gl.permute(c, [0, 8, 9, 10, 4, 5, 7, 1, 2, 3, 6])
    return gl.convert_layout(gl.reshape(c, [4, 64, 32]), _B3, assert_trivial=True)


@gluon.jit
def _chan_from_run(v):
    """[W, 4 c, 8 i] run (channel 32 c + 8 CQ + i) -> the score chunk's logical order."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [4, 2, 2, 2, 2, 2]), [0, 3, 4, 1, 2, 5])
    return gl.convert_layout(gl.reshape(v, [4, 32]), _COLS3, assert_trivial=True)


@gluon.jit
def _vchan_from_run(v):
    """[W, 4 gl, 8 (2 nt + gh)] run -> the value chunk's logical order ``8 nt + 4 gh + gl``."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [4, 2, 2, 2, 2, 2]), [0, 3, 4, 5, 1, 2])
    return gl.convert_layout(gl.reshape(v, [4, 32]), _COLS3, assert_trivial=True)


@gluon.jit
def _score_chan(n, CQ: gl.constexpr):
    """Channel (within the warp's 128) of logical column ``n`` of score chunk ``CQ``."""
    return ((n >> 1) & 3) * 32 + 8 * CQ + (n >> 4) * 4 + ((n >> 3) & 1) * 2 + (n & 1)


@gluon.jit
def _value_chan(n, CQ: gl.constexpr):
    """Channel (within the warp's 128) of logical column ``n`` of value chunk ``CQ``."""
    return (n & 3) * 32 + 8 * CQ + (n >> 3) * 2 + ((n >> 2) & 1)


@gluon.jit
def _tok(n):
    """Physical token of logical token ``n`` (score column ``8 j + g`` -> ``8 g + j``)."""
    return (n & 7) * 8 + (n >> 3)


@gluon.jit
def _issue_stage(sk, scs, szp, srs, srope, uu, hi, bt_row, rec32_ptr, rec16_ptr, recbf_ptr,
                 REC: gl.constexpr, CS_OFF: gl.constexpr, ZP_OFF: gl.constexpr,
                 RS_OFF: gl.constexpr, ROPE_OFF: gl.constexpr):  # fmt: skip
    """cp.async of block ``uu``'s code words, channel vectors, row scales and RoPE rows
    (nothing read past ``hi``)."""
    blk = gl.load(bt_row + gl.minimum(uu, hi - 1)).to(gl.int64)
    ok = uu < hi
    r32 = rec32_ptr + blk * (REC // 4)
    r16 = rec16_ptr + blk * (REC // 2)
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CPK3)))
    r = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CPK3)))
    ln = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CPK3)))
    chan = w[:, None, None] * 128 + (ln[None, None, :] & 3) * 32 + r[None, :, None]
    koff = chan * 8 + (ln[None, None, :] >> 2)
    async_copy.async_copy_global_to_shared(sk, r32 + koff, mask=(koff >= 0) & ok)
    cw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CP32)))
    cc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CP32)))
    cj = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CP32)))
    coff = cw[:, None, None] * 128 + cc[None, :, None] * 32 + cj[None, None, :]
    cm = (coff >= 0) & ok
    async_copy.async_copy_global_to_shared(scs, r16 + CS_OFF // 2 + coff, mask=cm)
    async_copy.async_copy_global_to_shared(szp, r16 + ZP_OFF // 2 + coff, mask=cm)
    sa = gl.arange(0, 8, layout=gl.SliceLayout(1, _CPS))
    sb = gl.arange(0, 8, layout=gl.SliceLayout(0, _CPS))
    soff = sa[:, None] * 8 + sb[None, :]
    async_copy.async_copy_global_to_shared(srs, r16 + RS_OFF // 2 + soff, mask=(soff >= 0) & ok)
    rw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CPR)))
    rn = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CPR)))
    rk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CPR)))
    roff = _tok(rn)[None, :, None] * 64 + rw[:, None, None] * 16 + rk[None, None, :]
    rbf = recbf_ptr + blk * (REC // 2) + ROPE_OFF // 2
    async_copy.async_copy_global_to_shared(srope, rbf + roff, mask=(roff >= 0) & ok)
    async_copy.commit_group()


@gluon.jit
def _load_q(qrot_ptr, qrow, hok, qk_scale, CQ: gl.constexpr):
    """Rotated-query chunk [W, 16, 32] fp32 in the score chunk's logical channel order, times
    the softmax scale (base 2)."""
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, _COLS3))
    n = gl.arange(0, 32, layout=gl.SliceLayout(0, _COLS3))
    ch = w[:, None] * 128 + _score_chan(n, CQ)[None, :]  # [W, 32]
    q = gl.load(
        qrot_ptr + qrow[None, :, None] * 512 + ch[:, None, :], mask=hok[None, :, None], other=0.0
    )
    return q * qk_scale


@gluon.jit
def _q_rope(q_ptr, b, h0, H, qk_scale):
    """The query's RoPE dims ``16 w .. 16 w + 15`` of each warp, times the softmax scale, as
    two bf16 A operands [W, 16, 16] (``hi + lo`` equals the fp32 value to 16 bits)."""
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A3)))
    hh = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A3)))
    k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A3)))
    h = h0 + hh
    row = (b * H + h).to(gl.int64)
    ptr = q_ptr + row[None, :, None] * 576 + 512 + w[:, None, None] * 16 + k[None, None, :]
    x = gl.load(ptr, mask=(h < H)[None, :, None], other=0.0).to(gl.float32) * qk_scale
    hi = x.to(gl.bfloat16)
    lo = (x - hi.to(gl.float32)).to(gl.bfloat16)
    return hi, lo


@gluon.jit
def _rope_operand(rope_ptr, row0, valid):
    """RoPE B operand [W, 16 dims (16 w + k), 64 tokens (logical)] of rows ``row0 + token``
    of a bf16 [*, 64] array (tokens past ``valid`` read as 0)."""
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _B3)))
    k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _B3)))
    n = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, _B3)))
    t = _tok(n)
    ptr = rope_ptr + (row0 + t)[None, None, :] * 64 + w[:, None, None] * 16 + k[None, :, None]
    return gl.load(ptr, mask=(t < valid)[None, None, :], other=0.0)


@gluon.jit
def _staged_rs(srs):
    """Row scales of the staged block in score-column order, fp32 [64] (``_C2``)."""
    v = gl.permute(srs.load(_RS8).to(gl.float32), [1, 0])
    return gl.convert_layout(gl.reshape(v, [64]), _C2, assert_trivial=True)


@gluon.jit
def _row_vec(x):
    """[16] (softmax row vector) -> [1, 16, 1] for the warps' [W, 16, N] tiles."""
    return gl.expand_dims(gl.expand_dims(x, 1), 0)


@gluon.jit
def _warp_vec(x):
    """[W] -> [W, 1, 1]."""
    return gl.expand_dims(gl.expand_dims(x, 1), 1)


@gluon.jit
def _chan_absmax(scs, CQ: gl.constexpr):
    return gl.max(gl.abs(_chan_from_run(scs.slice(8 * CQ, 8, dim=2).load(_RUN8))), axis=1)


@gluon.jit
def _packed_scores(sk, scs, szp, q0, q1, q2, q3, rs):
    """Partial scores [W, 16, 64] of the warps' channels of a packed block (row scales
    applied). The channel scales are read twice (the largest, then per chunk), which keeps
    four chunks' scale vectors out of the registers."""
    cmax = gl.maximum(
        gl.maximum(_chan_absmax(scs, 0), _chan_absmax(scs, 1)),
        gl.maximum(_chan_absmax(scs, 2), _chan_absmax(scs, 3)),
    )
    cmax = gl.where(cmax > 0.0, cmax, 1.0)
    inv = gl.expand_dims(1.0 / cmax, 1)  # [W, 1]
    s = gl.full([4, 16, 64], 0.0, gl.float32, _M3)
    qz = gl.full([4, 16], 0.0, gl.float32, _ROWS3)
    s, qz = _scores_chunk(s, qz, q0, inv, scs, szp, sk, 0)
    s, qz = _scores_chunk(s, qz, q1, inv, scs, szp, sk, 1)
    s, qz = _scores_chunk(s, qz, q2, inv, scs, szp, sk, 2)
    s, qz = _scores_chunk(s, qz, q3, inv, scs, szp, sk, 3)
    # (cmax * s + qz) * rs
    cm3 = _warp_vec(cmax)
    rs3 = gl.expand_dims(gl.expand_dims(rs, 0), 0)
    return s * (cm3 * rs3) + gl.expand_dims(qz, 2) * rs3


@gluon.jit
def _scores_chunk(s, qz, q, inv, scs, szp, sk, CQ: gl.constexpr):
    """Scores of chunk ``CQ`` (32 of each warp's 128 channels): ``q * cs / cmax`` as two fp16
    operands ``hi + lo``
    (about 2^-22; one fp16 operand is too coarse on records whose zero-point term nearly
    cancels the code term, see ``decode_mma_t._qs_t``) on exact codes (``_k_codes``)."""
    kcs = _chan_from_run(scs.slice(8 * CQ, 8, dim=2).load(_RUN8)) * inv
    kzp = _chan_from_run(szp.slice(8 * CQ, 8, dim=2).load(_RUN8))
    x = q * gl.expand_dims(kcs, 1)
    hi = x.to(gl.float16)
    qs = gl.convert_layout(hi, _A3, assert_trivial=True)
    qt = gl.convert_layout((x - hi.to(gl.float32)).to(gl.float16), _A3, assert_trivial=True)
    qz = qz + gl.sum(q * gl.expand_dims(kzp, 1), axis=2)
    t = sk.slice(8 * CQ, 8, dim=1).load(_RDK3)  # [W, 8 i, 32 lanes]
    kw = gl.convert_layout(
        gl.reshape(gl.permute(gl.reshape(t, [4, 8, 8, 4]), [0, 3, 1, 2]), [4, 32, 8]),
        _KW3,
        assert_trivial=True,
    )
    kop = gl.convert_layout(_k_codes(kw), _B3, assert_trivial=True)
    return mma_v2(qs, kop, mma_v2(qt, kop, s)), qz


@gluon.jit
def _values_chunk(acc, alpha3, pw, pz3, wscale, sk, scs, szp, CQ: gl.constexpr):
    """``acc * alpha + wscale * (cs * (pw @ code^T) + zp * sum(pw))`` on value chunk ``CQ``."""
    vt = sk.slice(8 * CQ, 8, dim=1).load(_RDV3)
    o = mma_v2(pw, _v_operand(vt), gl.full([4, 16, 32], 0.0, gl.float32, _M3))
    vcs = gl.expand_dims(_vchan_from_run(scs.slice(8 * CQ, 8, dim=2).load(_VRUN)), 1)
    vzp = gl.expand_dims(_vchan_from_run(szp.slice(8 * CQ, 8, dim=2).load(_VRUN)), 1)
    return (acc * alpha3 + pz3 * (wscale * vzp)) + o * (wscale * vcs)


@gluon.jit
def _pool_lat(pool_ptr, row0, valid, ch, tok):
    """fp16 pool latents at channels ``ch`` and tokens ``tok`` (broadcastable index tensors of
    a B operand; tokens past ``valid`` read as 0)."""
    base = pool_ptr + row0 * 512  # int32 offsets below: one block is 32 K elements
    return gl.load(base + (tok * 512 + ch), mask=tok < valid, other=0.0).to(gl.float16)


@gluon.jit
def _pool_scores(pool_ptr, row0, valid, q0, q1, q2, q3, rw):
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _B3)))
    k = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _B3)))
    n = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, _B3)))
    tok = _tok(n)[None, None, :]
    s = gl.full([4, 16, 64], 0.0, gl.float32, _M3)
    ch = w[:, None, None] * 128 + _score_chan(k, 0)[None, :, None]
    q16 = gl.convert_layout(q0.to(gl.float16), _A3, assert_trivial=True)
    s = mma_v2(q16, _pool_lat(pool_ptr, row0, valid, ch, tok), s)
    ch = w[:, None, None] * 128 + _score_chan(k, 1)[None, :, None]
    q16 = gl.convert_layout(q1.to(gl.float16), _A3, assert_trivial=True)
    s = mma_v2(q16, _pool_lat(pool_ptr, row0, valid, ch, tok), s)
    ch = w[:, None, None] * 128 + _score_chan(k, 2)[None, :, None]
    q16 = gl.convert_layout(q2.to(gl.float16), _A3, assert_trivial=True)
    s = mma_v2(q16, _pool_lat(pool_ptr, row0, valid, ch, tok), s)
    ch = w[:, None, None] * 128 + _score_chan(k, 3)[None, :, None]
    q16 = gl.convert_layout(q3.to(gl.float16), _A3, assert_trivial=True)
    s = mma_v2(q16, _pool_lat(pool_ptr, row0, valid, ch, tok), s)
    return s * gl.expand_dims(gl.expand_dims(rw, 0), 0)


@gluon.jit
def _pool_values(acc, alpha3, pw, wscale, pool_ptr, row0, valid, CQ: gl.constexpr):
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _B3)))
    k = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, _B3)))
    n = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _B3)))
    ch = w[:, None, None] * 128 + _value_chan(n, CQ)[None, None, :]
    lat = _pool_lat(pool_ptr, row0, valid, ch, _tok(k)[None, :, None])
    o = mma_v2(pw, lat, gl.full([4, 16, 32], 0.0, gl.float32, _M3))
    return acc * alpha3 + wscale * o


@gluon.jit
def _softmax(part, okc, rw, m, l):
    """The warps' partial scores summed, then one online-softmax step (the same in every
    warp): new ``m``, ``l``, the accumulators' rescale factor, the value operand ``fp16(p * rw
    / rmax)`` (``rw`` the row scales of the block), its row sums and ``rmax``."""
    s = gl.sum(part, axis=0)  # [16, 64], base-2 logits (q carries the scale)
    s = gl.where(okc[None, :], s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new[:, None])
    l = l * alpha + gl.sum(p, axis=1)
    rmax = gl.max(rw, axis=0)
    rmax = gl.where(rmax > 0.0, rmax, 1.0)
    pw16 = (p * (rw / rmax)[None, :]).to(gl.float16)
    pw = gl.convert_layout(
        gl.broadcast(gl.expand_dims(pw16, 0), gl.full([4, 16, 64], 0.0, gl.float16, _M3))[0],
        _A3,
        assert_trivial=True,
    )
    # sum(pw) per row, of the fp16 values the value dot multiplies: one n8 column of ones
    spw = mma_v2(pw, gl.full([4, 64, 8], 1.0, gl.float16, _B3),
                 gl.full([4, 16, 8], 0.0, gl.float32, _M3))  # fmt: skip
    return m_new, l, _row_vec(alpha), pw, gl.expand_dims(gl.max(spw, axis=2), 2), rmax


@gluon.jit
def _store_chunk(po_ptr, prow, hok, acc, inv_l3, CQ: gl.constexpr):
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, _COLS3))
    n = gl.arange(0, 32, layout=gl.SliceLayout(0, _COLS3))
    ch = w[:, None] * 128 + _value_chan(n, CQ)[None, :]
    ptr = po_ptr + prow[None, :, None] * 512 + ch[:, None, :]
    gl.store(ptr, acc * inv_l3, mask=hok[None, :, None])


@gluon.jit
def mla_mma_kernel(
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
    NBUF: gl.constexpr,
):
    """Grid ``(B, splits, ceil(H / 16))``, four warps: split ``program_id(1)`` of request
    ``program_id(0)``'s blocks for 16 heads; writes normalized partial rows (physical channel
    order) and natural-log log-sum-exps to the workspace of ``mla_decode``. ``qk_scale`` is
    the softmax scale times log2(e)."""
    b = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    num_splits = gl.num_programs(1)
    h0 = gl.program_id(2) * 16
    hr = h0 + gl.arange(0, 16, layout=gl.SliceLayout(0, _ROWS3))
    hok = hr < H
    qrow = b * H + gl.where(hok, hr, 0)
    prow = qrow * S + split
    seq_len = gl.load(seq_ptr + b)
    n_blk = gl.minimum((seq_len + 63) // 64, max_blocks)
    per = gl.maximum((n_blk + num_splits - 1) // num_splits, MIN_BLOCKS)
    lo = split * per
    hi = gl.minimum(lo + per, n_blk)
    h2 = h0 + gl.arange(0, 16, layout=_R2)
    if lo >= hi:
        # nothing to read: the combine skips this split's (unwritten) partial row
        lse_ptr = plse_ptr + (b * H + h2) * S + split
        gl.store(lse_ptr, gl.full([16], float("-inf"), gl.float32, _R2), mask=h2 < H)
        return
    bt_row = bt_ptr + b * bt_stride
    gl.static_assert(NBUF >= 2)
    sk = gl.allocate_shared_memory(gl.int32, [NBUF, 4, 32, 32], _SHK)
    scs = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 4, 32], _SHV)
    szp = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 4, 32], _SHV)
    srs = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 8], _SH2D)
    srope = gl.allocate_shared_memory(gl.bfloat16, [NBUF, 4, 64, 16], _SHV)
    for st in gl.static_range(NBUF - 1):
        _issue_stage(sk.index(st), scs.index(st), szp.index(st), srs.index(st),
                     srope.index(st), lo + st, hi, bt_row, rec32_ptr, rec16_ptr, recbf_ptr,
                     REC, CS_OFF, ZP_OFF, RS_OFF, ROPE_OFF)  # fmt: skip

    q0 = _load_q(qrot_ptr, qrow, hok, qk_scale, 0)
    q1 = _load_q(qrot_ptr, qrow, hok, qk_scale, 1)
    q2 = _load_q(qrot_ptr, qrow, hok, qk_scale, 2)
    q3 = _load_q(qrot_ptr, qrow, hok, qk_scale, 3)
    qr_hi, qr_lo = _q_rope(q_ptr, b, h0, H, qk_scale)
    nc = gl.arange(0, 64, layout=_C2)
    tokc = _tok(nc)  # physical token of each score column

    m = gl.full([16], -1.0e30, gl.float32, _R2)
    l = gl.full([16], 0.0, gl.float32, _R2)
    a0 = gl.full([4, 16, 32], 0.0, gl.float32, _M3)
    a1 = gl.full([4, 16, 32], 0.0, gl.float32, _M3)
    a2 = gl.full([4, 16, 32], 0.0, gl.float32, _M3)
    a3 = gl.full([4, 16, 32], 0.0, gl.float32, _M3)
    blk = gl.load(bt_row + lo).to(gl.int64)
    pb = gl.load(map_ptr + blk)
    for u in range(lo, hi):
        j = u - lo
        blk_n = gl.load(bt_row + gl.minimum(u + 1, hi - 1)).to(gl.int64)
        pb_n = gl.load(map_ptr + blk_n)
        nst = (j + NBUF - 1) % NBUF
        gl.thread_barrier()  # every warp is done with the stage about to be overwritten
        _issue_stage(sk.index(nst), scs.index(nst), szp.index(nst), srs.index(nst),
                     srope.index(nst), u + NBUF - 1, hi, bt_row, rec32_ptr, rec16_ptr,
                     recbf_ptr, REC, CS_OFF, ZP_OFF, RS_OFF, ROPE_OFF)  # fmt: skip
        async_copy.wait_group(NBUF - 1)
        gl.thread_barrier()
        if pb < 0:
            # a packed block (exact-pool blocks are read by the loop below)
            cst = j % NBUF
            valid = gl.minimum(seq_len - u * 64, 64)
            okc = tokc < valid
            rw = gl.where(okc, _staged_rs(srs.index(cst)), 0.0)
            ck = sk.index(cst)
            cc = scs.index(cst)
            cz = szp.index(cst)
            part = _packed_scores(ck, cc, cz, q0, q1, q2, q3, rw)
            # RoPE columns past ``valid`` (a partial block) are masked with the scores
            rope = srope.index(cst).permute([0, 2, 1]).load(_B3)
            part = mma_v2(qr_lo, rope, mma_v2(qr_hi, rope, part))
            m, l, alpha3, pw, pz3, rmax = _softmax(part, okc, rw, m, l)
            a0 = _values_chunk(a0, alpha3, pw, pz3, rmax, ck, cc, cz, 0)
            a1 = _values_chunk(a1, alpha3, pw, pz3, rmax, ck, cc, cz, 1)
            a2 = _values_chunk(a2, alpha3, pw, pz3, rmax, ck, cc, cz, 2)
            a3 = _values_chunk(a3, alpha3, pw, pz3, rmax, ck, cc, cz, 3)
        blk = blk_n
        pb = pb_n
    async_copy.wait_group(0)

    # Blocks mapped to the exact pool (the filling tail, sinks, rehydrated blocks), after the
    # packed ones (attention does not depend on the order): the split's block-table entries
    # are read 128 at a time and their pool-map entries checked at once, so a split without
    # pool blocks pays one vector load per 128 blocks, and this code's registers stay out of
    # the packed loop's.
    for t0 in range(lo, hi, 128):
        ib = t0 + gl.arange(0, 128, layout=_VEC)
        okb = ib < hi
        pbs = gl.load(map_ptr + gl.load(bt_row + ib, mask=okb, other=0), mask=okb, other=-1)
        for _ in range(gl.sum((pbs >= 0).to(gl.int32), axis=0)):
            u = gl.min(gl.where(pbs >= 0, ib, 1 << 30), axis=0)
            pbu = gl.max(gl.where(ib == u, pbs, -1), axis=0)
            pbs = gl.where(ib == u, -1, pbs)
            valid = gl.minimum(seq_len - u * 64, 64)
            okc = tokc < valid
            row0 = pbu.to(gl.int64) * 64
            if FP8:
                rw = gl.load(pscale_ptr + row0 + tokc, mask=okc, other=0.0)
            else:
                rw = gl.where(okc, 1.0, 0.0)
            part = _pool_scores(pool_ptr, row0, valid, q0, q1, q2, q3, rw)
            rope = _rope_operand(prope_ptr, row0, valid)
            part = mma_v2(qr_lo, rope, mma_v2(qr_hi, rope, part))
            m, l, alpha3, pw, pz3, rmax = _softmax(part, okc, rw, m, l)
            a0 = _pool_values(a0, alpha3, pw, rmax, pool_ptr, row0, valid, 0)
            a1 = _pool_values(a1, alpha3, pw, rmax, pool_ptr, row0, valid, 1)
            a2 = _pool_values(a2, alpha3, pw, rmax, pool_ptr, row0, valid, 2)
            a3 = _pool_values(a3, alpha3, pw, rmax, pool_ptr, row0, valid, 3)

    seen = l != 0.0  # l NaN (a NaN or infinite query) is kept: the output is NaN
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l, 1.0), 0.0)
    lse = gl.where(seen, (m + gl.log2(gl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(plse_ptr + (b * H + h2) * S + split, lse, mask=h2 < H)
    inv3 = _row_vec(inv_l)
    _store_chunk(po_ptr, prow, hok, a0, inv3, 0)
    _store_chunk(po_ptr, prow, hok, a1, inv3, 1)
    _store_chunk(po_ptr, prow, hok, a2, inv3, 2)
    _store_chunk(po_ptr, prow, hok, a3, inv3, 3)
