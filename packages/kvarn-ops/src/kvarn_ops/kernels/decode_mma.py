"""Decode main kernel that unpacks codes straight into tensor-core operand registers (Gluon).

The Triton split kernel (``decode.py``) spends most of its time moving every unpacked code
tile through shared memory into the operand layout of the tensor cores (Nsight Compute on the
H200: 65% of its shared-memory wavefronts). This kernel has no such trip: written in Gluon
(Triton's explicit-layout dialect), each thread loads exactly the code words whose codes
belong in its own ``mma.sync.m16n8k16`` operand registers, so every layout conversion is a
renaming of registers (checked at compile time: ``assert_trivial``).

That is possible with the record layout as it is, because attention does not care about the
order of a block's tokens (softmax and the value sum run over all of them) nor about the order
of the channels of a dot product, as long as both sides agree. A thread's B-operand registers of
the score dot hold, for token column ``n = 8 j + w`` of the tile, channels ``16 kt + 2 c + {0, 1,
8, 9}``; mapping column ``n`` to physical token ``8 w + j`` puts all eight nibbles of K word ``w``
(8 consecutive tokens of one channel) in the thread that owns column ``w``. Channels are renamed
so that a thread's 32 channels are 32 consecutive physical channels (one ``[32, 8]`` word tile,
contiguous scale vectors); q is rotated by a fast Walsh-Hadamard transform whose output
layout is that order (:func:`_q_rows`: lane ``4 g + c`` holds channels ``32 c ..``, five
register stages and two ``shfl.bfly`` stages in fp32). The value dot uses the same token order,
and renames output channel ``n = 8 nt + g`` to physical channel ``16 g + nt``, so a thread's
codes come from V word ``g`` of its 16 tokens. The output is written to the workspace in
physical order.

Unpacking (:func:`_nibble_pairs`, :func:`_crumb_pairs`): one ``prmt`` copies a byte of word
``a`` and the same byte of word ``b`` into the two halves of a register, and every code field of
that byte is masked out of it in place by one ``lop3`` into an fp16 mantissa; each result is an
MMA operand register (the asm runs with ``pack=2`` on the joined pair, see :func:`_pair_bits`).
K: 2.5 instructions per operand register, the low nibble as ``c``, the high one as ``16 c``
(its token columns take 16 times the zero-point term and 1/16 of the row scale), each masked
into the mantissa of 1024.0 and the 1024 subtracted in fp16 (exact). Leaving the 1024 in the
operand (1.5 instructions, an MMA column of 1024s taking ``1024 * sum(qs)`` out with the
zero-point term) was faster but not accurate enough on records whose zero-point term nearly
cancels the code term (large channel zero points and row scales, as on tokens with outsized
keys): the fp32 sums then carry 1024 times the operands. For the same records the score
operand ``q_rot * s_col_K`` enters as two fp16 parts ``hi + lo`` (two MMAs on each code
operand): one fp16 operand gave score errors of tens of log2 units on such a record of the
GPU parity suite.
2-bit V: 1.25 instructions per register, fields as ``1 + c / F`` with F = 4, 256, 64, 16 for the
fields at bits 0, 2, 4, 6 (a small offset, so the weights' sum it adds is not 1024 times the
result; a ones column gives that sum; F is kept in the output accumulator and multiplied back
once). 4-bit V keeps ``1024 + c`` with an fp16 subtraction (``sub.f16x2``, :func:`_pair_f16`),
because its weights are all positive and the 1024 offset would cancel badly.

Memory: the next records are copied into shared memory by ``cp.async`` while the current one
is computed (``NBUF >= 2`` stages; 2 is the default: 14.6 KB per program at k4v2), words stored
lane-major so that 32 lanes read 32 consecutive words. (Loading straight from global memory
before each use, with no latency hiding, measured 38.7% of copy bandwidth against 46.3% with the
staging, B=64 32K on the H200; that path is gone.)

2-bit K (:func:`_k2_codes`): a K word holds 16 tokens, so lanes ``w`` and ``w ^ 1`` stage the
same word and a per-lane ``prmt`` selector picks each lane's two bytes; the four fields of a
byte are masked in place into the mantissa of 1.0 and the 1 subtracted (exact ``c / F``, F =
4, 256, 64, 16), 2.25 instructions per operand register; each token column's start value and
row scale carry its ``1 / F`` and ``F``.

Scope: 4- or 2-bit K, 2- or 4-bit V, 64- or 128-token blocks (a 128-token record is read as two
64-token halves: its K words of a channel are consecutive, V rows are tokens; splits are of
whole records, as in the combine's formula), head_dim 128, at most 16 query rows per KV head
(T * GQA), one warp per program; up to 8 rows take ``decode_mma_t.py`` (rows in the MMA's N
dimension), which reuses this file's loads and unpack, and at head_dim 64 takes two KV heads
per program as one 128-channel head (``decode_mma_pair.py``: at most 4 rows a head; up to 8
rows, one head a program); at head_dim 256 ``decode_mma_d256.py`` reads each block as two
128-channel halves. All read
full blocks only; the exact
tail is folded in by the combine kernel (``decode._decode_combine_kernel`` with
``TAIL=True``). Everything else uses the Triton split kernel. Gluon kernels do not run under
the Triton interpreter: on the CPU the offline-compile tests build these kernels for sm_90a
and sm_120a (and check that they have no shared-memory stores of codes, no layout shuffles and
the expected MMA count), the interpreter tests check the combine's tail path through the Triton
kernel, and ``gpu/parity.py`` compares the whole decode with the reference on the GPU.

Numerics: q is scaled and rotated in fp32 (the Triton kernel rounds the scaled q to fp16
before its rotation); the score operand is ``fp16(q_rot * s_col_K)``, the value operand
``fp16(p * s_row_V)``; zero-point terms, softmax and the running accumulators are fp32.
"""

from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

__all__ = ["MMA_DECODE_D", "MMA_DECODE_GROUPS", "mma_decode_supported", "mma_decode_kernel"]

MMA_DECODE_D = 128
MMA_DECODE_GROUPS = (64, 128)

SUBNORMAL_CODES = os.environ.get("KVARN_DECODE_SUBNORMAL", "0") == "1"
"""Opt-in (``KVARN_DECODE_SUBNORMAL=1``, read at import), off by default: the dense MMA kernels'
4-bit K and 2-bit V codes as fp16 subnormals ``c * 2^-24`` (:func:`_nibble_pairs`,
:func:`_crumb_pairs`), which need no offset subtracted and no MMA for the sum of the softmax
weights; the products come out ``2^-24`` times the codes' and are scaled back once per block.
About 11% fewer instructions per block of the transposed kernel and 3-5% faster on the H200,
GPU parity of dense decode passing, but not exact: the same operands in the MLA kernel raised
its error on ill-conditioned latent records from 1.8e-3 to 6.1-7.5e-3 (three seeds, against
an allowance of 5.9e-3): the tensor cores do not take every product with these operands
exactly. Isolated since on an H100 (BENCHMARKS.md "2026-12-07, night"): it is the code
operand itself, whatever its partner. With codes ``c * 2^-24`` (mantissa bits 0-3) the
``mma.sync`` and ``wgmma`` sums of 128 products reach relative errors of 1.3-1.5e-6 against
normal operands' 2.2-4.4e-7 on O(1) partners (6.0-6.5e-6 against 4.7-7.3e-7 on partners
spanning 2^-26 .. 2^4); the loss halves with each bit the field moves up and is gone from
``c * 2^-20``. Codes
at ``c * 2^-20`` in the record-order K path (three shifts and four masks per four operand
registers instead of a shift, four masks and four subtractions; 56 fewer instructions a
block) were measured no faster, from HBM or from L2, so the codes stay in the mantissas of
1024 and 1.0."""
_SUB: gl.constexpr = gl.constexpr(SUBNORMAL_CODES)
_C_IN: gl.constexpr = gl.constexpr(2.0**-24 if SUBNORMAL_CODES else 1.0)
"""What the code operands carry per unit (the zero-point starts of the score sums take it)."""
_C_OUT: gl.constexpr = gl.constexpr(2.0**24 if SUBNORMAL_CODES else 1.0)
"""Its inverse, folded into the scales applied to the products."""

# one warp: m16n8k16 fragments of fp16 operands (two per 32-bit register)
_MMA: gl.constexpr = gl.NVMMADistributedLayout(
    version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
)
_OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2)
_OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2)
_ROWS: gl.constexpr = gl.SliceLayout(1, _MMA)
_COLS: gl.constexpr = gl.SliceLayout(0, _MMA)
# K words of a 32-channel chunk [8 * c + i, w] (channel 32 c + 8 * chunk + i, word w) and their
# 8 nibbles: lane (g, c) = (lane // 4, lane % 4) holds word g of its 8 channels
_K3: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[8, 1, 8], threads_per_warp=[4, 8, 1], warps_per_cta=[1, 1, 1], order=[2, 0, 1]
)
_KW: gl.constexpr = gl.SliceLayout(2, _K3)
# V words [token 16 c + i, word g] and 4 fields of each
_V3: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[16, 1, 4], threads_per_warp=[4, 8, 1], warps_per_cta=[1, 1, 1], order=[2, 0, 1]
)
_VW: gl.constexpr = gl.SliceLayout(2, _V3)
# 1-D vectors loaded as contiguous runs per lane (lane % 4 picks the run)
# scale vectors as [lane % 4, run] tiles: each lane loads one contiguous run (16-byte loads)
_RUN8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]],
    lane_bases=[[1, 0], [2, 0], [0, 0], [0, 0], [0, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[4, 8],
)
_RUN16: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]],
    lane_bases=[[1, 0], [2, 0], [0, 0], [0, 0], [0, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[4, 16],
)
_RUN4: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0]],
    lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[4, 2, 4],
)


# shared-memory staging of a block (cp.async): words stored lane-major, so that the
# read of one register's word by the 32 lanes touches 32 consecutive words (no bank conflict)
_SH2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
_CPK: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[32, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1], order=[1, 0]
)
_RDK: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[8, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1], order=[1, 0]
)
_SH3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
_CP88: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[8, 4], warps_per_cta=[1, 1], order=[1, 0]
)
_CP816: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[8, 4], warps_per_cta=[1, 1], order=[1, 0]
)
# scale-vector copies: 16-byte runs, [4, 32] / [4, 16] / [4, 2, 16] fp16 (lanes beyond a
# vector's 8-element runs repeat a copy of the same bytes)
_CP32: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[1, 1], order=[1, 0]
)
_CP16: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[1, 1], order=[1, 0]
)
_CPV16: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 1, 8], threads_per_warp=[4, 2, 4], warps_per_cta=[1, 1, 1], order=[2, 1, 0]
)


def mma_decode_supported(k_bits: int, v_bits: int, block_size: int, head_dim: int, rows: int):
    """Whether a geometry takes an MMA kernel (on a GPU with mma.sync, i.e. sm_80 and newer):
    this one or ``decode_mma_t`` at head_dim 128, ``decode_mma_t`` at head_dim 64 with up to 8
    rows (``decode_mma_pair``: two KV heads a program up to 4 rows each, else one), or
    ``decode_mma_d256`` at head_dim 256 with up to 8 rows; 4-bit or 2-bit K codes (2-bit
    not with ``SUBNORMAL_CODES``)."""
    if k_bits not in (2, 4) or v_bits not in (2, 4) or block_size not in MMA_DECODE_GROUPS:
        return False
    if k_bits == 2 and SUBNORMAL_CODES:  # 2-bit K codes in normal fp16 only
        return False
    if head_dim == MMA_DECODE_D:
        return rows <= 16
    return head_dim in (MMA_DECODE_D // 2, 2 * MMA_DECODE_D) and 1 <= rows <= 8


@gluon.jit
def launch_dependents():
    """``griddepcontrol.launch_dependents`` (sm_90+): the combine kernel, launched as this grid's
    programmatic dependent, may start once every program of this grid has executed it; the
    combine still waits (``griddepcontrol.wait``) for this grid's memory before it reads the
    partial rows."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; mov.b32 $0, 0;",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _chan_from_run(v):
    """[4, 8] run tile (channel 32 c + 8 CQ + i at [c, i]) -> logical chunk order [32]."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [2, 2, 2, 2, 2]), [2, 3, 0, 1, 4])
    return gl.convert_layout(gl.reshape(v, [32]), _COLS, assert_trivial=True)


@gluon.jit
def _vchan_from_run(v):
    """[4, 2, 4] run tile (channel 32 c + 16 x + 4 CQ + nt) -> logical chunk order [32]."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [2, 2, 2, 2, 2]), [3, 4, 0, 1, 2])
    return gl.convert_layout(gl.reshape(v, [32]), _COLS, assert_trivial=True)


@gluon.jit
def _tok_from_run(v):
    """[4, 16] run tile (token 16 c + 8 x + nt) -> logical token order [64]."""
    v = gl.permute(gl.reshape(v.to(gl.float32), [2, 2, 2, 2, 2, 2]), [3, 4, 5, 0, 1, 2])
    return gl.convert_layout(gl.reshape(v, [64]), _COLS, assert_trivial=True)


@gluon.jit
def _kw_from_lanes(t):
    """[8 i, 32 lanes] words as staged (lane = c + 4 w holds row 32 c + 8 CQ + i, word w)
    -> [8 c + i, w] in the K word layout."""
    t = gl.permute(gl.reshape(t, [8, 8, 4]), [2, 0, 1])
    return gl.convert_layout(gl.reshape(t, [32, 8]), _KW, assert_trivial=True)


@gluon.jit
def _vw_from_lanes(t):
    """[16 i, 32 lanes] words as staged (lane = c + 4 g holds token 16 c + i, word g)
    -> [16 c + i, g] in the V word layout."""
    t = gl.permute(gl.reshape(t, [16, 8, 4]), [2, 0, 1])
    return gl.convert_layout(gl.reshape(t, [64, 8]), _VW, assert_trivial=True)


@gluon.jit
def _pair_f16(a, b, BYTE: gl.constexpr, MASK: gl.constexpr):
    """Two codes as exact fp16 values in one 32-bit register: the field at the bottom of byte
    ``BYTE`` of word ``a`` (low half) and of word ``b`` (high half). One ``prmt`` brings both
    bytes together, one ``lop3`` masks them into the mantissas of fp16 1024.0 (0x6400) and one
    ``sub.f16x2`` removes the 1024 (exact): three instructions per two codes."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 4) << 8) | ((BYTE + 4) << 12)
    M2: gl.constexpr = MASK | (MASK << 16)
    return gl.inline_asm_elementwise(
        f"{{ .reg .b32 t, o; prmt.b32 t, $2, $3, {SEL}; "
        f"lop3.b32 t, t, {M2}, 1677747200, 0xea; mov.b32 o, 1677747200; "
        f"sub.f16x2 t, t, o; mov.b32 {{$0, $1}}, t; }}",
        "=h,=h,r,r",
        [a, b],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )


@gluon.constexpr_function
def _last_dim_first(ll):
    """The linear layout ``ll`` with the register basis of its last (size-2) dimension moved
    to register bit 0: the same data in the same lanes, registers renamed."""
    unit = [0] * (len(ll.shape) - 1) + [1]
    regs = [list(b) for b in ll.reg_bases]
    regs.remove(unit)
    return gl.DistributedLinearLayout(
        reg_bases=[unit] + regs,
        lane_bases=ll.lane_bases,
        warp_bases=ll.warp_bases,
        block_bases=ll.block_bases,
        shape=ll.shape,
    )


@gluon.jit
def _pair_bits(
    a, b, BYTE: gl.constexpr, M2: gl.constexpr, OR2: gl.constexpr, SUB: gl.constexpr = 0
):
    """``prmt`` + ``lop3``: byte ``BYTE`` of ``a`` (low half) and of ``b`` (high half), each
    copied into both bytes of its half, masked with ``M2`` and or-ed with ``OR2``: two fp16
    values that carry two codes, in two instructions, returned as ``[..., 2]``; with ``SUB``
    (two fp16 bit patterns) one ``sub.f16x2`` of it follows. The asm runs with ``pack=2`` on
    ``join(a, b)`` laid out with the joined axis in register bit 0, so each call gets ``a`` and
    ``b`` of one element and returns the pair in one 32-bit register (the MMA operand
    register: no move, no repacking)."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 4) << 8) | ((BYTE + 4) << 12)
    ab = gl.join(a, b)
    ab = gl.convert_layout(
        ab, _last_dim_first(gl.to_linear_layout(ab.type.layout, ab.shape)), assert_trivial=True
    )
    if SUB == 0:
        asm: gl.constexpr = (
            f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {SEL}; lop3.b32 $0, t, {M2}, {OR2}, 0xea; }}"
        )
    else:
        asm: gl.constexpr = (  # type: ignore[no-redef]  # one of two constexpr branches
            f"{{ .reg .b32 t, o; prmt.b32 t, $1, $2, {SEL}; lop3.b32 t, t, {M2}, {OR2}, 0xea; "
            f"mov.b32 o, {SUB}; sub.f16x2 $0, t, o; }}"
        )
    return gl.inline_asm_elementwise(
        asm,
        "=r,r,r",
        [ab],
        dtype=gl.float16,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _joined(a, b):
    """``join(a, b)`` with the joined axis in register bit 0 (see :func:`_pair_bits`)."""
    ab = gl.join(a, b)
    return gl.convert_layout(
        ab, _last_dim_first(gl.to_linear_layout(ab.type.layout, ab.shape)), assert_trivial=True
    )


@gluon.jit
def _nibble_pairs(a, b, BYTE: gl.constexpr, SUBNORMAL: gl.constexpr = False):
    """Both 4-bit codes of byte ``BYTE`` of words ``a`` (low halves) and ``b`` (high halves)
    from one ``prmt``: ``c`` for the low nibble and ``16 c`` for the high one (exact fp16),
    one ``lop3`` each into the mantissas of 1024.0 and one ``sub.f16x2`` each that takes the
    1024 out (2.5 instructions per operand register; without the subtraction the score sums
    carry 1024 times the operands, whose fp32 rounding does not cancel: measured offline on a
    GPU parity record with row scales near 300, 1.9 log2 units of score error).

    ``SUBNORMAL``: the fields are only masked, with a zero exponent: the fp16 subnormals
    ``c * 2^-24`` and ``16 c * 2^-24``, exact and without an offset (1.5 instructions per
    operand register). The caller's products are then ``2^-24`` times the codes' (scale the
    accumulator's start by ``2^-24`` and its result by ``2^24``: exact in fp32)."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 4) << 8) | ((BYTE + 4) << 12)
    if SUBNORMAL:
        return gl.inline_asm_elementwise(
            f"{{ .reg .b32 t; prmt.b32 t, $2, $3, {SEL}; "
            "and.b32 $0, t, 983055; "  # 0x000F000F
            "and.b32 $1, t, 15728880; }",  # 0x00F000F0
            "=r,=r,r,r",
            [_joined(a, b)],
            dtype=(gl.float16, gl.float16),
            is_pure=True,
            pack=2,
        )
    return gl.inline_asm_elementwise(
        f"{{ .reg .b32 t, o, x, y; prmt.b32 t, $2, $3, {SEL}; mov.b32 o, 1677747200; "
        "lop3.b32 x, t, 983055, 1677747200, 0xea; "  # 0x000F000F, 0x64006400
        "lop3.b32 y, t, 15728880, 1677747200, 0xea; "  # 0x00F000F0
        "sub.f16x2 $0, x, o; sub.f16x2 $1, y, o; }",
        "=r,=r,r,r",
        [_joined(a, b)],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


CRUMB_FACTORS = (4.0, 256.0, 64.0, 16.0)
"""F of :func:`_crumb_pairs`' fields at bits 0, 2, 4, 6 (each field decodes as ``1 + c / F``)."""


@gluon.constexpr_function
def _crumb_factor(field, inverse, subnormal=False):
    """``F`` (or ``1 / F``) of 2-bit field ``field``, exact (powers of two). ``subnormal``:
    the factor of :func:`_crumb_pairs`' subnormal fields instead, ``F = 2^24 / 4^field`` (field
    ``f`` decodes as ``c / F``)."""
    i = int(getattr(field, "value", field))
    f = 2.0 ** (24 - 2 * i) if getattr(subnormal, "value", subnormal) else CRUMB_FACTORS[i]
    return 1.0 / f if getattr(inverse, "value", inverse) else f


@gluon.jit
def _crumb_pairs(a, b, BYTE: gl.constexpr, SUBNORMAL: gl.constexpr = False):
    """The four 2-bit codes of byte ``BYTE`` of words ``a`` and ``b`` from one ``prmt`` (the
    byte copied into both bytes of its half) and one ``lop3`` each: fp16 ``1 + c / F`` with
    ``F`` = 4, 256, 64, 16 for the fields at bits 0, 2, 4, 6 (field 0 from the copy's high
    byte, the others in place), no shifts. ``SUBNORMAL``: every field masked in place with a
    zero exponent, the fp16 subnormals ``c 4^f 2^-24`` (``c / F`` with ``F = 2^24 / 4^f``), so
    no ``1`` to take out of the sums."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 4) << 8) | ((BYTE + 4) << 12)
    # field 0's mask (0x00030003 in place, or 0x03000300 from the copy's high byte) and the
    # exponent or-ed in (none, or that of 1.0: 0x3C003C00)
    M0: gl.constexpr = 196611 if SUBNORMAL else 50332416
    E: gl.constexpr = 0 if SUBNORMAL else 1006648320
    return gl.inline_asm_elementwise(
        f"{{ .reg .b32 t; prmt.b32 t, $4, $5, {SEL}; "
        f"lop3.b32 $0, t, {M0}, {E}, 0xea; "
        f"lop3.b32 $1, t, 786444, {E}, 0xea; "  # 0x000C000C
        f"lop3.b32 $2, t, 3145776, {E}, 0xea; "  # 0x00300030
        f"lop3.b32 $3, t, 12583104, {E}, 0xea; }}",  # 0x00C000C0
        "=r,=r,=r,=r,r,r",
        [_joined(a, b)],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


# q as [R query rows, 128 channels] (R = 8 or 16): lane 4 g + t holds rows g (and g + 8),
# channels 32 t .. 32 t + 31, which are the channels of the score operand's lane t in every
# 32-channel chunk of both MMA kernels (see their q chunk functions)
_QL8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 128],
)
_QL16: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[16, 128],
)


@gluon.jit
def _butterfly_regs(x, B: gl.constexpr, QL: gl.constexpr):
    """One Walsh-Hadamard stage on channel bit ``B`` (< 5, a register bit of ``QL``)."""
    R: gl.constexpr = x.shape[0]
    x = gl.reshape(x, [R, 4, 32 >> (B + 1), 2, 1 << B])
    a, b = gl.split(gl.permute(x, [0, 1, 2, 4, 3]))
    y = gl.permute(gl.join(a + b, a - b), [0, 1, 2, 4, 3])
    return gl.convert_layout(gl.reshape(y, [R, 128]), QL, assert_trivial=True)


@gluon.jit
def _butterfly_lanes(x, sign, MASK: gl.constexpr):
    """One Walsh-Hadamard stage on channel bit 5 or 6 (lane bit ``MASK`` = 1 or 2): the
    partner's value comes by ``shfl.bfly``; ``sign`` is -1 where the bit is set."""
    return gl.inline_asm_elementwise(
        f"{{ .reg .f32 p; shfl.sync.bfly.b32 p, $1, {MASK}, 31, -1; fma.rn.f32 $0, $2, $1, p; }}",
        "=f,f,f",
        [x, sign],
        dtype=gl.float32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _q_rotated(q, QL: gl.constexpr):
    """``q @ H_128 / sqrt(128)`` of ``q`` [R, 128] in ``QL``, fp32, by a fast Walsh-Hadamard
    transform: five register stages and two ``shfl`` stages, about 300 instructions per lane
    at R = 8 (the sign matrix of an MMA rotation took about 2,000)."""
    R: gl.constexpr = q.shape[0]
    ch = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    s5 = gl.full([R, 128], 1.0, gl.float32, QL) - 2.0 * ((ch >> 5) & 1).to(gl.float32)[None, :]
    s6 = gl.full([R, 128], 1.0, gl.float32, QL) - 2.0 * ((ch >> 6) & 1).to(gl.float32)[None, :]
    x = _butterfly_regs(q, 0, QL)
    x = _butterfly_regs(x, 1, QL)
    x = _butterfly_regs(x, 2, QL)
    x = _butterfly_regs(x, 3, QL)
    x = _butterfly_regs(x, 4, QL)
    x = _butterfly_lanes(x, s5, 1)
    return _butterfly_lanes(x, s6, 2) * 0.08838834764831845  # 1 / sqrt(128)


@gluon.jit
def _q_rows(
    q_ptr, b, h, num_q_heads, qk_scale, T: gl.constexpr, GQA: gl.constexpr, QL: gl.constexpr,
    PAIRED: gl.constexpr = False,
):  # fmt: skip
    """Query rows ``r = t * GQA + g`` (token ``t`` of request ``b``, head ``h * GQA + g``) as
    [R, 128] in ``QL``, scaled by ``qk_scale`` and rotated, fp32 (rows past T * GQA are 0);
    with ``PAIRED`` row ``n`` holds query row ``n >> 1``."""
    R: gl.constexpr = QL.shape[0]
    rq = gl.arange(0, R, layout=gl.SliceLayout(1, QL))
    if PAIRED:
        rq = rq >> 1
    cq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    ok = rq < T * GQA
    qrow = ((b * T + rq // GQA) * num_q_heads + h * GQA + rq % GQA).to(gl.int64)
    q = gl.load(q_ptr + qrow[:, None] * 128 + cq[None, :], mask=ok[:, None], other=0.0)
    return _q_rotated(q.to(gl.float32) * qk_scale, QL)


@gluon.jit
def _stack8(c0, c1, c2, c3, c4, c5, c6, c7):
    """[..., 8] with ``c_j`` at index j of the new last axis (kept in registers)."""
    x = gl.join(
        gl.join(gl.join(c0, c4), gl.join(c2, c6)), gl.join(gl.join(c1, c5), gl.join(c3, c7))
    )
    return gl.reshape(x, x.shape[:-3] + [8])


@gluon.jit
def _stack4(c0, c1, c2, c3):
    x = gl.join(gl.join(c0, c2), gl.join(c1, c3))
    return gl.reshape(x, x.shape[:-2] + [4])


@gluon.jit
def _k_nib(ka, kb, ka4, kb4, J: gl.constexpr):
    # fp16 code, exact: masked into the mantissa of 1024.0 (0x6400 | code), 1024 subtracted
    # (the MLA kernel's; it keeps these operands whatever SUBNORMAL_CODES says)
    if J % 2 == 0:
        r = _pair_bits(ka, kb, J // 2, 0x000F000F, 0x64006400, 0x64006400)
    else:
        r = _pair_bits(ka4, kb4, J // 2, 0x000F000F, 0x64006400, 0x64006400)
    return r


@gluon.constexpr_function
def _lead_shape(shape, tail):
    """``shape`` without its last two dims, then ``tail`` (leading batch dims kept)."""
    return [int(getattr(d, "value", d)) for d in shape[:-2]] + list(tail)


@gluon.constexpr_function
def _lead_perm(shape, order):
    """The permutation ``order`` of the dims after ``shape``'s leading ones (all but its last
    two), the leading dims kept in place."""
    n = len(shape) - 2
    return list(range(n)) + [n + int(o) for o in order]


@gluon.jit
def _k_codes(kw):
    """B operand values [..., 32 channels (logical chunk), 64 tokens (logical)] of 4-bit K
    codes from the chunk's words ``kw`` [..., 8 c + i, w] (leading dims, such as the MLA
    kernel's warp axis, are kept), in registers already placed as the dot operand holds them:
    the caller converts to its operand layout with ``assert_trivial``."""
    # channel pairs (i, i + 1) of one lane: even and odd rows
    ka, kb = gl.split(
        gl.permute(
            gl.reshape(kw, _lead_shape(kw.shape, [16, 2, 8])), _lead_perm(kw.shape, [0, 2, 1]).value
        )
    )
    ka4 = ka >> 4
    kb4 = kb >> 4
    c = _stack8(
        _k_nib(ka, kb, ka4, kb4, 0),
        _k_nib(ka, kb, ka4, kb4, 1),
        _k_nib(ka, kb, ka4, kb4, 2),
        _k_nib(ka, kb, ka4, kb4, 3),
        _k_nib(ka, kb, ka4, kb4, 4),
        _k_nib(ka, kb, ka4, kb4, 5),
        _k_nib(ka, kb, ka4, kb4, 6),
        _k_nib(ka, kb, ka4, kb4, 7),
    )  # [..., (8 c + i) // 2, w, x, j]
    # i = 4 kt0 + 2 z + x; logical channel 16 kt0 + 8 z + 2 c + x; logical token 8 j + w
    c = gl.permute(
        gl.reshape(c, _lead_shape(kw.shape, [2, 2, 2, 2, 8, 2, 8])),
        _lead_perm(kw.shape, [2, 3, 0, 1, 5, 6, 4]).value,
    )
    return gl.reshape(c, _lead_shape(kw.shape, [32, 64]))


@gluon.jit
def _v_pairs(vw):
    """V words [16 c + i, g] as token pairs (i, i + 8) of one lane: ([4, 8, 8], [4, 8, 8])."""
    return gl.split(gl.permute(gl.reshape(vw, [4, 2, 8, 8]), [0, 2, 3, 1]))


@gluon.jit
def _v_field(va, vb, SH: gl.constexpr, BYTE: gl.constexpr, VB: gl.constexpr):
    if VB == 2:
        # fp16 1 + code / 4 (0x3C00 | code << 8): the 1 leaves through a ones column
        r = _pair_bits(va >> SH, vb >> SH, BYTE, 0x03000300, 0x3C003C00)
    else:
        lo, hi = _pair_f16(va >> SH, vb >> SH, BYTE, (1 << VB) - 1)
        r = gl.join(lo, hi)
    return r


@gluon.jit
def _v_operand(va, vb, CQ: gl.constexpr, VB: gl.constexpr):
    """B operand [64 tokens (logical), 32 channels (logical chunk CQ)] from the token pairs of
    the V words that hold this chunk (field f of word g: channel 16 g + 4 CQ + f)."""
    BIT0: gl.constexpr = (4 * CQ * VB) % 32
    c = _stack4(
        _v_field(va, vb, (BIT0 + 0 * VB) % 8, (BIT0 + 0 * VB) // 8, VB),
        _v_field(va, vb, (BIT0 + 1 * VB) % 8, (BIT0 + 1 * VB) // 8, VB),
        _v_field(va, vb, (BIT0 + 2 * VB) % 8, (BIT0 + 2 * VB) // 8, VB),
        _v_field(va, vb, (BIT0 + 3 * VB) % 8, (BIT0 + 3 * VB) // 8, VB),
    )  # [c, i', g, x, f] with token 16 c + 8 x + i', i' = 2 kt + y
    # logical token 16 kt + 8 y + 2 c + x; logical channel 8 f + g
    c = gl.permute(gl.reshape(c, [2, 2, 2, 2, 2, 8, 2, 4]), [2, 3, 4, 0, 1, 6, 7, 5])
    return gl.convert_layout(gl.reshape(c, [64, 32]), _OPB, assert_trivial=True)


@gluon.jit
def _q_chunk_parts(qrot, CQ: gl.constexpr):
    """The channels of 32-channel chunk ``CQ`` of rotated q rows [R, 128] (:func:`_q_rows`) as
    [R, c, kt0, z, x]: physical channel ``32 c + 8 CQ + 4 kt0 + 2 z + x`` (register selections
    only). Both MMA kernels use logical channel ``32 CQ + 16 kt0 + 8 z + 2 c + x`` for it."""
    R: gl.constexpr = qrot.shape[0]
    x = gl.reshape(qrot, [R, 4, 2, 2, 2, 2, 2])  # r c cq1 cq0 kt0 z x
    x = gl.permute(x, [0, 1, 4, 5, 6, 2, 3])  # r c kt0 z x cq1 cq0
    a, b = gl.split(x)
    x = b if CQ % 2 == 1 else a
    a, b = gl.split(x)
    return b if CQ // 2 == 1 else a


@gluon.jit
def _q_chunk_rows(qrot, CQ: gl.constexpr):
    """Chunk ``CQ`` of the rotated q rows [16, 128] as [16, 32] (logical channel order) in the
    MMA accumulator layout."""
    x = gl.permute(_q_chunk_parts(qrot, CQ), [0, 2, 3, 1, 4])  # m kt0 z c x
    return gl.convert_layout(gl.reshape(x, [16, 32]), _MMA, assert_trivial=True)


K2_SEL_BYTE0 = gl.constexpr(0x4400)
"""``prmt`` selector of byte 0 of both words, each copied into both bytes of its half."""
K2_SEL_BYTE = gl.constexpr(0x1111)
"""Selector step from one byte to the next."""
K2_SEL_ODD_LANE = gl.constexpr(0x2222)
"""Added for the lanes whose tokens are the high half of their words (``w`` odd)."""


@gluon.constexpr_function
def k2_crumbs_asm():
    """PTX of :func:`_crumbs_exact`: ``$4`` / ``$5`` the words of two channels, ``$6`` the
    ``prmt`` selector (``$7`` its copy, unused); ``$0 .. $3`` the fp16 pairs of fields 0-3."""
    return (
        "{ .reg .b32 t, o, x, y, z, w; prmt.b32 t, $4, $5, $6; mov.b32 o, 0x3C003C00; "
        "lop3.b32 x, t, 0x03000300, o, 0xea; "  # field 0, from the copy's high byte
        "lop3.b32 y, t, 0x000C000C, o, 0xea; "
        "lop3.b32 z, t, 0x00300030, o, 0xea; "
        "lop3.b32 w, t, 0x00C000C0, o, 0xea; "
        "sub.f16x2 $0, x, o; sub.f16x2 $1, y, o; sub.f16x2 $2, z, o; sub.f16x2 $3, w, o; }"
    )


@gluon.jit
def _crumbs_exact(a, b, sel):
    """The four 2-bit codes of one byte of words ``a`` and ``b`` (byte ``B`` of both, copied
    into both bytes of each half by the ``prmt`` selector ``K2_SEL_BYTE0 + B * K2_SEL_BYTE``,
    i.e. ``B | B << 4 | (B + 4) << 8 | (B + 4) << 12``) as exact fp16 ``c / F`` (F = 4, 256,
    64, 16 for the fields at bits 0, 2, 4, 6): :func:`_crumb_pairs`'s ``1 + c / F`` with the
    1 taken out in fp16 (exact), so the score sums carry no offset (2.25 instructions per
    operand register)."""
    return gl.inline_asm_elementwise(
        k2_crumbs_asm(),
        "=r,=r,=r,=r,r,r,r,r",
        [_joined(a, b), _joined(sel, sel)],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _k2_codes(kw):
    """The 2-bit K codes of staged words ``kw`` [8 c + i, w] (``_KW``; each word holds 16
    tokens of one channel, staged for lanes ``w`` and ``w ^ 1`` alike, see
    :func:`_stage_words`) as :func:`_k_operand_pairs` has the 4-bit ones: [(8 c + i) // 2, w,
    x, j], token ``8 w + j`` of channel ``8 c + 2 ((8 c + i) // 2 % 4) + x``, exact fp16 ``c /
    F_(j % 4)`` (:func:`_crumbs_exact`). Lane ``w``'s tokens are bytes ``2 (w % 2)`` and ``2
    (w % 2) + 1`` of its word: the ``prmt`` selector (per lane, a constant) picks them, and
    field ``j % 4`` of byte ``j // 4`` is token ``j``, the 4-bit codes' token order."""
    w = gl.arange(0, 8, layout=gl.SliceLayout(0, _KW))
    sel = gl.full([32, 8], K2_SEL_BYTE0, gl.int32, _KW) + ((w & 1) * K2_SEL_ODD_LANE)[None, :]
    ka, kb = gl.split(gl.permute(gl.reshape(kw, [16, 2, 8]), [0, 2, 1]))
    s0, _ = gl.split(gl.permute(gl.reshape(sel, [16, 2, 8]), [0, 2, 1]))  # equal halves
    c0, c1, c2, c3 = _crumbs_exact(ka, kb, s0)
    c4, c5, c6, c7 = _crumbs_exact(ka, kb, s0 + K2_SEL_BYTE)
    return _stack8(c0, c1, c2, c3, c4, c5, c6, c7)


@gluon.jit
def _k_operand_pairs(kw, KB: gl.constexpr = 4):
    """B operand [32 channels, 64 tokens] of 4-bit K codes in the order of :func:`_k_codes`,
    unpacked by :func:`_nibble_pairs`: token columns of odd nibbles (odd ``n // 8``) hold
    ``16 c``, the others ``c``. 2-bit K (``KB = 2``, :func:`_k2_codes`): column ``n`` holds
    ``c / F_(n // 8 % 4)``."""
    if KB == 2:
        c = _k2_codes(kw)
    else:
        ka, kb = gl.split(gl.permute(gl.reshape(kw, [16, 2, 8]), [0, 2, 1]))
        n0, n1 = _nibble_pairs(ka, kb, 0, _SUB)
        n2, n3 = _nibble_pairs(ka, kb, 1, _SUB)
        n4, n5 = _nibble_pairs(ka, kb, 2, _SUB)
        n6, n7 = _nibble_pairs(ka, kb, 3, _SUB)
        c = _stack8(n0, n1, n2, n3, n4, n5, n6, n7)  # [(8 c + i) // 2, w, x, j]
    c = gl.permute(gl.reshape(c, [2, 2, 2, 2, 8, 2, 8]), [2, 3, 0, 1, 5, 6, 4])
    return gl.convert_layout(gl.reshape(c, [32, 64]), _OPB, assert_trivial=True)


@gluon.jit
def _v_operand_pairs(va, vb, CQ: gl.constexpr, VB: gl.constexpr):
    """:func:`_v_operand` with 2-bit fields from :func:`_crumb_pairs` (column ``8 f + g``
    holds ``1 + c / F_f``, F = 4, 256, 64, 16); 4-bit V as there."""
    if VB == 2:
        f0, f1, f2, f3 = _crumb_pairs(va, vb, CQ, _SUB)
        c = _stack4(f0, f1, f2, f3)
        c = gl.permute(gl.reshape(c, [2, 2, 2, 2, 2, 8, 2, 4]), [2, 3, 4, 0, 1, 6, 7, 5])
        r = gl.convert_layout(gl.reshape(c, [64, 32]), _OPB, assert_trivial=True)
    else:
        r = _v_operand(va, vb, CQ, VB)
    return r


@gluon.jit
def _odd_nibble_cols():
    """[64] in ``_COLS``: True for the token columns of odd nibbles (a constant per register:
    the nibble index is the run index of ``_RUN16``)."""
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, _RUN16))
    run = gl.full([4, 16], 0.0, gl.float32, _RUN16) + (i & 1).to(gl.float32)[None, :]
    return _tok_from_run(run) > 0.5


@gluon.jit
def _k2_factor_cols(INVERSE: gl.constexpr):
    """[64] in ``_COLS``: the 2-bit K field factor F (or 1 / F) of each token column (the
    field is the run index of ``_RUN16`` modulo 4: constants)."""
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, _RUN16)) % 4
    c = gl.where(
        i == 0,
        _crumb_factor(0, INVERSE),
        gl.where(
            i == 1,
            _crumb_factor(1, INVERSE),
            gl.where(i == 2, _crumb_factor(2, INVERSE), _crumb_factor(3, INVERSE)),
        ),
    )
    return _tok_from_run(gl.full([4, 16], 0.0, gl.float32, _RUN16) + c[None, :])


@gluon.jit
def _v_factor_cols(INVERSE: gl.constexpr):
    """[32] in ``_COLS``: the 2-bit V field factor F (or 1 / F) of each channel column of a
    chunk (constants: the field is the run index of ``_RUN4``)."""
    f = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _RUN4)))
    c = gl.where(
        f == 0,
        _crumb_factor(0, INVERSE, _SUB),
        gl.where(
            f == 1,
            _crumb_factor(1, INVERSE, _SUB),
            gl.where(f == 2, _crumb_factor(2, INVERSE, _SUB), _crumb_factor(3, INVERSE, _SUB)),
        ),
    )
    return _vchan_from_run(gl.full([4, 2, 4], 0.0, gl.float32, _RUN4) + c[None, None, :])


@gluon.jit
def _scores_chunk(s, qz, q_rot, kcs, kzp, kw, KB: gl.constexpr = 4):
    """Scores of one 32-channel chunk: ``q_rot * s_col_K`` enters as two fp16 operands
    ``hi + lo`` (relative error about 2^-22 instead of 2^-12; see ``decode_mma_t._qs_t`` for
    the records that need it), each meeting the same code operand."""
    x = q_rot * kcs[None, :]
    hi = x.to(gl.float16)
    lo = (x - hi.to(gl.float32)).to(gl.float16)
    qs = gl.convert_layout(hi, _OPA, assert_trivial=True)
    qt = gl.convert_layout(lo, _OPA, assert_trivial=True)
    qz = qz + gl.sum(q_rot * kzp[None, :], axis=1)
    kop = _k_operand_pairs(kw, KB)
    return mma_v2(qs, kop, mma_v2(qt, kop, s)), qz


@gluon.jit
def _values_chunk(acc, alpha, pw, pt, va, vb, vcs, CQ: gl.constexpr, VB: gl.constexpr):
    """``acc * alpha + s_col_V * (p @ cV + pz)``, the bracket from one MMA whose accumulator
    starts at ``pt``. 2-bit V: the dot runs on ``1 + c / F`` (F per channel column), so the
    bracket is ``F * (dot + pz / F - sum(pw))``; ``pt`` holds the last two terms and ``acc``
    is kept divided by F (:func:`_store_chunk` multiplies it back; powers of two, exact).
    4-bit V: ``pt`` is pz."""
    o = mma_v2(pw, _v_operand_pairs(va, vb, CQ, VB), pt)
    return acc * alpha[:, None] + vcs[None, :] * o


@gluon.constexpr_function
def k_lane_shift(kb):
    """``lane >> k_lane_shift(KB)`` is the K word of a 64-token half a lane ``c + 4 w`` stages:
    ``w`` at 4 bits (8 tokens a word), ``w // 2`` at 2 bits (16 tokens a word: lanes ``w`` and
    ``w ^ 1`` share it)."""
    return 2 if int(getattr(kb, "value", kb)) == 4 else 3


@gluon.jit
def k_word_offsets(G: gl.constexpr, KB: gl.constexpr):
    """[32 rows, 32 lanes] word offsets of the K words a stage holds, from a 128-channel K
    field's start plus the half's ``64 KB / 32`` words: row ``r``, lane ``c + 4 w`` gets
    channel ``32 c + r``'s word :func:`k_lane_shift` of the half (``G KB / 32`` words a
    channel)."""
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, _CPK))
    ln = gl.arange(0, 32, layout=gl.SliceLayout(0, _CPK))
    CW: gl.constexpr = G * KB // 32
    return ((ln[None, :] & 3) * 32 + r[:, None]) * CW + (ln[None, :] >> k_lane_shift(KB))


@gluon.jit
def _stage_words(sk, sv, r32, ok, half, K_OFF, V_OFF, VB: gl.constexpr, G: gl.constexpr,
                 KB: gl.constexpr = 4, K_WORDS: gl.constexpr = True):  # fmt: skip
    """cp.async of the K words [8 * chunk + i, lane] and V words [i * HV + h, lane] of the
    64-token half ``half`` of a G-token record (channel ``d``'s K words are ``d * G / 8 ..``,
    a half's eight follow ``8 * half`` of them; V rows are tokens). 2-bit K (``KB = 2``):
    channel ``d``'s words are ``d * G / 16 ..``, four a half, and lanes ``c + 4 w`` and ``c +
    4 (w ^ 1)`` both get word ``w // 2`` (tokens ``8 w ..`` are its half ``w % 2``). Without
    ``K_WORDS`` the V words only (``decode_mma_rec`` stages K itself)."""
    HV: gl.constexpr = VB // 2
    WV: gl.constexpr = 128 * VB // 32
    if K_WORDS:
        # K: row 8 * chunk + i, lane c + 4 w: channel 32 c + 8 * chunk + i, word w of the half
        koff = k_word_offsets(G, KB)
        kbase = r32 + K_OFF // 4 + half * (2 * KB)
        async_copy.async_copy_global_to_shared(sk, kbase + koff, mask=(koff >= 0) & ok)
    # V: row i * HV + h, lane c + 4 g: token 16 c + i of the half, word g * HV + h
    CPV: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[16 * HV, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1], order=[1, 0]
    )
    vr = gl.arange(0, 16 * HV, layout=gl.SliceLayout(1, CPV))
    vl = gl.arange(0, 32, layout=gl.SliceLayout(0, CPV))
    tok = (vl[None, :] & 3) * 16 + vr[:, None] // HV
    voff = tok * WV + (vl[None, :] >> 2) * HV + vr[:, None] % HV
    vbase = r32 + V_OFF // 4 + half * (64 * WV)
    async_copy.async_copy_global_to_shared(sv, vbase + voff, mask=(voff >= 0) & ok)


@gluon.jit
def _stage_kchan(skc, skz, r16, ok, KCS_OFF, KZP_OFF):
    """cp.async of the K column scales and zero points as [4, 32] (both kernels read them in
    runs of 8 channels per lane)."""
    c32 = gl.arange(0, 4, layout=gl.SliceLayout(1, _CP32))
    j32 = gl.arange(0, 32, layout=gl.SliceLayout(0, _CP32))
    o32 = c32[:, None] * 32 + j32[None, :]
    m32 = (o32 >= 0) & ok
    async_copy.async_copy_global_to_shared(skc, r16 + KCS_OFF // 2 + o32, mask=m32)
    async_copy.async_copy_global_to_shared(skz, r16 + KZP_OFF // 2 + o32, mask=m32)


@gluon.jit
def _stage_block(
    sk,
    sv,
    skc,
    skz,
    skr,
    svc,
    svr,
    svz,
    r32,
    r16,
    ok,
    half,
    K_OFF: gl.constexpr,
    KCS_OFF: gl.constexpr,
    KZP_OFF: gl.constexpr,
    KRS_OFF: gl.constexpr,
    V_OFF: gl.constexpr,
    VCS_OFF: gl.constexpr,
    VRS_OFF: gl.constexpr,
    VZP_OFF: gl.constexpr,
    VB: gl.constexpr,
    G: gl.constexpr,
    T_LAYOUT: gl.constexpr,
    KB: gl.constexpr = 4,
):
    """Issue the cp.async copies of one 64-token half of a record into a stage (nothing read
    when ``ok`` is false): K words lane-major [chunk, i, lane], V words [i, h, lane], the K
    channel vectors (s_col, zero point) as [4, 32], the half's token vectors (K s_row, V s_row
    and zero point) and the V column scales: [4, 16] and [4, 2, 16] for this file's kernel,
    with ``T_LAYOUT`` [8, 8] and [8, 16] for ``decode_mma_t``; field offsets in bytes."""
    _stage_words(sk, sv, r32, ok, half, K_OFF, V_OFF, VB, G, KB)
    _stage_kchan(skc, skz, r16, ok, KCS_OFF, KZP_OFF)
    if T_LAYOUT:
        g8 = gl.arange(0, 8, layout=gl.SliceLayout(1, _CP88))
        i8 = gl.arange(0, 8, layout=gl.SliceLayout(0, _CP88))
        ot = g8[:, None] * 8 + i8[None, :]
        g16 = gl.arange(0, 8, layout=gl.SliceLayout(1, _CP816))
        i16 = gl.arange(0, 16, layout=gl.SliceLayout(0, _CP816))
        oc = g16[:, None] * 16 + i16[None, :]
    else:
        c16 = gl.arange(0, 4, layout=gl.SliceLayout(1, _CP16))
        j16 = gl.arange(0, 16, layout=gl.SliceLayout(0, _CP16))
        ot = c16[:, None] * 16 + j16[None, :]
        cv = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CPV16)))
        xv = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CPV16)))
        jv = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CPV16)))
        oc = cv[:, None, None] * 32 + xv[None, :, None] * 16 + jv[None, None, :]
    mt = (ot >= 0) & ok
    r16h = r16 + half * 64
    async_copy.async_copy_global_to_shared(skr, r16h + KRS_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svr, r16h + VRS_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svz, r16h + VZP_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svc, r16 + VCS_OFF // 2 + oc, mask=(oc >= 0) & ok)


@gluon.jit
def unit_record(uu, u1, bt_row, num_kv_heads, h, rec32_ptr, rec16_ptr, REC: gl.constexpr,
                G: gl.constexpr):  # fmt: skip
    """Where 64-token unit ``uu`` of a request lies: its record's 32- and 16-bit base pointers
    for KV head ``h`` (block-table entry ``uu // (G / 64)``; a unit past ``u1`` reads the last
    one's entry), whether it is to be read (``uu < u1``) and its half in the record."""
    HALVES: gl.constexpr = G // 64
    uc = gl.minimum(uu, u1 - 1)
    blk = gl.load(bt_row + uc // HALVES).to(gl.int64)
    rbase = blk * num_kv_heads + h
    r32 = rec32_ptr + rbase * (REC // 4)
    r16 = rec16_ptr + rbase * (REC // 2)
    return r32, r16, uu < u1, uc % HALVES


@gluon.jit
def _issue_stage(
    sk,
    sv,
    skc,
    skz,
    skr,
    svc,
    svr,
    svz,
    uu,
    u1,
    bt_row,
    num_kv_heads,
    h,
    rec32_ptr,
    rec16_ptr,
    REC: gl.constexpr,
    K_OFF: gl.constexpr,
    KCS_OFF: gl.constexpr,
    KZP_OFF: gl.constexpr,
    KRS_OFF: gl.constexpr,
    V_OFF: gl.constexpr,
    VCS_OFF: gl.constexpr,
    VRS_OFF: gl.constexpr,
    VZP_OFF: gl.constexpr,
    VB: gl.constexpr,
    G: gl.constexpr,
    T_LAYOUT: gl.constexpr,
    KB: gl.constexpr = 4,
):
    """Stage 64-token unit ``uu`` of the request (half ``uu % (G / 64)`` of the record of
    block-table entry ``uu // (G / 64)``; nothing is read from ``u1`` on) into the given stage
    buffers and commit the copy group: the 16-row layout of the scale vectors, or with
    ``T_LAYOUT`` the one of ``decode_mma_t``."""
    r32, r16, ok, half = unit_record(uu, u1, bt_row, num_kv_heads, h, rec32_ptr, rec16_ptr, REC, G)
    _stage_block(sk, sv, skc, skz, skr, svc, svr, svz, r32, r16, ok, half, K_OFF, KCS_OFF,
                 KZP_OFF, KRS_OFF, V_OFF, VCS_OFF, VRS_OFF, VZP_OFF, VB, G, T_LAYOUT,
                 KB)  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _staged_kw(sk, CQ: gl.constexpr):
    return _kw_from_lanes(sk.slice(8 * CQ, 8).load(_RDK))


@gluon.jit
def _run8(sc, CQ: gl.constexpr):
    """The [4 c, 8 i] run (channel 32 c + 8 CQ + i) of a staged [4, 32] channel vector."""
    return sc.slice(8 * CQ, 8, dim=1).load(_RUN8)


@gluon.jit
def _staged_chan(sc, CQ: gl.constexpr):
    return _chan_from_run(_run8(sc, CQ))


@gluon.jit
def _staged_vchan(svc, CQ: gl.constexpr):
    return _vchan_from_run(svc.slice(4 * CQ, 4, dim=2).load(_RUN4))


@gluon.jit
def _staged_tok(st):
    return _tok_from_run(st.load(_RUN16))


@gluon.jit
def _store_chunk(acc, inv_l, out_rows, row_ok, CQ: gl.constexpr, VB: gl.constexpr):
    n = gl.arange(0, 32, layout=_COLS)  # 8 nt + 2 c + x -> channel 32 c + 16 x + 4 CQ + nt
    phys = (n & 7) * 16 + 4 * CQ + (n >> 3)
    if VB == 2:
        acc = acc * _v_factor_cols(False)[None, :]
    gl.store(out_rows[:, None] + phys[None, :], acc * inv_l[:, None], mask=row_ok[:, None])


@gluon.jit
def _softmax_step(
    s,
    ze,
    zo,
    krs,
    vzp,
    vrs,
    m,
    l,
    u,
    tok_of_col,
    q_pos,
    T: gl.constexpr,
    VB: gl.constexpr,
    KB: gl.constexpr = 4,
):
    """Scores -> online softmax of one block: new (m, l), the rescale factor, the value
    MMAs' starting accumulator ``pt`` and the value operand ``fp16(p * s_row_V)``. Token
    columns of odd nibbles ran on ``16 c``: they take ``zo`` (16 times the zero-point term)
    instead of ``ze``, and ``krs`` already holds 1/16 of their row scale. 2-bit K: columns
    ran on ``c / F``, they take ``ze / F`` and ``krs`` holds F times their row scale."""
    if KB == 2:
        s = (s + ze[:, None] * _k2_factor_cols(True)[None, :]) * krs[None, :]
    else:
        s = (s + gl.where(_odd_nibble_cols()[None, :], zo[:, None], ze[:, None])) * krs[None, :]
    if T > 1:
        key = u * 64 + tok_of_col
        s = gl.where(key[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new[:, None])
    l = l * alpha + gl.sum(p, axis=1)
    pz = gl.sum(p * vzp[None, :], axis=1)
    pw = gl.convert_layout((p * vrs[None, :]).to(gl.float16), _OPA, assert_trivial=True)
    if VB == 2 and _SUB:
        pt = pz[:, None] * _v_factor_cols(True)[None, :]
    elif VB == 2:
        spw = mma_v2(
            pw, gl.full([64, 8], 1.0, gl.float16, _OPB), gl.full([16, 8], 0.0, gl.float32, _MMA)
        )
        pt = pz[:, None] * _v_factor_cols(True)[None, :] - gl.max(spw, axis=1)[:, None]
    else:
        pt = gl.full([16, 32], 0.0, gl.float32, _MMA) + pz[:, None]
    return m_new, l, alpha, pt, pw


@gluon.jit
def mma_decode_kernel(
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
    KB: gl.constexpr = 4,
):
    """Grid ``(S, B * Hkv)``, one warp: split ``program_id(0)`` of request ``b``'s full blocks
    for KV head ``h``; writes the normalized partial rows and their base-2 log-sum-exp to the
    workspace exactly as the Triton split kernel does (the tail is left to the combine).
    ``LAG``: query tokens of the request that follow these ``T`` (a chunk of a longer verify
    run; their keys are masked). ``KB = 2``: 2-bit K codes (not with ``SUBNORMAL_CODES``)."""
    if PDL:
        launch_dependents()
    gl.static_assert(KB == 4 or (KB == 2 and not _SUB))
    split = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
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

    bt_row = bt_ptr + b.to(gl.int64) * bt_stride
    gl.static_assert(NBUF >= 2)
    # records staged in shared memory by cp.async, NBUF - 1 blocks ahead of their use; the
    # first copies are issued before q is loaded and rotated, which hides their latency
    HV: gl.constexpr = VB // 2
    sk = gl.allocate_shared_memory(gl.int32, [NBUF, 32, 32], _SH2)
    sv = gl.allocate_shared_memory(gl.int32, [NBUF, 16 * HV, 32], _SH2)
    skc = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 32], _SH2)
    skz = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 32], _SH2)
    skr = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 16], _SH2)
    svc = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 2, 16], _SH3)
    svr = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 16], _SH2)
    svz = gl.allocate_shared_memory(gl.float16, [NBUF, 4, 16], _SH2)
    for st in gl.static_range(NBUF - 1):
        _issue_stage(
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
            False,
            KB,
        )

    # query rows r = t * GQA + g (token t at position seq_len - T + t, head h * GQA + g),
    # scaled and rotated in fp32 (lane 4 g + c: rows g, g + 8, channels 32 c ..)
    qrot = _q_rows(q_ptr, b, h, num_q_heads, qk_scale, T, GQA, gl.constexpr(_QL16))
    q0 = _q_chunk_rows(qrot, 0)
    q1 = _q_chunk_rows(qrot, 1)
    q2 = _q_chunk_rows(qrot, 2)
    q3 = _q_chunk_rows(qrot, 3)

    r = gl.arange(0, 16, layout=_ROWS)
    row_ok = r < T * GQA
    q_pos = seq_len - (T + LAG) + r // GQA
    lt = gl.arange(0, 64, layout=_COLS)
    tok_of_col = (lt & 7) * 8 + (lt >> 3)  # logical column -> token of the block

    m = gl.full([16], -1.0e30, gl.float32, _ROWS)
    l = gl.full([16], 0.0, gl.float32, _ROWS)
    a0 = gl.full([16, 32], 0.0, gl.float32, _MMA)
    a1 = gl.full([16, 32], 0.0, gl.float32, _MMA)
    a2 = gl.full([16, 32], 0.0, gl.float32, _MMA)
    a3 = gl.full([16, 32], 0.0, gl.float32, _MMA)
    for u in range(u0, u1):
        j = u - u0
        nst = (j + NBUF - 1) % NBUF
        gl.thread_barrier()  # every lane is done with the stage about to be overwritten
        _issue_stage(
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
            False,
            KB,
        )
        async_copy.wait_group(NBUF - 1)
        gl.thread_barrier()
        cst = j % NBUF
        ck = sk.index(cst)
        kc = skc.index(cst)
        kz = skz.index(cst)
        vc = svc.index(cst)
        s = gl.full([16, 64], 0.0, gl.float32, _MMA)
        qz = gl.full([16], 0.0, gl.float32, _ROWS)
        s, qz = _scores_chunk(
            s, qz, q0, _staged_chan(kc, 0), _staged_chan(kz, 0), _staged_kw(ck, 0), KB
        )
        s, qz = _scores_chunk(
            s, qz, q1, _staged_chan(kc, 1), _staged_chan(kz, 1), _staged_kw(ck, 1), KB
        )
        s, qz = _scores_chunk(
            s, qz, q2, _staged_chan(kc, 2), _staged_chan(kz, 2), _staged_kw(ck, 2), KB
        )
        s, qz = _scores_chunk(
            s, qz, q3, _staged_chan(kc, 3), _staged_chan(kz, 3), _staged_kw(ck, 3), KB
        )
        if KB == 2:
            kf = _k2_factor_cols(False) * _C_OUT
        else:
            kf = gl.where(_odd_nibble_cols(), 0.0625 * _C_OUT, _C_OUT)
        krs = _staged_tok(skr.index(cst)) * kf
        vrs = _staged_tok(svr.index(cst))
        vzp = _staged_tok(svz.index(cst))
        qz = qz * _C_IN
        m, l, alpha, pt, pw = _softmax_step(
            s, qz, 16.0 * qz, krs, vzp, vrs, m, l, u, tok_of_col, q_pos, T + LAG, VB, KB
        )
        RDV: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[16 * HV, 1],
            threads_per_warp=[1, 32],
            warps_per_cta=[1, 1],
            order=[1, 0],
        )
        vt3 = gl.reshape(sv.index(cst).load(RDV), [16, HV, 32])  # [i, h, lane]
        if VB == 4:
            t0, t1 = gl.split(gl.permute(vt3, [0, 2, 1]))
            va0, vb0 = _v_pairs(_vw_from_lanes(t0))
            va1, vb1 = _v_pairs(_vw_from_lanes(t1))
        else:
            va0, vb0 = _v_pairs(_vw_from_lanes(gl.reshape(vt3, [16, 32])))
            va1 = va0
            vb1 = vb0
        a0 = _values_chunk(a0, alpha, pw, pt, va0, vb0, _staged_vchan(vc, 0), 0, VB)
        a1 = _values_chunk(a1, alpha, pw, pt, va0, vb0, _staged_vchan(vc, 1), 1, VB)
        a2 = _values_chunk(a2, alpha, pw, pt, va1, vb1, _staged_vchan(vc, 2), 2, VB)
        a3 = _values_chunk(a3, alpha, pw, pt, va1, vb1, _staged_vchan(vc, 3), 3, VB)
    async_copy.wait_group(0)

    seen = l > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l, 1.0), 0.0)
    lse = gl.where(seen, m + gl.log2(gl.where(seen, l, 1.0)), float("-inf"))
    q_row = ((b * T + r // GQA) * num_q_heads + h * GQA + r % GQA).to(gl.int64)
    ws_row = q_row * S + split
    gl.store(ws_ptr + ws_row, lse, mask=row_ok)
    out_rows = ws_ptr + lse_numel + ws_row * 128
    _store_chunk(a0, inv_l, out_rows, row_ok, 0, VB)
    _store_chunk(a1, inv_l, out_rows, row_ok, 1, VB)
    _store_chunk(a2, inv_l, out_rows, row_ok, 2, VB)
    _store_chunk(a3, inv_l, out_rows, row_ok, 3, VB)
