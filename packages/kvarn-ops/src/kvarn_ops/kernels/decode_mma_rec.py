"""4-bit K codes staged in record order and read by ``ldmatrix.trans`` (the transposed MMA
decode kernel, ``decode_mma_t.py``, at head_dim 128 with 4-bit K and one KV head a program).

``decode_mma.py`` stages a block's K words lane-major: each lane needs whole 32-bit words of
four channels 1 KB apart, so the words are gathered by 4-byte ``cp.async`` copies (48 a
64-token block with the V words), and those copies load the L1 pipe: staging the same bytes
with 16-byte copies in record order, the reads left as they were (wrong lanes, timing only),
was 11-12% faster at batch 8-64 on an H100 (``benchmarks/probe_decode_levers.py``,
BENCHMARKS.md "2026-12-06, evening").

Here the half's K codes are copied as they lie in the record (channel ``c``'s 64 tokens are 32
bytes, one 16-bit element per four tokens), 8 copies of 16 bytes a lane, into a shared tile
``[128 channels, 16 quads]`` whose 16-byte units are swizzled so that eight consecutive
channels' rows fall in distinct banks. ``ldmatrix.x4.trans`` of that tile hands lane ``(g, t)``
(``g = lane // 4``, ``t = lane % 4``) 32-bit registers that hold channels ``2t`` and ``2t + 1``
(low and high half) of token quad ``g``: exactly the channel pair of an A-operand register of
``S^T = K q^T`` for four tokens. Each register becomes four operand registers by one shift,
four ``lop3`` (the nibble into the mantissa of 1024.0) and four ``sub.f16x2`` (2.25
instructions per operand register; 2.5 with the lane-major words, whose byte pairs take a
``prmt``).

Channels keep their physical order (logical channel ``k`` of chunk ``CQ`` is ``32 CQ + k``),
so q is rotated straight into the B-operand distribution (lane ``t`` holds channels ``2t, 2t
+ 1`` mod 8, rows by ``g``: :func:`q_rows`), and the K column scales and zero points are
read in it. Tokens: S^T row ``m = 16 mt + 8 y + g`` is token ``32 (mt >> 1) + 4 g + 2 (mt &
1) + y`` (:func:`tok_of_row`); the value side keeps ``decode_mma_t``'s token order, so the
softmax weights are permuted (:func:`p_for_values`) on their way through shared memory to the
B operand of ``O^T = V^T P^T``, which they take anyway.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from kvarn_ops.kernels import decode_mma as M

# [128 channels, 16 quads] fp16 stage: 16-byte units swizzled (rows 4-7 of every 8 swap their
# two units), so the 8 rows of one ldmatrix matrix (8 consecutive channels) hit 8 distinct
# 16-byte bank groups
SH_K: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[1, 0])
# the copies: 16 bytes (8 quads) per vector, lanes along the record (16 channels' 512
# contiguous bytes a copy instruction), 8 vectors a lane
_CP_K: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[16, 2], warps_per_cta=[1, 1], order=[1, 0]
)
# one 32-channel chunk as ldmatrix.x4.trans hands it over: register bit 0 channel + 1 (the two
# halves of a 32-bit register), lanes t channel + 2, + 4, lanes g quad + 1, + 2, + 4
_LT_K: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [8, 0], [16, 0], [0, 8]],
    lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=[],
    block_bases=[],
    shape=[32, 16],
)
# q rows [8, 128] in the score operand's channel distribution: lane 4 g + t holds row g,
# channels 2 t + {0, 1} + 8 j; the Walsh-Hadamard stages on channel bits 1 and 2 cross lanes
QL_REC: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [0, 64]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 128],
)
# the row vectors of a half (K and V row scales, V zero points) as [8 g, 8 r]: lane g's run r
# is token 4 g + 32 (r >> 2) + (r & 3)
_CP_TOK: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 1, 4], threads_per_warp=[8, 4, 1], warps_per_cta=[1, 1, 1], order=[2, 1, 0]
)


# a 32-channel chunk of a staged channel vector [1, 32] as the operands hold it: registers
# channel + 1, + 8, + 16, lanes t channel + 2, + 4 (every lane group g the same)
_KV_RUN: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16]],
    lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[1, 32],
)


@gluon.jit
def chan_chunk(sc, CQ: gl.constexpr, LAYOUT: gl.constexpr):
    """Channels ``32 CQ ..`` of a staged [4, 32] channel vector as [32] in ``LAYOUT`` (the
    score operand's channel slice or the zero-point operand's)."""
    v = gl.reshape(sc.slice(CQ, 1, dim=0).load(_KV_RUN).to(gl.float32), [32])
    return gl.convert_layout(v, LAYOUT)


@gluon.jit
def stage_k(sk, r16, ok, half, K_OFF: gl.constexpr, G: gl.constexpr):
    """cp.async of the 64-token half ``half`` of a record's 4-bit K codes into ``sk`` [128,
    16] (fp16 elements = four tokens' nibbles): channel ``c``'s half is its ``G / 2`` code
    bytes' ``32 half ..``."""
    c = gl.arange(0, 128, layout=gl.SliceLayout(1, _CP_K))
    q = gl.arange(0, 16, layout=gl.SliceLayout(0, _CP_K))
    off = c[:, None] * (G // 4) + q[None, :]
    base = r16 + K_OFF // 2 + half * 16
    async_copy.async_copy_global_to_shared(sk, base + off, mask=(off >= 0) & ok)


@gluon.jit
def stage_tokens(skr, svr, svz, r16, ok, half, KRS_OFF: gl.constexpr, VRS_OFF: gl.constexpr,
                 VZP_OFF: gl.constexpr):  # fmt: skip
    """cp.async of the half's K row scales, V row scales and V zero points as [8 g, 8 r]
    (token ``4 g + 32 (r >> 2) + (r & 3)``: 8-byte runs)."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CP_TOK)))
    j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CP_TOK)))
    i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CP_TOK)))
    ot = g[:, None, None] * 4 + j[None, :, None] * 32 + i[None, None, :]
    mt = (ot >= 0) & ok
    r16h = r16 + half * 64
    sh: gl.constexpr = [8, 2, 4]
    async_copy.async_copy_global_to_shared(skr.reshape(sh), r16h + KRS_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svr.reshape(sh), r16h + VRS_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svz.reshape(sh), r16h + VZP_OFF // 2 + ot, mask=mt)


NIBBLES4_ASM = (
    "{ .reg .b32 h, o; mov.b32 o, 1677747200; shr.b32 h, $4, 8; "
    "lop3.b32 $0, $4, 983055, 1677747200, 0xea; sub.f16x2 $0, $0, o; "  # 0x000F000F
    "lop3.b32 $1, $4, 15728880, 1677747200, 0xea; sub.f16x2 $1, $1, o; "  # 0x00F000F0
    "lop3.b32 $2, h, 983055, 1677747200, 0xea; sub.f16x2 $2, $2, o; "
    "lop3.b32 $3, h, 15728880, 1677747200, 0xea; sub.f16x2 $3, $3, o; }"
)
"""The offset unpack of :func:`_nibbles4`: nibbles 0..3 of each 16-bit half of ``$4`` as the
exact fp16 values ``c``, ``16 c``, ``c``, ``16 c`` (masked into the mantissa of 1024.0, 1024
subtracted): one shift, four ``lop3``, four ``sub.f16x2``."""

_ASM: gl.constexpr = gl.constexpr(NIBBLES4_ASM)


@gluon.jit
def _nibbles4(x):
    """The four nibbles of each 16-bit element of ``x`` (int16) as exact fp16 values ``c``,
    ``16 c``, ``c``, ``16 c`` (nibbles 0..3); one 32-bit register (two elements) gives four
    operand registers (:data:`NIBBLES4_ASM`)."""
    return gl.inline_asm_elementwise(
        _ASM,
        "=r,=r,=r,=r,r",
        [x],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def k_operand(sk, CQ: gl.constexpr, OPA: gl.constexpr):
    """A operand [64 S^T rows, 32 channels] of chunk ``CQ`` (channels ``32 CQ ..``): two
    ``ldmatrix.x4.trans``, then :func:`_nibbles4`; row ``m = 32 qh + 16 i1 + 8 i0 + g`` is
    token ``4 (8 qh + g) + 2 i1 + i0`` (odd tokens hold ``16 c``)."""
    x = sk.slice(32 * CQ, 32, dim=0).load(_LT_K).to(gl.int16, bitcast=True)
    n0, n1, n2, n3 = _nibbles4(x)
    c = M._stack4(n0, n1, n2, n3)  # [32 ch, 16 quad, 4 i]
    c = gl.reshape(c, [32, 2, 8, 2, 2])  # ch qh ql i1 i0
    c = gl.permute(c, [1, 3, 4, 2, 0])  # qh i1 i0 ql ch
    return gl.convert_layout(gl.reshape(c, [64, 32]), OPA, assert_trivial=True)


@gluon.jit
def tok_of_row(ROWS: gl.constexpr):
    """Token of each S^T row (``ROWS`` = the S^T row layout)."""
    m = gl.arange(0, 64, layout=ROWS)
    return (m >> 5) * 32 + (m & 7) * 4 + ((m >> 4) & 1) * 2 + ((m >> 3) & 1)


@gluon.jit
def tok_rows(v, ROWS: gl.constexpr):
    """An [8 g, 8 r] run tile of a row vector (:func:`stage_tokens`) in S^T row order."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [8, 2, 2, 2]), [1, 2, 3, 0])  # j i1 i0 g
    return gl.convert_layout(gl.reshape(v, [64]), ROWS, assert_trivial=True)


@gluon.jit
def p_for_values(p):
    """The softmax weights [64 S^T rows, 8] reordered into ``decode_mma_t``'s value-side token
    order (row ``k`` = token ``16 (k >> 1 & 3) + 8 (k & 1) + 2 (k >> 4) + (k >> 3 & 1)``):
    a register renaming before the weights' trip through shared memory."""
    x = gl.reshape(p, [2, 2, 2, 2, 2, 2, 8])  # m5 m4 m3 m2 m1 m0 n
    x = gl.permute(x, [5, 1, 2, 0, 3, 4, 6])  # k5..k0 = m0 m4 m3 m5 m2 m1
    return gl.reshape(x, [64, 8])


@gluon.jit
def _butterfly(x, B: gl.constexpr):
    """One Walsh-Hadamard stage on channel bit ``B`` (a register bit of :data:`QL_REC`)."""
    x = gl.reshape(x, [8, 128 >> (B + 1), 2, 1 << B])
    a, b = gl.split(gl.permute(x, [0, 1, 3, 2]))
    y = gl.permute(gl.join(a + b, a - b), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(y, [8, 128]), QL_REC, assert_trivial=True)


@gluon.jit
def q_rows(q_ptr, b, h, num_q_heads, qk_scale, T: gl.constexpr, GQA: gl.constexpr,
           PAIRED: gl.constexpr = False):  # fmt: skip
    """Query rows [8, 128] (``M._q_rows``' rows, scaled and rotated in fp32) in
    :data:`QL_REC`: register stages on channel bits 0, 3, 4, 5, 6, ``shfl`` stages on bits 1
    and 2. With ``PAIRED`` (at most four rows) row ``n`` holds query row ``n >> 1``."""
    rq = gl.arange(0, 8, layout=gl.SliceLayout(1, QL_REC))
    if PAIRED:
        rq = rq >> 1
    cq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL_REC))
    ok = rq < T * GQA
    qrow = ((b * T + rq // GQA) * num_q_heads + h * GQA + rq % GQA).to(gl.int64)
    q = gl.load(q_ptr + qrow[:, None] * 128 + cq[None, :], mask=ok[:, None], other=0.0)
    x = q.to(gl.float32) * qk_scale
    s1 = gl.full([8, 128], 1.0, gl.float32, QL_REC) - 2.0 * ((cq >> 1) & 1).to(gl.float32)[None, :]
    s2 = gl.full([8, 128], 1.0, gl.float32, QL_REC) - 2.0 * ((cq >> 2) & 1).to(gl.float32)[None, :]
    x = _butterfly(x, 0)
    x = _butterfly(x, 3)
    x = _butterfly(x, 4)
    x = _butterfly(x, 5)
    x = _butterfly(x, 6)
    x = M._butterfly_lanes(x, s1, 1)
    return M._butterfly_lanes(x, s2, 2) * 0.08838834764831845  # 1 / sqrt(128)


@gluon.jit
def q_chunk(qrot, CQ: gl.constexpr, QB: gl.constexpr):
    """Channels ``32 CQ ..`` of :func:`q_rows`' output as the [32, 8] score operand (in
    ``QB``; register selections only)."""
    x = gl.permute(gl.reshape(qrot, [8, 2, 2, 32]), [0, 3, 2, 1])  # r k ch5 ch6
    a, b = gl.split(x)
    x = b if CQ // 2 == 1 else a
    a, b = gl.split(x)
    x = b if CQ % 2 == 1 else a
    return gl.convert_layout(gl.permute(x, [1, 0]), QB, assert_trivial=True)
