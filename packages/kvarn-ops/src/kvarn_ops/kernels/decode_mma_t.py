"""The MMA decode kernel with the query rows in the MMA's N dimension (at most 8 rows).

``decode_mma.py`` puts a KV head's query rows (T * GQA) in the M dimension of
``mma.sync.m16n8k16``, which is 16: with GQA 4 and T 1, 12 of the 16 rows are padding, and every
fp32 operation on scores, softmax weights and output accumulators is done for all 16. Here the
dots are transposed, ``S^T = K^T q^T`` and ``O^T = V^T P^T``: codes are the A operand (tokens or
channels in M), the query rows are the N dimension (8), so a lane holds half as many fp32 values
and the block needs half the MMAs. The code words and their lane assignment are those of
``decode_mma.py`` (the A operand pairs the same k indices as the B operand did); what changes is
the renaming of tokens (``M`` index ``16 mt + 8 y + g`` of the scores is token ``8 g + 2 mt +
y``), the scale vectors' lane runs, and one shared-memory transpose per block of the softmax
weights (C layout of ``S^T`` to B operand of ``O^T``).

Unpacking takes 2.5 instructions per operand register for K and 1.25 for 2-bit V (2.25 and 2.5
before the nibble pairs): one ``prmt`` pairs a byte of two words and every code field of that
byte is masked out of it in place by one ``lop3``, with no shift. A field that is not at the
bottom of its fp16 mantissa carries a power-of-two factor: K's high nibbles become ``16 c``
(those token rows take 16 times the zero-point term and 1/16 of the row scale; K codes have
the 1024 of their mantissa trick subtracted, see ``decode_mma.py`` for why), 2-bit V fields
become ``1 + c / F`` with F = 4, 256, 64, 16 for the fields at bits 0, 2, 4, 6 (the output
accumulator is kept divided by F and multiplied back once at the end). All factors are exact
powers of two. 2-bit K (``KB = 2``, ``decode_mma._k2_codes``): 2.25 instructions per operand
register, fields as exact ``c / F``; each token row's start value takes ``1 / F`` and its row
scale ``F``. The score MMAs start from the zero-point term instead of zero, the value MMAs
from ``pz / F - sum(pw)``, so neither needs an fp32 pass over the tile afterwards; rows that
are equal by construction (the zero-point MMAs) are read from registers, not reduced across
lanes.

The q side: ``q_rot^T`` is computed once per program as an MMA output and moved to the B
operand layout; the zero-point term ``sum_d q_rot[d] zp_K[d]`` runs on the tensor cores (a row
of ``zp_K`` times ``q_rot`` split into fp16 high and low parts). The per-block score operand
``q_rot * s_col_K`` is formed in fp16x2 arithmetic from q_rot's two parts as two fp16 operands
``hi + lo`` (:func:`_split_product`), each of which meets every code operand.

4-bit K at head_dim 128 with one KV head a program (the common case: GQA <= 8, one query
token) does not use the lane-major K words: its codes are staged in record order by 16-byte
copies and read by ``ldmatrix.trans`` (``decode_mma_rec.py``, 11-12% faster on an H100;
``KVARN_DECODE_RECORD_K=0`` turns it off). Head pairs, 2-bit K, the subnormal opt-in and the
head_dim 256 kernel keep the words. With at most four query rows, q's two parts can share
one score operand (:data:`FUSED_COLUMNS`, the default).
"""

from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kvarn_ops.kernels import decode_mma as M
from kvarn_ops.kernels import decode_mma_pair as P
from kvarn_ops.kernels import decode_mma_rec as RK

__all__ = ["mma_decode_t_kernel"]

_MMA = M._MMA
_OPA = M._OPA
_OPB = M._OPB
_TOK: gl.constexpr = gl.SliceLayout(1, _MMA)  # rows of S^T (tokens) / O^T (channels)
_QR: gl.constexpr = gl.SliceLayout(0, _MMA)  # columns: the query rows
# lane g (lane // 4) holds a run: 8 tokens 8 g + i, or 4 channels 16 g + 4 CQ + i
_RUNG8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]],
    lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 8],
)
_RUNG4: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2]],
    lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 4],
)
_SH2: gl.constexpr = M._SH2


@gluon.constexpr_function
def _as_linear(layout_ll):
    return gl.DistributedLinearLayout(
        reg_bases=layout_ll.reg_bases,
        lane_bases=layout_ll.lane_bases,
        warp_bases=layout_ll.warp_bases,
        block_bases=layout_ll.block_bases,
        shape=layout_ll.shape,
    )


@gluon.jit
def _tok_rows(v):
    """[8 g, 8 i] run (token 8 g + i, i = 2 mt + y) -> S^T row order m = 16 mt + 8 y + g."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [8, 4, 2]), [1, 2, 0])
    return gl.convert_layout(gl.reshape(v, [64]), _TOK, assert_trivial=True)


@gluon.jit
def _rows(v, RK4: gl.constexpr):
    """A staged [8, 8] run tile of a row vector in S^T row order: ``decode_mma_rec``'s token
    order with record-order K (``RK4``), else :func:`_tok_rows`'."""
    if RK4:
        return RK.tok_rows(v, gl.constexpr(_TOK))
    else:
        return _tok_rows(v)


@gluon.jit
def _chan_rows(v):
    """[8 g, 4 i] run (channel 16 g + 4 CQ + i, i = 2 mt + y) -> O^T chunk row order."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [8, 2, 2]), [1, 2, 0])
    return gl.convert_layout(gl.reshape(v, [32]), _TOK, assert_trivial=True)


@gluon.jit
def _kchan(v, LAYOUT: gl.constexpr):
    """[4 c, 8 i] run (channel 32 c + 8 CQ + i) -> logical chunk order [32] in ``LAYOUT``."""
    v = gl.permute(gl.reshape(v, [2, 2, 2, 2, 2]), [2, 3, 0, 1, 4])
    return gl.convert_layout(gl.reshape(v, [32]), LAYOUT, assert_trivial=True)


RECORD_ORDER_K = os.environ.get("KVARN_DECODE_RECORD_K", "1") != "0"
"""4-bit K codes staged in record order and read by ``ldmatrix.trans``
(``decode_mma_rec.py``), one KV head a program, offset operands; ``KVARN_DECODE_RECORD_K=0``
(read at import) keeps the lane-major words for every launch."""
_REC_K: gl.constexpr = gl.constexpr(RECORD_ORDER_K)

FUSED_COLUMNS = os.environ.get("KVARN_DECODE_FUSED_COLUMNS", "1") != "0"
"""With at most four query rows a KV head (GQA <= 4 at one query token), one KV head a program
and offset code operands, each query row takes two MMA columns, q's fp16 high part in the even
one and its low part in the odd one, so each code operand meets one score operand instead of
two (the score and zero-point MMAs of a block 116 -> 76) and the pairs' sum fills both columns
(the softmax is computed once per pair): the sm_90a block loop 1,151 -> 1,039 instructions
with record-order 4-bit K, 1,222 -> 1,101 with 2-bit K; on the H200 6-9% faster at batch
1-64 (BENCHMARKS.md "2026-12-06, last"). ``KVARN_DECODE_FUSED_COLUMNS=0`` (read at import)
keeps two score operands."""
_FUSED: gl.constexpr = gl.constexpr(FUSED_COLUMNS)

SUBNORMAL_CODES = M.SUBNORMAL_CODES
"""Opt-in (``KVARN_DECODE_SUBNORMAL=1``; ``decode_mma.SUBNORMAL_CODES`` says why it is off by
default): K and 2-bit V codes as fp16 subnormals (``c * 2^-24`` and ``c 4^f 2^-24``, no offset
to subtract; :func:`M._nibble_pairs`, :func:`M._crumb_pairs`), one instruction per K operand
register fewer and no MMA for the sum of the softmax weights."""
# decode_mma's switch and scalings as this module's globals (a jit function reads a constexpr
# global of its own module; through the module attribute the switch did not take effect)
_SUB: gl.constexpr = M._SUB
_C_IN: gl.constexpr = M._C_IN
_C_OUT: gl.constexpr = M._C_OUT


@gluon.jit
def _k_operand_a(kw):
    """A operand [64 tokens (S^T rows), 32 channels (logical chunk)] of 4-bit K codes: token
    rows of odd nibbles (``y = 1``) hold ``16 c``, the others ``c`` (times ``2^-24`` with
    ``SUBNORMAL_CODES``)."""
    ka, kb = gl.split(gl.permute(gl.reshape(kw, [16, 2, 8]), [0, 2, 1]))
    n0, n1 = M._nibble_pairs(ka, kb, 0, _SUB)
    n2, n3 = M._nibble_pairs(ka, kb, 1, _SUB)
    n4, n5 = M._nibble_pairs(ka, kb, 2, _SUB)
    n6, n7 = M._nibble_pairs(ka, kb, 3, _SUB)
    c = M._stack8(n0, n1, n2, n3, n4, n5, n6, n7)
    # [(8 c + i) // 2, w, x, j]; token 8 w + j, j = 2 mt + y
    # rows m = 16 mt + 8 y + w; channel 16 kt0 + 8 z + 2 c + x (i = 4 kt0 + 2 z + x)
    c = gl.reshape(c, [2, 2, 2, 2, 8, 2, 2, 2, 2])  # c1 c0 kt0 z w x j2 j1 j0
    c = gl.permute(c, [6, 7, 8, 4, 2, 3, 0, 1, 5])
    return gl.convert_layout(gl.reshape(c, [64, 32]), _OPA, assert_trivial=True)


@gluon.jit
def _k2_operand_a(kw):
    """A operand [64 tokens (S^T rows), 32 channels (logical chunk)] of 2-bit K codes
    (:func:`M._k2_codes`): token ``8 w + j`` is field ``j % 4`` of the lane's byte ``j //
    4``, so with ``j = 2 mt + y`` the rows keep the 4-bit operand's token order; row ``j``
    holds ``c / F_(j % 4)``."""
    c = M._k2_codes(kw)
    c = gl.reshape(c, [2, 2, 2, 2, 8, 2, 2, 2, 2])  # c1 c0 kt0 z w x j2 j1 j0
    c = gl.permute(c, [6, 7, 8, 4, 2, 3, 0, 1, 5])
    return gl.convert_layout(gl.reshape(c, [64, 32]), _OPA, assert_trivial=True)


@gluon.jit
def _k_operand(kw, KB: gl.constexpr):
    if KB == 2:
        return _k2_operand_a(kw)
    else:
        return _k_operand_a(kw)


@gluon.jit
def _k_row_factors(AFTER: gl.constexpr, KB: gl.constexpr):
    """Per S^T row (token ``8 w + j``) the factor its score sum carries from the code
    operand (constants): 2-bit K, ``1 / F_(j % 4)``. With ``AFTER``, its inverse (times
    ``_C_OUT``), what the row's sum is multiplied by: 2-bit K ``F``, 4-bit K 1 or 1/16 (odd
    nibbles)."""
    if KB == 2:
        if AFTER:
            r = _run_consts(
                gl.constexpr(_RUNG8),
                8,
                M._crumb_factor(0, False) * _C_OUT,
                M._crumb_factor(1, False) * _C_OUT,
                M._crumb_factor(2, False) * _C_OUT,
                M._crumb_factor(3, False) * _C_OUT,
            )
        else:
            r = _run_consts(
                gl.constexpr(_RUNG8),
                8,
                M._crumb_factor(0, True),
                M._crumb_factor(1, True),
                M._crumb_factor(2, True),
                M._crumb_factor(3, True),
            )
    else:  # 4-bit K: the start values are selected (``odd``), only the row scale's factor
        gl.static_assert(AFTER)
        r = _run_consts(gl.constexpr(_RUNG8), 8, _C_OUT, 0.0625 * _C_OUT, _C_OUT, 0.0625 * _C_OUT)
    return _tok_rows(r)


@gluon.jit
def _v_operand_a(va, vb, CQ: gl.constexpr, VB: gl.constexpr):
    """A operand [32 channels (logical chunk CQ), 64 tokens] of V codes (2-bit: field f holds
    ``1 + c / F_f``, or ``c / F_f`` as subnormals, see :func:`_crumb_pairs`; 4-bit: ``c``)."""
    if VB == 2:
        f0, f1, f2, f3 = M._crumb_pairs(va, vb, CQ, _SUB)
        c = M._stack4(f0, f1, f2, f3)
    else:
        BIT0: gl.constexpr = (4 * CQ * VB) % 32
        c = M._stack4(
            M._v_field(va, vb, (BIT0 + 0 * VB) % 8, (BIT0 + 0 * VB) // 8, VB),
            M._v_field(va, vb, (BIT0 + 1 * VB) % 8, (BIT0 + 1 * VB) // 8, VB),
            M._v_field(va, vb, (BIT0 + 2 * VB) % 8, (BIT0 + 2 * VB) // 8, VB),
            M._v_field(va, vb, (BIT0 + 3 * VB) % 8, (BIT0 + 3 * VB) // 8, VB),
        )
    # [c, i', g, x, f]: token 16 c + 8 x + i' (i' = 2 kt + z), channel 16 g + 4 CQ + f
    # rows 8 f + g (f = 2 mt + y); tokens k = 16 kt + 8 z + 2 c + x
    c = gl.reshape(c, [2, 2, 2, 2, 2, 8, 2, 4])  # c1 c0 kt1 kt0 z g x f
    c = gl.permute(c, [7, 5, 2, 3, 4, 0, 1, 6])
    return gl.convert_layout(gl.reshape(c, [32, 64]), _OPA, assert_trivial=True)


@gluon.jit
def _q_chunk(qrot, QB: gl.constexpr, CQ: gl.constexpr):
    """``q_rot^T`` rows ``32 CQ ..`` (logical channels) x 8 query rows in ``QB``."""
    x = gl.permute(M._q_chunk_parts(qrot, CQ), [2, 3, 1, 4, 0])  # kt0 z c x n
    return gl.convert_layout(gl.reshape(x, [32, 8]), QB, assert_trivial=True)


@gluon.jit
def _q_parts(qr, QB: gl.constexpr):
    hi = qr.to(gl.float16)
    lo = (qr - hi.to(gl.float32)).to(gl.float16)
    return (
        gl.convert_layout(hi, _OPB, assert_trivial=True),
        gl.convert_layout(lo, _OPB, assert_trivial=True),
    )


@gluon.jit
def _split_product(qh, ql, s):
    """``(qh + ql) * s`` as two fp16 terms ``hi + lo`` (relative error about 2^-21, against
    2^-12 for the rounded product alone), in fp16x2 arithmetic: ``t = ql s``, ``hi = qh s +
    t``, ``lo = (qh s - hi) + t`` (both ``qh s`` products inside an ``fma``, exact there);
    five instructions per two channels."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, n; mul.rn.f16x2 t, $3, $4; fma.rn.f16x2 $0, $2, $4, t; "
        "xor.b32 n, $0, 0x80008000; fma.rn.f16x2 $1, $2, $4, n; add.rn.f16x2 $1, $1, t; }",
        "=r,=r,r,r,r",
        [qh, ql, s],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _select_lo(hi, lo, odd):
    """``lo`` where ``odd`` is all ones, ``hi`` where it is 0 (int16 masks; one ``lop3`` per
    register)."""
    return gl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, $3, 0xd8;",
        "=r,r,r,r",
        [hi, lo, odd],
        dtype=gl.float16,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _qs_t(qz, qh, ql, kcs_run, kzp_run, QB: gl.constexpr, qf=None, odd=None):
    """One 32-channel chunk's score operand ``qs = q_rot * s_col_K`` as two fp16 operands
    ``hi + lo`` (:func:`_split_product`) and ``qz += zp_K q_rot`` (hi + lo; rows all equal).

    One fp16 operand is not enough: a record whose zero-point term nearly cancels the code
    term (large channel zero points and row scales, as on tokens with outsized keys) turns
    the 2^-12 rounding of ``qs`` into score errors of tens of log2 units (measured offline on
    a GPU parity record with row scales near 300: -19 on its top keys, whose output came out
    2.8x off on the GPU); with ``hi + lo`` and exact codes that record's scores are within
    0.001."""
    kcs = _kchan(kcs_run, gl.SliceLayout(1, QB))
    return _qs_parts(qz, qh, ql, kcs, _kchan(kzp_run, gl.SliceLayout(0, _OPA)), QB, qf, odd)


@gluon.jit
def _qs_parts(qz, qh, ql, kcs, zrow, QB: gl.constexpr, qf=None, odd=None):
    """:func:`_qs_t`'s products from one chunk's fp16 column scales ``kcs`` [32] (the score
    operand's channel slice) and zero points ``zrow`` [32] (the zero-point operand's). Given
    ``qf`` and ``odd`` (:func:`_fused_q`), one operand carries both parts, ``hi`` in the even
    columns and ``lo`` in the odd ones (returned twice), and so does the zero-point MMA's."""
    qhl = gl.convert_layout(qh, QB, assert_trivial=True)
    qll = gl.convert_layout(ql, QB, assert_trivial=True)
    kcs2 = gl.full(qhl.shape, 0.0, gl.float16, QB) + kcs[:, None]
    hi, lo = _split_product(qhl, qll, kcs2)
    za = gl.full([16, 32], 0.0, gl.float16, _OPA) + zrow[None, :]
    if qf is not None:
        qz = mma_v2(za, qf, qz)
        qs = gl.convert_layout(_select_lo(hi, lo, odd), _OPB, assert_trivial=True)
        return qs, qs, qz
    qz = mma_v2(za, qh, qz)
    qz = mma_v2(za, ql, qz)
    qs_hi = gl.convert_layout(hi, _OPB, assert_trivial=True)
    qs_lo = gl.convert_layout(lo, _OPB, assert_trivial=True)
    return qs_hi, qs_lo, qz


@gluon.jit
def _fused_q(qh, ql, odd, QB: gl.constexpr):
    """The fused zero-point operand: ``qh`` in the even columns, ``ql`` in the odd ones
    (``odd``: :func:`_odd_cols`)."""
    qhl = gl.convert_layout(qh, QB, assert_trivial=True)
    qll = gl.convert_layout(ql, QB, assert_trivial=True)
    return gl.convert_layout(_select_lo(qhl, qll, odd), _OPB, assert_trivial=True)


@gluon.jit
def _odd_cols(QB: gl.constexpr):
    """[32, 8] int16 in ``QB``: all ones in the odd columns, 0 in the even ones."""
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, QB))
    return gl.full([32, 8], 0, gl.int16, QB) - (n & 1).to(gl.int16)[None, :]


@gluon.jit
def _score_chunk(ck, CQ: gl.constexpr, qs, qt, s, RK4: gl.constexpr, KB: gl.constexpr,
                 FUSED: gl.constexpr):  # fmt: skip
    """``s`` plus chunk ``CQ``'s score products: its code operand (record-order 4-bit K, or
    the lane-major words) against both fp16 parts of ``q * s_col_K`` (the low part's MMAs
    first), or against the one fused operand that holds both (``FUSED``)."""
    if RK4:
        ka = RK.k_operand(ck, CQ, gl.constexpr(_OPA))
    else:
        ka = _k_operand(M._staged_kw(ck, CQ), KB)
    if FUSED:
        return mma_v2(ka, qs, s)
    return mma_v2(ka, qs, mma_v2(ka, qt, s))


@gluon.jit
def _pair_sum(x, R: gl.constexpr):
    """An [R, 8] MMA accumulator's column pairs ``(2 r, 2 r + 1)`` summed into both columns
    (a lane holds both columns of a pair: register adds)."""
    a, b = gl.split(gl.reshape(x, [R, 4, 2]))
    y = a + b
    return gl.convert_layout(gl.reshape(gl.join(y, y), [R, 8]), _MMA, assert_trivial=True)


@gluon.jit
def _qs_rec(qz, qh, ql, skc, skz, CQ: gl.constexpr, QB: gl.constexpr, qf=None, odd=None):
    """:func:`_qs_t` for record-order K (``decode_mma_rec``): chunk ``CQ`` of the staged
    column scales and zero points ``skc`` / ``skz`` [4, 32], in physical channel order."""
    kc = RK.chan_chunk(skc, CQ, gl.constexpr(gl.SliceLayout(1, QB)))
    kz = RK.chan_chunk(skz, CQ, gl.constexpr(gl.SliceLayout(0, _OPA)))
    return _qs_parts(qz, qh, ql, kc.to(gl.float16), kz.to(gl.float16), QB, qf, odd)


@gluon.jit
def _equal_rows(x):
    """A [16, 8] MMA accumulator whose rows are all equal, as [8 g, 8] (row ``g`` of each
    lane, the other held row dropped): no shuffle, unlike a reduction over the rows."""
    return gl.max(gl.reshape(x, [2, 8, 8]), axis=0)


@gluon.jit
def _rows_like(xg, R: gl.constexpr):
    """[8 g, 8] from :func:`_equal_rows` broadcast to an [R, 8] MMA accumulator (register
    copies)."""
    x = gl.reshape(xg[None, :, :] + gl.full([R // 8, 1, 1], 0.0, gl.float32, layout=None), [R, 8])
    return gl.convert_layout(x, _MMA, assert_trivial=True)


@gluon.jit
def _run_consts(
    LAYOUT: gl.constexpr,
    N: gl.constexpr,
    C0: gl.constexpr,
    C1: gl.constexpr,
    C2: gl.constexpr,
    C3: gl.constexpr,
):
    """An [8, N] run tile holding ``C_(i % 4)`` at run index ``i`` (the run is a register axis,
    so every register holds a compile-time constant)."""
    i = gl.arange(0, N, layout=gl.SliceLayout(0, LAYOUT)) % 4
    c = gl.where(i == 0, C0, gl.where(i == 1, C1, gl.where(i == 2, C2, C3)))
    return gl.full([8, N], 0.0, gl.float32, LAYOUT) + c[None, :]


@gluon.jit
def _v_factors(INVERSE: gl.constexpr):
    """The 2-bit V field factors F (or 1 / F) of a channel chunk's O^T rows (constants)."""
    return _chan_rows(
        _run_consts(
            gl.constexpr(_RUNG4),
            4,
            M._crumb_factor(0, INVERSE, _SUB),
            M._crumb_factor(1, INVERSE, _SUB),
            M._crumb_factor(2, INVERSE, _SUB),
            M._crumb_factor(3, INVERSE, _SUB),
        )
    )


@gluon.jit
def _values_t(acc, pwb, pt, va, vb, vcs_run, CQ: gl.constexpr, VB: gl.constexpr):
    """``acc + s_col_V * (p @ cV + pz)`` (``acc`` already rescaled), the bracket from one MMA
    whose accumulator starts at ``pt``. 2-bit V: the dot runs on ``1 + c / F`` (F per channel
    row), so the bracket is ``F * (dot + pz / F - sum(pw))``; ``pt`` holds the last two terms
    and ``acc`` is kept divided by F (:func:`_store_t` multiplies it back; powers of two,
    exact). 4-bit V: ``pt`` is pz."""
    o = mma_v2(_v_operand_a(va, vb, CQ, VB), pwb, pt)
    return acc + _chan_rows(vcs_run)[:, None] * o


@gluon.jit
def _store_t(acc, inv_l, ws_rows, row_ok, hr, CQ: gl.constexpr, VB: gl.constexpr,
             PAIR: gl.constexpr):  # fmt: skip
    """Chunk ``CQ`` of the output rows; with ``PAIR`` (head pairs, ``decode_mma_pair``) each
    row keeps the 64 virtual channels of its own head ``hr``."""
    mrow = gl.arange(0, 32, layout=_TOK)  # 16 mt + 8 y + g -> channel 16 g + 4 CQ + 2 mt + y
    phys = (mrow & 7) * 16 + 4 * CQ + (mrow >> 4) * 2 + ((mrow >> 3) & 1)
    if VB == 2:
        acc = acc * _v_factors(False)[:, None]
    if PAIR:
        ok = row_ok[None, :] & ((phys >> 6)[:, None] == hr[None, :])
        phys = phys & 63
    else:
        ok = row_ok[None, :] & (phys >= 0)[:, None]
    gl.store(ws_rows[None, :] + phys[:, None], acc * inv_l[None, :], mask=ok)


@gluon.jit
def _issue(sk, sv, skc, skz, skr, svc, svr, svz, uu, u1, bt_row, num_kv_heads, h, dh, rec32_ptr,
           rec16_ptr, REC: gl.constexpr, K_OFF: gl.constexpr, KCS_OFF: gl.constexpr,
           KZP_OFF: gl.constexpr, KRS_OFF: gl.constexpr, V_OFF: gl.constexpr,
           VCS_OFF: gl.constexpr, VRS_OFF: gl.constexpr, VZP_OFF: gl.constexpr,
           VB: gl.constexpr, G: gl.constexpr, PAIR: gl.constexpr,
           KB: gl.constexpr = 4):  # fmt: skip
    """Stage unit ``uu``: one head's record (``decode_mma._issue_stage``, this kernel's
    layout) or, with ``PAIR``, the records of heads ``h`` and ``h + dh``."""
    if PAIR:
        P.issue_stage(sk, sv, skc, skz, skr, svc, svr, svz, uu, u1, bt_row, num_kv_heads, h, dh,
                      rec32_ptr, rec16_ptr, REC, K_OFF, KCS_OFF, KZP_OFF, KRS_OFF, V_OFF,
                      VCS_OFF, VRS_OFF, VZP_OFF, VB, G, KB)  # fmt: skip
    elif KB == 4 and _REC_K and not _SUB:
        _issue_rec(sk, sv, skc, skz, skr, svc, svr, svz, uu, u1, bt_row, num_kv_heads, h,
                   rec32_ptr, rec16_ptr, REC, K_OFF, KCS_OFF, KZP_OFF, KRS_OFF, V_OFF, VCS_OFF,
                   VRS_OFF, VZP_OFF, VB, G)  # fmt: skip
    else:
        M._issue_stage(sk, sv, skc, skz, skr, svc, svr, svz, uu, u1, bt_row, num_kv_heads, h,
                       rec32_ptr, rec16_ptr, REC, K_OFF, KCS_OFF, KZP_OFF, KRS_OFF, V_OFF,
                       VCS_OFF, VRS_OFF, VZP_OFF, VB, G, True, KB)  # fmt: skip


@gluon.jit
def _issue_rec(sk, sv, skc, skz, skr, svc, svr, svz, uu, u1, bt_row, num_kv_heads, h, rec32_ptr,
               rec16_ptr, REC: gl.constexpr, K_OFF: gl.constexpr, KCS_OFF: gl.constexpr,
               KZP_OFF: gl.constexpr, KRS_OFF: gl.constexpr, V_OFF: gl.constexpr,
               VCS_OFF: gl.constexpr, VRS_OFF: gl.constexpr, VZP_OFF: gl.constexpr,
               VB: gl.constexpr, G: gl.constexpr):  # fmt: skip
    """``M._issue_stage`` with the K codes in record order and the row vectors in
    ``decode_mma_rec``'s token order."""
    r32, r16, ok, half = M.unit_record(
        uu, u1, bt_row, num_kv_heads, h, rec32_ptr, rec16_ptr, REC, G
    )
    RK.stage_k(sk, r16, ok, half, K_OFF, G)
    M._stage_words(sk, sv, r32, ok, half, K_OFF, V_OFF, VB, G, 4, False)
    M._stage_kchan(skc, skz, r16, ok, KCS_OFF, KZP_OFF)
    RK.stage_tokens(skr, svr, svz, r16, ok, half, KRS_OFF, VRS_OFF, VZP_OFF)
    g16 = gl.arange(0, 8, layout=gl.SliceLayout(1, M._CP816))
    i16 = gl.arange(0, 16, layout=gl.SliceLayout(0, M._CP816))
    oc = g16[:, None] * 16 + i16[None, :]
    async_copy.async_copy_global_to_shared(svc, r16 + VCS_OFF // 2 + oc, mask=(oc >= 0) & ok)
    async_copy.commit_group()


@gluon.jit
def mma_decode_t_kernel(
    q_ptr,
    rec16_ptr,
    rec32_ptr,
    bt_ptr,
    seq_ptr,
    ws_ptr,
    qk_scale,
    bt_stride,
    num_kv_heads,
    num_q_heads,
    lse_numel,
    T: gl.constexpr,
    GQA: gl.constexpr,
    VB: gl.constexpr,
    REC: gl.constexpr,
    K_OFF: gl.constexpr,
    KCS_OFF: gl.constexpr,
    KZP_OFF: gl.constexpr,
    KRS_OFF: gl.constexpr,
    V_OFF: gl.constexpr,
    VCS_OFF: gl.constexpr,
    VRS_OFF: gl.constexpr,
    VZP_OFF: gl.constexpr,
    S: gl.constexpr,
    MIN_UNITS: gl.constexpr,
    NBUF: gl.constexpr,
    G: gl.constexpr = 64,
    PDL: gl.constexpr = False,
    LAG: gl.constexpr = 0,
    PAIR: gl.constexpr = 0,
    KB: gl.constexpr = 4,
):
    """Same contract as ``decode_mma.mma_decode_kernel`` (T * GQA <= 8, NBUF >= 2), and 2-bit
    K codes with ``KB = 2`` (without ``SUBNORMAL_CODES``). With
    ``PAIR`` the heads have 64 channels (``decode_mma_pair``; ``REC`` and the offsets are
    then the 64-channel record's): at ``PAIR = 2`` program ``(split, b * ceil(Hkv / 2) + j)``
    takes KV heads ``2 j`` and ``2 j + 1`` (T * GQA <= 4), at ``PAIR = 1`` one KV head
    (T * GQA <= 8; the second head's half of each stage zero-filled)."""
    if PDL:
        M.launch_dependents()
    ROWS_MAX: gl.constexpr = 4 if PAIR == 2 else 8
    gl.static_assert(T * GQA <= ROWS_MAX)
    gl.static_assert(NBUF >= 2)
    gl.static_assert(KB == 4 or (KB == 2 and not _SUB))
    QB: gl.constexpr = _as_linear(gl.to_linear_layout(_OPB, [32, 8]))
    split = gl.program_id(0)
    bh = gl.program_id(1)
    if PAIR == 2:
        npairs = (num_kv_heads + 1) // 2
        b = bh // npairs
        h = (bh % npairs) * 2
        dh = gl.minimum(h + 1, num_kv_heads - 1) - h  # 0: the odd head out has no partner
    elif PAIR == 1:
        b = bh // num_kv_heads
        h = bh % num_kv_heads
        dh = h - h  # no second head
    else:
        b = bh // num_kv_heads
        h = bh % num_kv_heads
        dh = 0
    seq_len = gl.load(seq_ptr + b)
    # splits of whole records (the combine's formula); the loop walks their 64-token halves
    n_full = seq_len // G
    if n_full == 0:
        return
    n_splits = gl.maximum(gl.minimum(S, (n_full + MIN_UNITS - 1) // MIN_UNITS), 1)
    per = (n_full + n_splits - 1) // n_splits
    n_live = (n_full + per - 1) // per
    if split >= n_live:
        return
    u0 = split * per * (G // 64)
    u1 = gl.minimum(split * per + per, n_full) * (G // 64)

    # records staged by cp.async NBUF - 1 blocks ahead; the first copies are issued before q
    # is loaded and rotated, which hides their latency
    HV: gl.constexpr = VB // 2
    NH: gl.constexpr = 2 if PAIR else 1  # heads whose token vectors a stage holds
    # record-order 4-bit K codes (decode_mma_rec) with one KV head a program and offset codes
    RK4: gl.constexpr = KB == 4 and PAIR == 0 and _REC_K and not _SUB
    # at most four query rows: column n of every [*, 8] tile is query row n >> 1, and the
    # score MMAs take q's hi part in the even columns and its lo part in the odd ones (one
    # MMA per code operand instead of two; the column pairs summed after)
    FUSED: gl.constexpr = PAIR == 0 and T * GQA <= 4 and not _SUB and _FUSED
    if RK4:
        sk = gl.allocate_shared_memory(gl.float16, [NBUF, 128, 16], RK.SH_K)
    else:
        sk = gl.allocate_shared_memory(gl.int32, [NBUF, 32, 32], _SH2)
    sv = gl.allocate_shared_memory(gl.int32, [NBUF, 16 * HV, 32], _SH2)
    skc = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 32], _SH2)
    skz = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 32], _SH2)
    skr = gl.allocate_shared_memory(gl.float16, [NBUF, 8 * NH, 8], _SH2)
    svc = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 16], _SH2)
    svr = gl.allocate_shared_memory(gl.float16, [NBUF, 8 * NH, 8], _SH2)
    svz = gl.allocate_shared_memory(gl.float16, [NBUF, 8 * NH, 8], _SH2)
    bt_row = bt_ptr + b.to(gl.int64) * bt_stride
    for st in gl.static_range(NBUF - 1):
        _issue(
            sk.index(st),
            sv.index(st),
            skc.index(st),
            skz.index(st),
            skr.index(st),
            svc.index(st),
            svr.index(st),
            svz.index(st),
            u0 + st,
            u1,
            bt_row,
            num_kv_heads,
            h,
            dh,
            rec32_ptr,
            rec16_ptr,
            REC,
            K_OFF,
            KCS_OFF,
            KZP_OFF,
            KRS_OFF,
            V_OFF,
            VCS_OFF,
            VRS_OFF,
            VZP_OFF,
            VB,
            G,
            PAIR,
            KB,
        )

    # q rows [8, 128] (lane 4 n + t: row n, channels 32 t ..), scaled and rotated in fp32
    # (record-order K: physical channel order, lane 4 n + t: channels 2 t + {0, 1} + 8 j)
    if RK4:
        qrot = RK.q_rows(q_ptr, b, h, num_q_heads, qk_scale, T, GQA, FUSED)
        qr0 = RK.q_chunk(qrot, 0, QB)
        qr1 = RK.q_chunk(qrot, 1, QB)
        qr2 = RK.q_chunk(qrot, 2, QB)
        qr3 = RK.q_chunk(qrot, 3, QB)
    else:
        if PAIR:
            qrot = P.q_rows(
                q_ptr, b, h, dh > 0, num_q_heads, qk_scale, T, GQA, gl.constexpr(M._QL8)
            )
        else:
            qrot = M._q_rows(
                q_ptr, b, h, num_q_heads, qk_scale, T, GQA, gl.constexpr(M._QL8), FUSED
            )
        qr0 = _q_chunk(qrot, QB, 0)
        qr1 = _q_chunk(qrot, QB, 1)
        qr2 = _q_chunk(qrot, QB, 2)
        qr3 = _q_chunk(qrot, QB, 3)
    qh0, ql0 = _q_parts(qr0, QB)
    qh1, ql1 = _q_parts(qr1, QB)
    qh2, ql2 = _q_parts(qr2, QB)
    qh3, ql3 = _q_parts(qr3, QB)
    qf0 = None
    qf1 = None
    qf2 = None
    qf3 = None
    lo_cols = None
    if FUSED:
        lo_cols = _odd_cols(QB)
        qf0 = _fused_q(qh0, ql0, lo_cols, QB)
        qf1 = _fused_q(qh1, ql1, lo_cols, QB)
        qf2 = _fused_q(qh2, ql2, lo_cols, QB)
        qf3 = _fused_q(qh3, ql3, lo_cols, QB)

    if PAIR:
        hr, rr = P.row_heads(T, GQA, gl.constexpr(_QR))
        row_ok = (hr == 0) | ((hr == 1) & (dh > 0))
    else:
        rr = gl.arange(0, 8, layout=_QR)
        if FUSED:
            row_ok = (rr < 2 * T * GQA) & ((rr & 1) == 0)  # one column of each pair stores
            rr = rr >> 1
            hr = rr * 0
        else:
            hr = rr * 0
            row_ok = rr < T * GQA
    colb = hr == 1  # columns of the pair's second head
    q_pos = seq_len - (T + LAG) + rr // GQA
    mt = gl.arange(0, 64, layout=_TOK)
    if RK4:
        tok_of_row = RK.tok_of_row(gl.constexpr(_TOK))
    else:
        tok_of_row = (mt & 7) * 8 + (mt >> 4) * 2 + ((mt >> 3) & 1)

    m = gl.full([8], -1.0e30, gl.float32, _QR)
    l = gl.full([8], 0.0, gl.float32, _QR)
    a0 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a1 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a2 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a3 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    for u in range(u0, u1):
        j = u - u0
        nst = (j + NBUF - 1) % NBUF
        gl.thread_barrier()  # every lane is done with the stage about to be overwritten
        _issue(
            sk.index(nst),
            sv.index(nst),
            skc.index(nst),
            skz.index(nst),
            skr.index(nst),
            svc.index(nst),
            svr.index(nst),
            svz.index(nst),
            u + NBUF - 1,
            u1,
            bt_row,
            num_kv_heads,
            h,
            dh,
            rec32_ptr,
            rec16_ptr,
            REC,
            K_OFF,
            KCS_OFF,
            KZP_OFF,
            KRS_OFF,
            V_OFF,
            VCS_OFF,
            VRS_OFF,
            VZP_OFF,
            VB,
            G,
            PAIR,
            KB,
        )
        async_copy.wait_group(NBUF - 1)
        gl.thread_barrier()
        cst = j % NBUF
        ck = sk.index(cst)
        kc = skc.index(cst)
        kz = skz.index(cst)
        qz = gl.full([16, 8], 0.0, gl.float32, _MMA)
        if RK4:
            qs0, qt0, qz = _qs_rec(qz, qh0, ql0, kc, kz, 0, QB, qf0, lo_cols)
            qs1, qt1, qz = _qs_rec(qz, qh1, ql1, kc, kz, 1, QB, qf1, lo_cols)
            qs2, qt2, qz = _qs_rec(qz, qh2, ql2, kc, kz, 2, QB, qf2, lo_cols)
            qs3, qt3, qz = _qs_rec(qz, qh3, ql3, kc, kz, 3, QB, qf3, lo_cols)
        else:
            qs0, qt0, qz = _qs_t(qz, qh0, ql0, M._run8(kc, 0), M._run8(kz, 0), QB, qf0, lo_cols)
            qs1, qt1, qz = _qs_t(qz, qh1, ql1, M._run8(kc, 1), M._run8(kz, 1), QB, qf1, lo_cols)
            qs2, qt2, qz = _qs_t(qz, qh2, ql2, M._run8(kc, 2), M._run8(kz, 2), QB, qf2, lo_cols)
            qs3, qt3, qz = _qs_t(qz, qh3, ql3, M._run8(kc, 3), M._run8(kz, 3), QB, qf3, lo_cols)
        # the score MMAs start from the zero-point term; a token row whose codes run scaled
        # (4-bit: odd nibbles as 16 c; 2-bit: c / F) starts from it scaled alike, and its row
        # scale takes the inverse (exact powers of two)
        qzg = _equal_rows(qz) * _C_IN
        if KB == 2:
            s = _rows_like(qzg, 64) * _k_row_factors(False, KB)[:, None]
        else:
            odd = _rows(_run_consts(gl.constexpr(_RUNG8), 8, 0.0, 1.0, 0.0, 1.0), RK4) > 0.5
            s = gl.where(odd[:, None], _rows_like(16.0 * qzg, 64), _rows_like(qzg, 64))
        # each code operand meets both fp16 parts of qs, or the fused operand that holds both
        s = _score_chunk(ck, 0, qs0, qt0, s, RK4, KB, FUSED)
        s = _score_chunk(ck, 1, qs1, qt1, s, RK4, KB, FUSED)
        s = _score_chunk(ck, 2, qs2, qt2, s, RK4, KB, FUSED)
        s = _score_chunk(ck, 3, qs3, qt3, s, RK4, KB, FUSED)
        if FUSED:
            s = _pair_sum(s, 64)
        if RK4:
            kf = _rows(_run_consts(gl.constexpr(_RUNG8), 8, 1.0, 0.0625, 1.0, 0.0625), RK4)
        else:
            kf = _k_row_factors(True, KB)
        krs = _rows(skr.index(cst).slice(0, 8).load(_RUNG8), RK4) * kf
        if PAIR:
            s = s * P.per_column(colb, krs, _tok_rows(skr.index(cst).slice(8, 8).load(_RUNG8)) * kf)
        else:
            s = s * krs[:, None]
        if T + LAG > 1:
            key = u * 64 + tok_of_row
            s = gl.where(key[:, None] <= q_pos[None, :], s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        a0 = a0 * alpha[None, :]
        a1 = a1 * alpha[None, :]
        a2 = a2 * alpha[None, :]
        a3 = a3 * alpha[None, :]
        p = gl.exp2(s - m_new[None, :])
        m = m_new
        l = l * alpha + gl.sum(p, axis=0)
        vzp = _rows(svz.index(cst).slice(0, 8).load(_RUNG8), RK4)
        vrs = _rows(svr.index(cst).slice(0, 8).load(_RUNG8), RK4)
        if PAIR:
            vzp2 = P.per_column(colb, vzp, _tok_rows(svz.index(cst).slice(8, 8).load(_RUNG8)))
            vrs2 = P.per_column(colb, vrs, _tok_rows(svr.index(cst).slice(8, 8).load(_RUNG8)))
            pz = gl.sum(p * vzp2, axis=0)
            pwb = gl.convert_layout((p * vrs2).to(gl.float16), _OPB)  # the transpose
        elif RK4:  # the weights into the value side's token order on the way (a renaming)
            pz = gl.sum(p * vzp[:, None], axis=0)
            pw = RK.p_for_values((p * vrs[:, None]).to(gl.float16))
            pwb = gl.convert_layout(pw, _OPB)  # the transpose
        else:
            pz = gl.sum(p * vzp[:, None], axis=0)
            pwb = gl.convert_layout((p * vrs[:, None]).to(gl.float16), _OPB)  # the transpose
        if VB == 2 and _SUB:
            pt = pz[None, :] * _v_factors(True)[:, None]
        elif VB == 2:
            spw = mma_v2(
                gl.full([16, 64], 1.0, gl.float16, _OPA),
                pwb,
                gl.full([16, 8], 0.0, gl.float32, _MMA),
            )
            pt = pz[None, :] * _v_factors(True)[:, None] - _rows_like(_equal_rows(spw), 32)
        else:
            pt = gl.full([32, 8], 0.0, gl.float32, _MMA) + pz[None, :]
        RDV: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[16 * HV, 1],
            threads_per_warp=[1, 32],
            warps_per_cta=[1, 1],
            order=[1, 0],
        )
        vt3 = gl.reshape(sv.index(cst).load(RDV), [16, HV, 32])  # [i, h, lane]
        if VB == 4:
            t0, t1 = gl.split(gl.permute(vt3, [0, 2, 1]))
            va0, vb0 = M._v_pairs(M._vw_from_lanes(t0))
            va1, vb1 = M._v_pairs(M._vw_from_lanes(t1))
        else:
            va0, vb0 = M._v_pairs(M._vw_from_lanes(gl.reshape(vt3, [16, 32])))
            va1 = va0
            vb1 = vb0
        vc = svc.index(cst)
        a0 = _values_t(a0, pwb, pt, va0, vb0, vc.slice(0, 4, dim=1).load(_RUNG4), 0, VB)
        a1 = _values_t(a1, pwb, pt, va0, vb0, vc.slice(4, 4, dim=1).load(_RUNG4), 1, VB)
        a2 = _values_t(a2, pwb, pt, va1, vb1, vc.slice(8, 4, dim=1).load(_RUNG4), 2, VB)
        a3 = _values_t(a3, pwb, pt, va1, vb1, vc.slice(12, 4, dim=1).load(_RUNG4), 3, VB)
    async_copy.wait_group(0)

    seen = l > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l, 1.0), 0.0)
    lse = gl.where(seen, m + gl.log2(gl.where(seen, l, 1.0)), float("-inf"))
    q_row = ((b * T + rr // GQA) * num_q_heads + (h + hr) * GQA + rr % GQA).to(gl.int64)
    ws_row = q_row * S + split
    gl.store(ws_ptr + ws_row, lse, mask=row_ok)
    ws_rows = ws_ptr + lse_numel + ws_row * (64 if PAIR else 128)
    _store_t(a0, inv_l, ws_rows, row_ok, hr, 0, VB, PAIR)
    _store_t(a1, inv_l, ws_rows, row_ok, hr, 1, VB, PAIR)
    _store_t(a2, inv_l, ws_rows, row_ok, hr, 2, VB, PAIR)
    _store_t(a3, inv_l, ws_rows, row_ok, hr, 3, VB, PAIR)
