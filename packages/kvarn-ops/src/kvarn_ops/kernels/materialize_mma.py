"""Materialize of full blocks with codes unpacked straight into tensor-core registers (Gluon).

The Triton kernel (``materialize.py``) builds the ``[128, 128]`` operand ``S P`` (column scales
times Sylvester signs) per tile and moves it, the code tile and the output through shared
memory: about 130 KB of shared-memory traffic per 16 KB of output (34% of copy bandwidth on an
H200). This kernel moves no codes, operands or outputs through shared memory (only two
per-tile vectors of 64 values). Two facts make that possible:

- **The rotation factors.** The Sylvester matrix is ``P[i, j] = (-1)^popc(i & j)``, so for any
  split of the seven index bits into a set ``S_in`` (4 bits) and ``S_out`` (3 bits) it is the
  Kronecker product ``P_in (x) P_out``. ``x P`` is then eight ``[16 tokens, 16] x [16, 16]``
  products (one per value of the ``S_out`` bits of the input channel, contracting its
  ``S_in`` bits; ``mma.sync.m16n8k16``, two per product) followed by an 8-point Walsh-Hadamard
  transform across the eight results, in fp32 registers (3 add/sub stages). That is 1/8 of
  the tensor-core work of the dense product, and the B operands ``diag(s_col) P_in`` are eight
  ``[16, 16]`` tiles that one ``xor`` of the scale bits with a sign mask builds in registers.
- **Free renaming.** A contraction does not care about the order of its channels and the
  output rows and columns can be stored anywhere, so the MMA's positions are mapped to
  channels and tokens such that each lane's operand registers come from the code words it
  loads, and each lane's results are 8 contiguous output channels (16-byte stores that fill
  32-byte sectors with the neighbouring lane).

Index maps (lane ``4 g + c``; ``c0, c1`` the bits of ``c``; MMA k position ``e + 2 c + 8 h``;
MMA output column ``n = 2 cc + e'`` of n-tile ``nt``; ``o`` the product (group), ``o'`` the
transform's output group): input channel ``i = e | o0 << 1 | o1 << 2 | h << 3 | c0 << 4 |
o2 << 5 | c1 << 6`` and output channel ``j = e' | o0' << 1 | o1' << 2 | cc << 3 | o2' << 5 |
nt << 6``; ``S_in`` = bits {0, 3, 4, 6}. Token ``t = 8 g + 2 mt + r8`` of a 64-token half is
row ``g + 8 r8`` of m-tile ``mt``: lane ``g`` holds tokens ``8 g .. 8 g + 7``, so for K (a word
holds 8 consecutive tokens of one channel) each lane reads word ``g`` of its channels and one
``prmt`` of two channels' words gives both nibbles of a byte as two operand registers
(tokens ``8 g + 2 mt`` and ``+ 1``); at 2 bits lane ``g`` loads the 16-bit run of those
8 tokens (the record's codes at 2 bits are runs of 16 bits per 8 tokens) and byte ``mt // 2``
of it holds the m-tile's two tokens in fields ``2 (mt % 2)`` and ``+ 1`` (the same
instructions). For V a lane reads the words of its channels in its token
rows, and one ``prmt`` (a byte copied to both halves) plus one ``lop3`` gives an operand
register of two adjacent channels. Codes are exact fp16: a field masked into the mantissa
of a power of two whose last place weighs 1 at that field (1024.0 for bits 0-1 or 0-3, 256.0 at
bits 2-3, 64.0 at bits 4-7, 16.0 at bits 6-7), then that power subtracted (exact).

Per tile the zero-point part is one more product per group: K ``zp^T P`` (the zero points
times the signs, all rows alike), V ``s_col^T P`` (a ones row times ``S P``); both transformed
the same way and reduced to a per-column vector once per tile (kept in shared memory, not in
registers). Epilogue:
``K: s_row (x + zp^T P) / sqrt(D)``, ``V: (s_row x + zp s_col^T P) / sqrt(D)``, rounded once to
the output dtype. Products of fp16 codes and fp16 scales are exact and summed in fp32, the
transform adds in fp32: the reference's result up to fp32 summation order.

Head pairs (head_dim 64): ``P_128 = [[P_64, P_64], [P_64, -P_64]]`` over input channel bit 6,
so with the channels of KV heads ``h`` and ``h + 1`` as input channels 0-63 and 64-127, the
first n-tile's products whose B operands keep only head ``h``'s rows (the other head's column
scales zeroed) are exactly ``x_h P_64``, and likewise for ``h + 1``: the A operands (the codes
of both heads) are unpacked once and feed both heads' products, with no mixing of their values
(zeros, not a butterfly of sums). Each head's row scales, zero points and vectors are its own;
the output rows are 64 channels; an odd head count leaves the last program one head.

Head_dim 256: ``P_256 = [[P_128, P_128], [P_128, -P_128]]`` over channel bit 7, so each output
n-tile of output half ``ob`` sums the two 128-channel input halves' products (one accumulator
per group), the second half's B operands sign-flipped for ``ob = 1``: twice the products per
output element of head_dim 128, the codes of both halves unpacked once for the four output
n-tiles. To fit the registers the codes are taken 32 tokens at a time (two m-tiles: 16-bit
halves of the 4-bit K words, bytes of the 2-bit runs) and the column-scale pairs are loaded at
each n-tile; a program takes the two 32-token pairs of a half-block in turn (``MPS = 2``, the
default; the second pair's codes loaded before the first pair's stores) or one (``MPS = 1``,
twice the programs).

Scope: full blocks of 2/4-bit K and 2/4-bit V, G 64 or 128, head_dim 64, 128 or 256, one warp
per (64-token half of a block, or 32 tokens at 256 with ``MPS = 1``; KV head or head pair; K or
V): a 128-token record is two programs.
The exact tail (the
newest partial block of a request) is left to the Triton kernel (``materialize.py``, tails
only). Gluon does not run under the Triton interpreter: the CPU tests compile this kernel for
sm_90a and sm_120a and check its instruction mix, ``gpu/parity.py`` compares it with the
reference on a GPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# one warp's m16n8k16 layouts (accumulator, fp16 operands, its rows and columns) and the
# register-level join and stack helpers are the decode kernel's
from kvarn_ops.kernels.decode_mma import (
    _COLS,
    _MMA,
    _OPA,
    _OPB,
    _ROWS,
    _joined,
    _stack4,
    _stack8,
)

__all__ = [
    "MMA_MATERIALIZE_D",
    "MMA_MATERIALIZE_DIMS",
    "mma_materialize_kernel",
    "mma_materialize_supported",
]

MMA_MATERIALIZE_D = 128
"""The channel width of the kernel's tile (its layouts' seven channel bits)."""
MMA_MATERIALIZE_DIMS = (64, 128, 256)
"""Head dims the kernel serves: 128; 64 as head pairs (two KV heads' channels as the two
halves of one 128-channel input, each head's output from the B operand rows of its own
channels: see :func:`_head_only`); 256 as two 128-channel halves summed into each output
n-tile (:func:`_tile256`)."""

# K words [channel i, word w] of a 64-token half: lane 4 g + c holds word g of the 32 channels
# whose bits 4 and 6 are c0, c1
_KW: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [32, 0]],
    lane_bases=[[16, 0], [64, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=[],
    block_bases=[],
    shape=[128, 8],
)
# 4-bit V words [row g + 8 r8 of an m-tile, word wd] (wd = h | c0 << 1 | o2 << 2 | c1 << 3)
_VW4: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 4], [8, 0]],
    lane_bases=[[0, 2], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[16, 16],
)
# 2-bit V words [row, wd] (wd = c0 | o2 << 1 | c1 << 2)
_VW2: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 2], [8, 0]],
    lane_bases=[[0, 1], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[16, 8],
)
# channel pairs as int32 [k pair kp = c0 | c1 << 1 | h << 2, column n]: the B operand's pairs
_BP: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[4, 0]],
    lane_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 8],
)
# channel pairs as int32 [row, kp]: the A operand's pairs
_AP: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [0, 4]],
    lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[16, 8],
)
# output [row, local channel e' | o0' << 1 | o1' << 2 | cc << 3 | o2' << 5]: 8 contiguous
# channels per lane and register run
_OUT: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [8, 0]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[16, 64],
)

_VSM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
# the eight per-tile vectors of an n-tile [o', column]: each lane its two columns of all eight
_VEC8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [1, 0], [2, 0], [4, 0]],
    lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 8],
)

_INV_SQRT_D: gl.constexpr = gl.constexpr(0.08838834764831845)  # fp32(1 / sqrt(128))


def mma_materialize_supported(k_bits: int, v_bits: int, block_size: int, head_dim: int) -> bool:
    """Whether a geometry takes this kernel (on a GPU with mma.sync, i.e. sm_80 and newer)."""
    return (
        k_bits in (2, 4)
        and v_bits in (2, 4)
        and block_size in (64, 128)
        and head_dim in MMA_MATERIALIZE_DIMS
    )


@gluon.jit
def _k_nibbles(ka, kb, BYTE: gl.constexpr):
    """Byte ``BYTE`` of K words ``ka`` (channel i, low halves) and ``kb`` (channel i + 1, high
    halves) as two operand registers of exact fp16 codes: the low nibbles (token 2 BYTE of the
    word) and the high nibbles (token 2 BYTE + 1): one ``prmt``, then per register one
    ``lop3`` into the mantissa of 1024.0 (low) or 64.0 (high) and one ``sub.f16x2``."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 4) << 8) | ((BYTE + 4) << 12)
    return gl.inline_asm_elementwise(
        f"{{ .reg .b32 t, x, y, o; prmt.b32 t, $2, $3, {SEL}; "
        "lop3.b32 x, t, 983055, 1677747200, 0xea; "  # & 0x000F000F | 0x64006400
        "lop3.b32 y, t, 15728880, 1409307648, 0xea; "  # & 0x00F000F0 | 0x54005400
        "mov.b32 o, 1677747200; sub.f16x2 $0, x, o; mov.b32 o, 1409307648; sub.f16x2 $1, y, o; }",
        "=r,=r,r,r",
        [_joined(ka, kb)],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _k_crumbs(ka, kb, BYTE: gl.constexpr, HIGH: gl.constexpr):
    """2-bit K: byte ``BYTE`` of the 16-bit code runs ``ka`` (channel i, low halves) and
    ``kb`` (channel i + 1, high halves) as two operand registers of exact fp16 codes: fields 0
    and 1 of the byte (``HIGH`` false; tokens ``4 BYTE`` and ``+ 1`` of the run) or fields 2
    and 3. One ``prmt``, then per register one ``lop3`` into the mantissa of the power of two
    whose last place weighs 1 at the field (1024.0 at bits 0-1, 256.0 at 2-3, 64.0 at 4-5, 16.0
    at 6-7) and one ``sub.f16x2``: the 4-bit path's cost."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 4) << 8) | ((BYTE + 4) << 12)
    MX: gl.constexpr = 0x00300030 if HIGH else 0x00030003
    BX: gl.constexpr = 0x54005400 if HIGH else 0x64006400
    MY: gl.constexpr = 0x00C000C0 if HIGH else 0x000C000C
    BY: gl.constexpr = 0x4C004C00 if HIGH else 0x5C005C00
    return gl.inline_asm_elementwise(
        f"{{ .reg .b32 t, x, y, o; prmt.b32 t, $2, $3, {SEL}; "
        f"lop3.b32 x, t, {MX}, {BX}, 0xea; lop3.b32 y, t, {MY}, {BY}, 0xea; "
        f"mov.b32 o, {BX}; sub.f16x2 $0, x, o; mov.b32 o, {BY}; sub.f16x2 $1, y, o; }}",
        "=r,=r,r,r",
        [_joined(ka, kb)],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _v4_bytes(w):
    """The four bytes of 4-bit V words ``w`` as operand registers (low nibble, high nibble):
    fp16 ``[..., 2]`` each, exact."""
    asm: gl.constexpr = (
        "{ .reg .b32 t, o; mov.b32 o, 1409311744; "  # 0x54006400
        "prmt.b32 t, $4, $4, 0; lop3.b32 t, t, 15728655, 1409311744, 0xea; "  # 0x00F0000F
        "sub.f16x2 $0, t, o; "
        "prmt.b32 t, $4, $4, 4369; lop3.b32 t, t, 15728655, 1409311744, 0xea; "
        "sub.f16x2 $1, t, o; "
        "prmt.b32 t, $4, $4, 8738; lop3.b32 t, t, 15728655, 1409311744, 0xea; "
        "sub.f16x2 $2, t, o; "
        "prmt.b32 t, $4, $4, 13107; lop3.b32 t, t, 15728655, 1409311744, 0xea; "
        "sub.f16x2 $3, t, o; }"
    )
    return gl.inline_asm_elementwise(
        asm,
        "=r,=r,=r,=r,r,r",
        [_joined(w, w)],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _v2_byte(w, BYTE: gl.constexpr):
    """Byte ``BYTE`` of 2-bit V words ``w`` as two operand registers: fields (0, 1) and
    (2, 3) of the byte, exact fp16 ``[..., 2]`` each (bases 1024 / 256 and 64 / 16)."""
    SEL: gl.constexpr = BYTE * 0x1111
    return gl.inline_asm_elementwise(
        f"{{ .reg .b32 t, x, y, o; prmt.b32 t, $2, $2, {SEL}; "
        "lop3.b32 x, t, 786435, 1543529472, 0xea; "  # & 0x000C0003 | 0x5C006400
        "lop3.b32 y, t, 12582960, 1275089920, 0xea; "  # & 0x00C00030 | 0x4C005400
        "mov.b32 o, 1543529472; sub.f16x2 $0, x, o; "
        "mov.b32 o, 1275089920; sub.f16x2 $1, y, o; }",
        "=r,=r,r,r",
        [_joined(w, w)],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _halves(w, mask):
    """int32 pairs ``w ^ mask`` as two fp16 values ``[..., 2]`` (low half first)."""
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b32 t; xor.b32 t, $2, $3; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r",
        [w, mask],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )
    return gl.join(lo, hi)


@gluon.jit
def _split8(x):
    """[..., 2 o2, 2 o1, 2 o0] -> the eight [...] tensors, index o = o0 + 2 o1 + 4 o2."""
    a, b = gl.split(x)  # o0
    a0, a1 = gl.split(a)  # o1
    b0, b1 = gl.split(b)
    x0, x4 = gl.split(a0)  # o2
    x2, x6 = gl.split(a1)
    x1, x5 = gl.split(b0)
    x3, x7 = gl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@gluon.jit
def _a_operands(x):
    """Codes [r8, g, h, c1, c0, e, o2, o1, o0] -> eight A operands [16 rows, 16 k]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x)
    return (
        _as_opa(x0),
        _as_opa(x1),
        _as_opa(x2),
        _as_opa(x3),
        _as_opa(x4),
        _as_opa(x5),
        _as_opa(x6),
        _as_opa(x7),
    )


@gluon.jit
def _as_opa(x):
    return gl.convert_layout(gl.reshape(x, [16, 16]), _OPA, assert_trivial=True)


@gluon.jit
def _k_codes(ka, kb, MT: gl.constexpr, KB: gl.constexpr = 4):
    """A operands of m-tile ``MT`` from the K channel pairs ``ka``, ``kb`` [64 pairs, 8]: at
    4 bits lane word ``w`` is the half's word ``w`` (tokens ``8 w ..``); at 2 bits its 16-bit
    run ``w`` (the same tokens), whose byte ``MT // 2`` holds tokens ``8 w + 2 MT`` and ``+ 1``
    of this m-tile in fields ``2 (MT % 2)`` and ``+ 1``."""
    if KB == 2:
        lo, hi = _k_crumbs(ka, kb, MT // 2, MT % 2 == 1)
    else:
        lo, hi = _k_nibbles(ka, kb, MT)  # [p, w, e]: tokens 8 w + 2 MT (lo), + 1 (hi)
    x = gl.join(lo, hi)  # [p, w, e, r8]
    # p = o0 | o1 << 1 | h << 2 | c0 << 3 | o2 << 4 | c1 << 5
    x = gl.reshape(x, [2, 2, 2, 2, 2, 2, 8, 2, 2])  # c1 o2 c0 h o1 o0 w e r8
    return _a_operands(gl.permute(x, [8, 6, 3, 0, 2, 7, 1, 4, 5]))


@gluon.jit
def _k_runs(r16, CODES_OFF: gl.constexpr, G: gl.constexpr, half, KB: gl.constexpr,
            MP: gl.constexpr):  # fmt: skip
    """Head_dim 256: the K codes of m-tiles ``2 MP`` and ``2 MP + 1`` of a 64-token half as
    channel pairs [64, 8] of one 128-channel half (``CODES_OFF`` its first channel's codes):
    lane entry ``w`` is the 16-bit half ``MP`` of the half's word ``w`` (4-bit: tokens ``8 w
    + 4 MP ..``) or byte ``MP`` of its 16-bit run (2-bit), zero-extended."""
    ci = gl.arange(0, 128, layout=gl.SliceLayout(1, _KW))
    wi = gl.arange(0, 8, layout=gl.SliceLayout(0, _KW))
    if KB == 4:
        hpc: gl.constexpr = G // 4  # 16-bit halves a channel
        h16 = gl.load(r16 + CODES_OFF // 2 + ci[:, None] * hpc + (16 * half + 2 * wi + MP)[None, :])
        kw = h16.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    else:
        r8 = r16.to(gl.pointer_type(gl.int8), bitcast=True)
        bpc: gl.constexpr = G // 4  # bytes a channel
        b8 = gl.load(r8 + CODES_OFF + ci[:, None] * bpc + (16 * half + 2 * wi + MP)[None, :])
        kw = b8.to(gl.int32) & 0xFF
    return gl.split(gl.permute(gl.reshape(kw, [64, 2, 8]), [0, 2, 1]))


@gluon.jit
def _k_codes_local(ka, kb, ML: gl.constexpr, KB: gl.constexpr):
    """A operands of the ``ML``-th m-tile of a :func:`_k_runs` pair."""
    if KB == 2:
        lo, hi = _k_crumbs(ka, kb, 0, ML == 1)
    else:
        lo, hi = _k_nibbles(ka, kb, ML)
    x = gl.join(lo, hi)  # [p, w, e, r8]
    x = gl.reshape(x, [2, 2, 2, 2, 2, 2, 8, 2, 2])  # c1 o2 c0 h o1 o0 w e r8
    return _a_operands(gl.permute(x, [8, 6, 3, 0, 2, 7, 1, 4, 5]))


@gluon.jit
def _v4_codes(vw):
    """A operands of an m-tile from its 4-bit V words [16 rows, 16 wd]."""
    f0, f1, f2, f3 = _v4_bytes(vw)  # [row, wd, e] for byte m = o0 | o1 << 1
    x = _stack4(f0, f1, f2, f3)  # [row, wd, e, m]
    x = gl.reshape(x, [2, 8, 2, 2, 2, 2, 2, 2, 2])  # r8 g c1 o2 c0 h e o1 o0
    return _a_operands(gl.permute(x, [0, 1, 5, 2, 4, 6, 3, 7, 8]))


@gluon.jit
def _v2_codes(vw):
    """A operands of an m-tile from its 2-bit V words [16 rows, 8 wd]."""
    a0, a1 = _v2_byte(vw, 0)  # byte m = o1 | h << 1; field pair o0
    b0, b1 = _v2_byte(vw, 1)
    c0, c1 = _v2_byte(vw, 2)
    d0, d1 = _v2_byte(vw, 3)
    x = _stack8(a0, a1, b0, b1, c0, c1, d0, d1)  # [row, wd, e, (h, o1, o0)]
    x = gl.reshape(x, [2, 8, 2, 2, 2, 2, 2, 2, 2])  # r8 g c1 o2 c0 e h o1 o0
    return _a_operands(gl.permute(x, [0, 1, 6, 2, 4, 5, 3, 7, 8]))


@gluon.jit
def _pair_index(kp, O: gl.constexpr):
    """Pair ``i >> 1`` of group ``O`` at k pair ``kp = c0 | c1 << 1 | h << 2``: bits o0, o1, h,
    c0, o2, c1 from the lowest."""
    return (O & 3) | ((kp >> 2) << 2) | ((kp & 1) << 3) | ((O >> 2) << 4) | ((kp >> 1 & 1) << 5)


@gluon.jit
def _pair_word(p, PAIR: gl.constexpr, RW: gl.constexpr, dh):
    """Word offset of channel pair ``p`` in a per-channel fp16 field: with ``PAIR`` pairs 32 ..
    63 are the first 32 of the next head's record (``RW`` words on; ``dh`` 0 for the odd head
    out, which reads its own record twice)."""
    if PAIR:
        w = (p >> 5) * (dh * RW) + (p & 31)
    else:
        w = p
    return w


@gluon.jit
def _pairs_b(r32, OFF: gl.constexpr, O: gl.constexpr, PAIR: gl.constexpr = False,
             RW: gl.constexpr = 0, dh=0):  # fmt: skip
    """int32 channel pairs of group ``O`` at field offset ``OFF`` (bytes) as [kp, n] in
    ``_BP`` (the same pair for every column n)."""
    kp = gl.arange(0, 8, layout=gl.SliceLayout(1, _BP))
    p = _pair_index(kp, O)
    w = gl.load(r32 + OFF // 4 + _pair_word(p, PAIR, RW, dh))
    return gl.full([8, 8], 0, gl.int32, _BP) + w[:, None]


@gluon.jit
def _pairs_a(r32, OFF: gl.constexpr, O: gl.constexpr, PAIR: gl.constexpr = False,
             RW: gl.constexpr = 0, dh=0):  # fmt: skip
    """As :func:`_pairs_b`, as [row, kp] in ``_AP`` (the same pair for every row)."""
    kp = gl.arange(0, 8, layout=gl.SliceLayout(0, _AP))
    p = _pair_index(kp, O)
    w = gl.load(r32 + OFF // 4 + _pair_word(p, PAIR, RW, dh))
    return gl.full([16, 8], 0, gl.int32, _AP) + w[None, :]


@gluon.jit
def _pairs8(r32, OFF: gl.constexpr, PAIR: gl.constexpr = False, RW: gl.constexpr = 0, dh=0,
            AS_A: gl.constexpr = False):  # fmt: skip
    """:func:`_pairs_b` (or, ``AS_A``, :func:`_pairs_a`) of the eight groups."""
    if AS_A:
        r = (
            _pairs_a(r32, OFF, 0, PAIR, RW, dh),
            _pairs_a(r32, OFF, 1, PAIR, RW, dh),
            _pairs_a(r32, OFF, 2, PAIR, RW, dh),
            _pairs_a(r32, OFF, 3, PAIR, RW, dh),
            _pairs_a(r32, OFF, 4, PAIR, RW, dh),
            _pairs_a(r32, OFF, 5, PAIR, RW, dh),
            _pairs_a(r32, OFF, 6, PAIR, RW, dh),
            _pairs_a(r32, OFF, 7, PAIR, RW, dh),
        )
    else:
        r = (
            _pairs_b(r32, OFF, 0, PAIR, RW, dh),
            _pairs_b(r32, OFF, 1, PAIR, RW, dh),
            _pairs_b(r32, OFF, 2, PAIR, RW, dh),
            _pairs_b(r32, OFF, 3, PAIR, RW, dh),
            _pairs_b(r32, OFF, 4, PAIR, RW, dh),
            _pairs_b(r32, OFF, 5, PAIR, RW, dh),
            _pairs_b(r32, OFF, 6, PAIR, RW, dh),
            _pairs_b(r32, OFF, 7, PAIR, RW, dh),
        )
    return r


@gluon.jit
def _heads8(x0, x1, x2, x3, x4, x5, x6, x7, HEAD: gl.constexpr, KP_AXIS: gl.constexpr):
    """:func:`_head_only` of eight groups' pairs."""
    return (
        _head_only(x0, HEAD, KP_AXIS),
        _head_only(x1, HEAD, KP_AXIS),
        _head_only(x2, HEAD, KP_AXIS),
        _head_only(x3, HEAD, KP_AXIS),
        _head_only(x4, HEAD, KP_AXIS),
        _head_only(x5, HEAD, KP_AXIS),
        _head_only(x6, HEAD, KP_AXIS),
        _head_only(x7, HEAD, KP_AXIS),
    )


@gluon.jit
def _head_only(w, HEAD: gl.constexpr, KP_AXIS: gl.constexpr):
    """Channel pairs ``w`` ([kp, n] in ``_BP`` or [row, kp] in ``_AP``) with the other head's
    zeroed: with head pairs input channel bit 6 (``c1``, bit 1 of ``kp``) is the head, and
    ``P_128 = [[P_64, P_64], [P_64, -P_64]]``, so a product whose B operand (or zero-point row)
    keeps only head ``HEAD``'s rows is that head's ``x P_64`` in the first n-tile's columns:
    exact, no mixing of the two heads' values."""
    kp = gl.arange(0, 8, layout=gl.SliceLayout(1 - KP_AXIS, w.type.layout))
    keep = ((kp >> 1) & 1) == HEAD
    if KP_AXIS == 0:
        r = gl.where(keep[:, None], w, 0)
    else:
        r = gl.where(keep[None, :], w, 0)
    return r


@gluon.jit
def _sign_mask(NT: gl.constexpr):
    """int32 [kp, n] in ``_BP``: the fp16 sign bits of ``P_in`` for k positions ``2 kp + e``
    (e = 0 in bit 15, e = 1 in bit 31) and column n of n-tile ``NT``."""
    kp = gl.arange(0, 8, layout=gl.SliceLayout(1, _BP))[:, None]
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, _BP))[None, :]
    # i_in bits: e -> 0, h -> 3, c0 -> 4, c1 -> 6; j_in bits: n & 1 -> 0, n >> 1 -> 3, 4, NT -> 6
    s0 = ((kp >> 2) & (n >> 1)) ^ ((kp & 1) & (n >> 2)) ^ ((kp >> 1 & 1) & NT)
    s0 = s0 & 1
    s1 = s0 ^ (n & 1)
    return (s0 << 15) | (s1 << 31)


@gluon.jit
def _as_opb(w, mask):
    x = gl.permute(_halves(w, mask), [0, 2, 1])  # [kp, e, n]
    return gl.convert_layout(gl.reshape(x, [16, 8]), _OPB, assert_trivial=True)


@gluon.jit
def _wht8(z0, z1, z2, z3, z4, z5, z6, z7):
    """8-point Walsh-Hadamard transform (Sylvester order) of eight tensors."""
    a0 = z0 + z1
    a1 = z0 - z1
    a2 = z2 + z3
    a3 = z2 - z3
    a4 = z4 + z5
    a5 = z4 - z5
    a6 = z6 + z7
    a7 = z6 - z7
    b0 = a0 + a2
    b1 = a1 + a3
    b2 = a0 - a2
    b3 = a1 - a3
    b4 = a4 + a6
    b5 = a5 + a7
    b6 = a4 - a6
    b7 = a5 - a7
    return b0 + b4, b1 + b5, b2 + b6, b3 + b7, b0 - b4, b1 - b5, b2 - b6, b3 - b7


@gluon.jit
def _mma8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """The eight group products, transformed: eight [16, 8] fp32 in ``_MMA``."""
    z = gl.full([16, 8], 0.0, gl.float32, _MMA)
    return _wht8(
        mma_v2(a0, b0, z),
        mma_v2(a1, b1, z),
        mma_v2(a2, b2, z),
        mma_v2(a3, b3, z),
        mma_v2(a4, b4, z),
        mma_v2(a5, b5, z),
        mma_v2(a6, b6, z),
        mma_v2(a7, b7, z),
    )


@gluon.jit
def _mma8x2(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
            c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7):  # fmt: skip
    """Head_dim 256: the eight group products of both 128-channel input halves (``a`` with
    ``b``, ``c`` with ``d``) summed in one accumulator each, transformed."""
    z = gl.full([16, 8], 0.0, gl.float32, _MMA)
    return _wht8(
        mma_v2(c0, d0, mma_v2(a0, b0, z)),
        mma_v2(c1, d1, mma_v2(a1, b1, z)),
        mma_v2(c2, d2, mma_v2(a2, b2, z)),
        mma_v2(c3, d3, mma_v2(a3, b3, z)),
        mma_v2(c4, d4, mma_v2(a4, b4, z)),
        mma_v2(c5, d5, mma_v2(a5, b5, z)),
        mma_v2(c6, d6, mma_v2(a6, b6, z)),
        mma_v2(c7, d7, mma_v2(a7, b7, z)),
    )


@gluon.jit
def _row_vec(y):
    """A [16, 8] tensor whose rows are all equal -> its row as [8] in ``_COLS``."""
    return gl.max(y, axis=0)


@gluon.jit
def _store_tile(y0, y1, y2, y3, y4, y5, y6, y7, out_ptr, orow, ok, COL0: gl.constexpr):
    """Store eight transformed [16, 8] results (already scaled) of an n-tile: column ``n = 2 cc
    + e'`` of group ``o'`` is channel ``COL0 + e' + 2 o0' + 4 o1' + 8 cc + 32 o2'`` of the row
    (``COL0 = 64 NT``; head pairs 0, each head's own rows; head_dim 256 ``128 ob + 64 NT``)."""
    x = _stack8(y0, y1, y2, y3, y4, y5, y6, y7)  # [row, n, o'] with o' = o0 | o1 << 1 | o2 << 2
    x = gl.reshape(x, [16, 4, 2, 2, 2, 2])  # row cc e' o2 o1 o0
    x = gl.reshape(gl.permute(x, [0, 3, 1, 4, 5, 2]), [16, 64])
    x = gl.convert_layout(x.to(out_ptr.dtype.element_ty), _OUT, assert_trivial=True)
    ch = gl.arange(0, 64, layout=gl.SliceLayout(0, _OUT))
    gl.store(out_ptr + orow[:, None] + (COL0 + ch)[None, :], x, mask=ok[:, None])


@gluon.jit
def _out_rows(start, total_rows, H, head, MT: gl.constexpr, D: gl.constexpr = 128):
    """Element offsets of the rows (and their validity) of m-tile ``MT``, in ``_OUT``'s rows and
    in ``_ROWS`` (row g + 8 r8 is token 8 g + 2 MT + r8 of the half)."""
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, _OUT))
    row = start + (r & 7) * 8 + 2 * MT + (r >> 3)
    ok = (row >= 0) & (row < total_rows)
    row = gl.where(ok, row, 0)
    return (row * H + head) * D, ok


# a lane's 8 tokens of a 64-token half ([g, token 8 g + j]): one 16-byte load per field
_TOK: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]],
    lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[8, 8],
)


@gluon.jit
def _tok_rows(x):
    """[g, r8] -> [16] in ``_ROWS`` (row g + 8 r8)."""
    return gl.convert_layout(gl.reshape(gl.permute(x, [1, 0]), [16]), _ROWS, assert_trivial=True)


@gluon.jit
def _tok4(r16, OFF: gl.constexpr, t0, scale):
    """fp16 field at ``OFF`` (bytes) of the half's tokens from ``t0``, times ``scale``, as the
    four m-tiles' fp32 [16] in ``_ROWS`` (row g + 8 r8 of m-tile mt: token 8 g + 2 mt + r8)."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, _TOK))
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, _TOK))
    x = gl.load(r16 + OFF // 2 + t0 + g[:, None] * 8 + j[None, :]).to(gl.float32) * scale
    x = gl.reshape(x, [8, 2, 2, 2])  # g mt1 mt0 r8
    a, b = gl.split(gl.permute(x, [0, 3, 1, 2]))  # mt0
    x0, x2 = gl.split(a)  # mt1
    x1, x3 = gl.split(b)
    return _tok_rows(x0), _tok_rows(x1), _tok_rows(x2), _tok_rows(x3)


@gluon.jit
def _v_words(r32, CODES_OFF: gl.constexpr, t0, MT: gl.constexpr, BITS: gl.constexpr,
             PAIR: gl.constexpr = False, RW: gl.constexpr = 0, dh=0, TS: gl.constexpr = 0,
             W0: gl.constexpr = 0):  # fmt: skip
    """The V code words of m-tile ``MT`` of the half from token ``t0``: [16 rows, 16 or 8]
    (word ``wd`` holds channels ``wd * 32 / BITS ..``; with ``PAIR`` its top bit is the
    head). ``TS``: words a token (default 128 channels'), ``W0``: the first word (head_dim
    256: 0 or ``4 BITS`` for the two 128-channel halves)."""
    if BITS == 4:
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, _VW4))
        wd = gl.arange(0, 16, layout=gl.SliceLayout(0, _VW4))
    else:
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, _VW2))
        wd = gl.arange(0, 8, layout=gl.SliceLayout(0, _VW2))
    t = t0 + (r & 7) * 8 + 2 * MT + (r >> 3)
    if PAIR:
        WT: gl.constexpr = 2 * BITS  # words a token at 64 channels
        col = (wd // WT) * (dh * RW) + (wd % WT)
        return gl.load(r32 + CODES_OFF // 4 + t[:, None] * WT + col[None, :])
    else:
        TSW: gl.constexpr = 4 * BITS if TS == 0 else TS
        return gl.load(r32 + CODES_OFF // 4 + W0 + t[:, None] * TSW + wd[None, :])


@gluon.jit
def _as_opa_pairs(w, mask):
    x = _halves(w, mask)  # [row, kp, e]
    return gl.convert_layout(gl.reshape(x, [16, 16]), _OPA, assert_trivial=True)


@gluon.jit
def _epilogue(y, vec, srow, zrow, IS_K: gl.constexpr):
    """K: ``s_row (y + zp^T P)``; V: ``s_row y + zp s_col^T P`` (both already over sqrt(D))."""
    if IS_K:
        r = (y + vec[None, :]) * srow[:, None]
    else:
        r = y * srow[:, None] + zrow[:, None] * vec[None, :]
    return r


@gluon.jit
def _finish(y0, y1, y2, y3, y4, y5, y6, y7, vsm, VI: gl.constexpr, srow, zrow, out_ptr, orow, ok,
            IS_K: gl.constexpr, COL0: gl.constexpr):  # fmt: skip
    """An n-tile's eight transformed products through the epilogue (the tile's vectors ``VI``
    from ``vsm``, the rows' scales) into the output at channel ``COL0``."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _load_vecs(vsm, VI)
    _store_tile(
        _epilogue(y0, v0, srow, zrow, IS_K),
        _epilogue(y1, v1, srow, zrow, IS_K),
        _epilogue(y2, v2, srow, zrow, IS_K),
        _epilogue(y3, v3, srow, zrow, IS_K),
        _epilogue(y4, v4, srow, zrow, IS_K),
        _epilogue(y5, v5, srow, zrow, IS_K),
        _epilogue(y6, v6, srow, zrow, IS_K),
        _epilogue(y7, v7, srow, zrow, IS_K),
        out_ptr,
        orow,
        ok,
        COL0,
    )


@gluon.jit
def _ntile(
    a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, mask, vsm,
    srow, zrow, out_ptr, orow, ok, IS_K: gl.constexpr, NT: gl.constexpr, VI: gl.constexpr,
):  # fmt: skip
    """n-tile ``NT`` of an m-tile: B operands ``diag(s_col) P_in`` built from the scale pairs
    ``s_o`` and the n-tile's sign mask (one ``xor`` per register), the eight products, the
    transform, the epilogue with the tile's vectors ``VI`` (``vsm``, shared memory), the
    stores."""
    y0, y1, y2, y3, y4, y5, y6, y7 = _mma8(
        a0, a1, a2, a3, a4, a5, a6, a7,
        _as_opb(s0, mask), _as_opb(s1, mask), _as_opb(s2, mask), _as_opb(s3, mask),
        _as_opb(s4, mask), _as_opb(s5, mask), _as_opb(s6, mask), _as_opb(s7, mask),
    )  # fmt: skip
    _finish(y0, y1, y2, y3, y4, y5, y6, y7, vsm, VI, srow, zrow, out_ptr, orow, ok, IS_K,
            64 * NT)  # fmt: skip


@gluon.jit
def _store_vecs(vsm, NT: gl.constexpr, y0, y1, y2, y3, y4, y5, y6, y7):
    """Rows of eight transformed [16, 8] results whose rows are all equal, into ``vsm``
    [n-tile, o', column] (one store)."""
    v = _stack8(_row_vec(y0), _row_vec(y1), _row_vec(y2), _row_vec(y3),
                _row_vec(y4), _row_vec(y5), _row_vec(y6), _row_vec(y7))  # fmt: skip
    vsm.index(NT).store(gl.convert_layout(gl.permute(v, [1, 0]), _VEC8, assert_trivial=True))


@gluon.jit
def _load_vecs(vsm, NT: gl.constexpr):
    v = gl.reshape(gl.permute(vsm.index(NT).load(_VEC8), [1, 0]), [8, 2, 2, 2])
    v0, v1, v2, v3, v4, v5, v6, v7 = _split8(v)
    return (
        gl.convert_layout(v0, _COLS, assert_trivial=True),
        gl.convert_layout(v1, _COLS, assert_trivial=True),
        gl.convert_layout(v2, _COLS, assert_trivial=True),
        gl.convert_layout(v3, _COLS, assert_trivial=True),
        gl.convert_layout(v4, _COLS, assert_trivial=True),
        gl.convert_layout(v5, _COLS, assert_trivial=True),
        gl.convert_layout(v6, _COLS, assert_trivial=True),
        gl.convert_layout(v7, _COLS, assert_trivial=True),
    )


@gluon.jit
def _k_words(r32, r16, CODES_OFF: gl.constexpr, G: gl.constexpr, half, KB: gl.constexpr = 4,
             PAIR: gl.constexpr = False, REC: gl.constexpr = 0, dh=0):  # fmt: skip
    """K codes of a 64-token half as channel pairs (ka: even channel, kb: odd) [64, 8]: lane
    entry ``w`` holds tokens ``8 w .. 8 w + 7`` of the half, a 32-bit word at 4 bits, a 16-bit
    run (zero-extended) at 2 bits. With ``PAIR`` channels 64 .. 127 are the next head's."""
    ci = gl.arange(0, 128, layout=gl.SliceLayout(1, _KW))
    wi = gl.arange(0, 8, layout=gl.SliceLayout(0, _KW))
    if KB == 2:
        hpc: gl.constexpr = G // 8  # 16-bit runs a channel
        if PAIR:
            cw = (ci >> 6) * (dh * (REC // 2)) + (ci & 63) * hpc
        else:
            cw = ci * hpc
        h16 = gl.load(r16 + CODES_OFF // 2 + cw[:, None] + (8 * half + wi)[None, :])
        kw = h16.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    else:
        wpc: gl.constexpr = G // 8  # words a channel
        if PAIR:
            cw = (ci >> 6) * (dh * (REC // 4)) + (ci & 63) * wpc
        else:
            cw = ci * wpc
        kw = gl.load(r32 + CODES_OFF // 4 + cw[:, None] + (8 * half + wi)[None, :])
    return gl.split(gl.permute(gl.reshape(kw, [64, 2, 8]), [0, 2, 1]))


@gluon.jit
def _pick4(MT: gl.constexpr, x0, x1, x2, x3):
    """``x_MT`` (a constexpr choice among values held for the four m-tiles)."""
    if MT == 0:
        x = x0
    elif MT == 1:
        x = x1
    elif MT == 2:
        x = x2
    else:
        x = x3
    return x


@gluon.jit
def _vectors(vsm, VI: gl.constexpr, r32, IS_K: gl.constexpr, m0, s0, s1, s2, s3, s4, s5, s6, s7,
             ZP_OFF: gl.constexpr, PAIR: gl.constexpr, RW: gl.constexpr, dh,
             HEAD: gl.constexpr):  # fmt: skip
    """The per-tile vectors into ``vsm[VI]`` (``m0``: the sign mask of the n-tile, ``s_o``: the
    column-scale pairs, already restricted to head ``HEAD`` with ``PAIR``): K ``zp^T P`` (the
    zero points, every row alike, times the signs), V ``s_col^T P`` (a ones row times
    ``diag(s_col) P_in``), transformed."""
    if IS_K:
        g0 = _as_opb(gl.full([8, 8], 0x3C003C00, gl.int32, _BP), m0)
        zm = gl.full([16, 8], 0, gl.int32, _AP)
        z0, z1, z2, z3, z4, z5, z6, z7 = _pairs8(r32, ZP_OFF, PAIR, RW, dh, True)
        if PAIR:
            z0, z1, z2, z3, z4, z5, z6, z7 = _heads8(z0, z1, z2, z3, z4, z5, z6, z7, HEAD, 1)
        y0, y1, y2, y3, y4, y5, y6, y7 = _mma8(
            _as_opa_pairs(z0, zm), _as_opa_pairs(z1, zm), _as_opa_pairs(z2, zm),
            _as_opa_pairs(z3, zm), _as_opa_pairs(z4, zm), _as_opa_pairs(z5, zm),
            _as_opa_pairs(z6, zm), _as_opa_pairs(z7, zm),
            g0, g0, g0, g0, g0, g0, g0, g0,
        )  # fmt: skip
    else:
        e = gl.full([16, 16], 1.0, gl.float16, _OPA)
        y0, y1, y2, y3, y4, y5, y6, y7 = _mma8(
            e, e, e, e, e, e, e, e,
            _as_opb(s0, m0), _as_opb(s1, m0), _as_opb(s2, m0), _as_opb(s3, m0),
            _as_opb(s4, m0), _as_opb(s5, m0), _as_opb(s6, m0), _as_opb(s7, m0),
        )  # fmt: skip
    _store_vecs(vsm, VI, y0, y1, y2, y3, y4, y5, y6, y7)


@gluon.jit
def _tile(
    r32, r16, out_ptr, start, half, total_rows, H, head,
    IS_K: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr, CODES_OFF: gl.constexpr,
    COL_OFF: gl.constexpr, ZP_OFF: gl.constexpr, ROW_OFF: gl.constexpr,
    PAIR: gl.constexpr = False, REC: gl.constexpr = 0, dh=0,
):  # fmt: skip
    """Dequantize the 64-token half ``half`` of one record's K or V tile, rotate it back,
    store it (rows from ``start``). With ``PAIR`` (head_dim 64): the records of heads
    ``head`` and ``head + dh`` as one 128-channel input, each head's output from the first
    n-tile's products with the B operands restricted to its channels (:func:`_head_only`)."""
    RW: gl.constexpr = REC // 4
    m0 = _sign_mask(0)
    m1 = _sign_mask(1)
    s0, s1, s2, s3, s4, s5, s6, s7 = _pairs8(r32, COL_OFF, PAIR, RW, dh)
    # every load is issued before the first store (the compiler does not move loads across
    # stores through another pointer) and before the per-tile vectors are computed
    t0 = 64 * half
    D: gl.constexpr = 64 if PAIR else 128
    INV: gl.constexpr = 0.125 if PAIR else _INV_SQRT_D  # 1 / sqrt(D)
    r16b = r16 + dh * (REC // 2)  # head pairs: the second head's record (dh 0 otherwise)
    sr0, sr1, sr2, sr3 = _tok4(r16, ROW_OFF, t0, INV)
    if PAIR:
        sb0, sb1, sb2, sb3 = _tok4(r16b, ROW_OFF, t0, INV)
    if IS_K:
        ka, kb = _k_words(r32, r16, CODES_OFF, G, half, BITS, PAIR, REC, dh)
    else:
        zr0, zr1, zr2, zr3 = _tok4(r16, ZP_OFF, t0, INV)
        if PAIR:
            zb0, zb1, zb2, zb3 = _tok4(r16b, ZP_OFF, t0, INV)
        vw0 = _v_words(r32, CODES_OFF, t0, 0, BITS, PAIR, RW, dh)
        vw1 = _v_words(r32, CODES_OFF, t0, 1, BITS, PAIR, RW, dh)
        vw2 = _v_words(r32, CODES_OFF, t0, 2, BITS, PAIR, RW, dh)
        vw3 = _v_words(r32, CODES_OFF, t0, 3, BITS, PAIR, RW, dh)
    # per-tile vectors by column, [n-tile (or head) * 8 + o', 8 columns] fp32 in shared memory
    vsm = gl.allocate_shared_memory(gl.float32, [2, 8, 8], _VSM)
    if PAIR:
        # head b's column scales: pairs of its channels only (B operands of its n-tile)
        t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_ = _heads8(s0, s1, s2, s3, s4, s5, s6, s7, 1, 0)
        s0, s1, s2, s3, s4, s5, s6, s7 = _heads8(s0, s1, s2, s3, s4, s5, s6, s7, 0, 0)
        _vectors(vsm, 0, r32, IS_K, m0, s0, s1, s2, s3, s4, s5, s6, s7, ZP_OFF, PAIR, RW, dh, 0)
        _vectors(vsm, 1, r32, IS_K, m0, t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_, ZP_OFF, PAIR,
                 RW, dh, 1)  # fmt: skip
    else:
        _vectors(vsm, 0, r32, IS_K, m0, s0, s1, s2, s3, s4, s5, s6, s7, ZP_OFF, PAIR, RW, dh, 0)
        _vectors(vsm, 1, r32, IS_K, m1, s0, s1, s2, s3, s4, s5, s6, s7, ZP_OFF, PAIR, RW, dh, 0)
    gl.thread_barrier()
    for mt in gl.static_range(4):
        srow = _pick4(mt, sr0, sr1, sr2, sr3)
        if IS_K:
            zrow = srow
            a0, a1, a2, a3, a4, a5, a6, a7 = _k_codes(ka, kb, mt, BITS)
        else:
            zrow = _pick4(mt, zr0, zr1, zr2, zr3)
            vw = _pick4(mt, vw0, vw1, vw2, vw3)
            if BITS == 4:
                a0, a1, a2, a3, a4, a5, a6, a7 = _v4_codes(vw)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = _v2_codes(vw)
        orow, ok = _out_rows(start, total_rows, H, head, mt, D)
        _ntile(a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, m0, vsm,
               srow, zrow, out_ptr, orow, ok, IS_K, 0, 0)  # fmt: skip
        if PAIR:
            srow_b = _pick4(mt, sb0, sb1, sb2, sb3)
            if IS_K:
                zrow_b = srow_b
            else:
                zrow_b = _pick4(mt, zb0, zb1, zb2, zb3)
            orow_b, ok_b = _out_rows(start, total_rows, H, head + dh, mt, D)
            _ntile(a0, a1, a2, a3, a4, a5, a6, a7, t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_, m0,
                   vsm, srow_b, zrow_b, out_ptr, orow_b, ok_b & (dh > 0), IS_K, 0, 1)  # fmt: skip
        else:
            _ntile(a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, m1, vsm,
                   srow, zrow, out_ptr, orow, ok, IS_K, 1, 1)  # fmt: skip


_FLIP: gl.constexpr = gl.constexpr(-2147450880)  # 0x80008000 as int32: both fp16 signs


@gluon.jit
def _ntile256(
    a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
    r32, COL_OFF: gl.constexpr, mask, mask_hi, vsm,
    srow, zrow, out_ptr, orow, ok, IS_K: gl.constexpr, VI: gl.constexpr, COL0: gl.constexpr,
):  # fmt: skip
    """Head_dim 256, one (output half, n-tile): the products of input half 0 (codes ``a``,
    column-scale pairs from ``COL_OFF``, sign mask ``mask``) and of input half 1 (``c``, the
    pairs 256 bytes on, ``mask_hi``: the same signs, negated for the second output half) in
    one accumulator per group, the transform, the epilogue with vectors ``VI``, the stores at
    channel ``COL0``. The scale pairs are loaded here (L1 hits after the first n-tile): kept
    in registers across the n-tiles they spilled."""
    HB: gl.constexpr = 256
    y0, y1, y2, y3, y4, y5, y6, y7 = _mma8x2(
        a0, a1, a2, a3, a4, a5, a6, a7,
        _as_opb(_pairs_b(r32, COL_OFF, 0), mask), _as_opb(_pairs_b(r32, COL_OFF, 1), mask),
        _as_opb(_pairs_b(r32, COL_OFF, 2), mask), _as_opb(_pairs_b(r32, COL_OFF, 3), mask),
        _as_opb(_pairs_b(r32, COL_OFF, 4), mask), _as_opb(_pairs_b(r32, COL_OFF, 5), mask),
        _as_opb(_pairs_b(r32, COL_OFF, 6), mask), _as_opb(_pairs_b(r32, COL_OFF, 7), mask),
        c0, c1, c2, c3, c4, c5, c6, c7,
        _as_opb(_pairs_b(r32, COL_OFF + HB, 0), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 1), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 2), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 3), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 4), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 5), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 6), mask_hi),
        _as_opb(_pairs_b(r32, COL_OFF + HB, 7), mask_hi),
    )  # fmt: skip
    _finish(y0, y1, y2, y3, y4, y5, y6, y7, vsm, VI, srow, zrow, out_ptr, orow, ok, IS_K,
            COL0)  # fmt: skip


@gluon.jit
def _vectors256(vsm, VI: gl.constexpr, mask, mask_hi, s0, s1, s2, s3, s4, s5, s6, s7,
                u0, u1, u2, u3, u4, u5, u6, u7):  # fmt: skip
    """Head_dim 256: the per-tile vector of one (output half, n-tile) into ``vsm[VI]``: a ones
    row times ``diag(x) P_256`` for the channel pairs ``s`` (first half, signs ``mask``) and
    ``u`` (second half, ``mask_hi``): K ``zp^T P`` from the zero points, V ``s_col^T P`` from
    the column scales (at head_dim 128 the K vector takes the zero points as A operands; here
    B operands hold them in a quarter of the registers)."""
    e = gl.full([16, 16], 1.0, gl.float16, _OPA)
    y0, y1, y2, y3, y4, y5, y6, y7 = _mma8x2(
        e, e, e, e, e, e, e, e,
        _as_opb(s0, mask), _as_opb(s1, mask), _as_opb(s2, mask), _as_opb(s3, mask),
        _as_opb(s4, mask), _as_opb(s5, mask), _as_opb(s6, mask), _as_opb(s7, mask),
        e, e, e, e, e, e, e, e,
        _as_opb(u0, mask_hi), _as_opb(u1, mask_hi), _as_opb(u2, mask_hi),
        _as_opb(u3, mask_hi), _as_opb(u4, mask_hi), _as_opb(u5, mask_hi),
        _as_opb(u6, mask_hi), _as_opb(u7, mask_hi),
    )  # fmt: skip
    _store_vecs(vsm, VI, y0, y1, y2, y3, y4, y5, y6, y7)


@gluon.jit
def _v_codes_of(vw, BITS: gl.constexpr):
    if BITS == 4:
        a0, a1, a2, a3, a4, a5, a6, a7 = _v4_codes(vw)
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = _v2_codes(vw)
    return a0, a1, a2, a3, a4, a5, a6, a7


@gluon.jit
def _load_pair256(r32, r16, half, IS_K: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr,
                  CODES_OFF: gl.constexpr, MP: gl.constexpr):  # fmt: skip
    """Head_dim 256: the codes of m-tiles ``2 MP`` and ``2 MP + 1`` of the half (32 tokens) of
    both input halves: K the 16-bit halves of the 4-bit words or the bytes of the 2-bit runs
    (:func:`_k_runs`: channel pairs ``a, b`` of the first half, ``c, d`` of the second), V
    the two m-tiles' rows of each half."""
    t0 = 64 * half
    if IS_K:
        CB: gl.constexpr = 128 * G * BITS // 8  # code bytes of 128 channels
        x0, x1 = _k_runs(r16, CODES_OFF, G, half, BITS, MP)
        x2, x3 = _k_runs(r16, CODES_OFF + CB, G, half, BITS, MP)
    else:
        TS: gl.constexpr = 8 * BITS  # words a token
        W1: gl.constexpr = 4 * BITS  # first word of the second half
        x0 = _v_words(r32, CODES_OFF, t0, 2 * MP, BITS, False, 0, 0, TS, 0)
        x1 = _v_words(r32, CODES_OFF, t0, 2 * MP, BITS, False, 0, 0, TS, W1)
        x2 = _v_words(r32, CODES_OFF, t0, 2 * MP + 1, BITS, False, 0, 0, TS, 0)
        x3 = _v_words(r32, CODES_OFF, t0, 2 * MP + 1, BITS, False, 0, 0, TS, W1)
    return x0, x1, x2, x3


@gluon.jit
def _pair256(r32, out_ptr, start, total_rows, H, head, vsm, m0, m1,
             sr0, sr1, sr2, sr3, zr0, zr1, zr2, zr3, x0, x1, x2, x3,
             IS_K: gl.constexpr, BITS: gl.constexpr, COL_OFF: gl.constexpr,
             MP: gl.constexpr):  # fmt: skip
    """Head_dim 256: m-tiles ``2 MP`` and ``2 MP + 1`` of the half from their codes
    (:func:`_load_pair256`), unpacked once for the four output n-tiles
    (:func:`_ntile256`)."""
    for ml in gl.static_range(2):
        srow = _pick4(2 * MP + ml, sr0, sr1, sr2, sr3)
        if IS_K:
            zrow = srow
            a0, a1, a2, a3, a4, a5, a6, a7 = _k_codes_local(x0, x1, ml, BITS)
            c0, c1, c2, c3, c4, c5, c6, c7 = _k_codes_local(x2, x3, ml, BITS)
        else:
            zrow = _pick4(2 * MP + ml, zr0, zr1, zr2, zr3)
            if ml == 0:
                a0, a1, a2, a3, a4, a5, a6, a7 = _v_codes_of(x0, BITS)
                c0, c1, c2, c3, c4, c5, c6, c7 = _v_codes_of(x1, BITS)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = _v_codes_of(x2, BITS)
                c0, c1, c2, c3, c4, c5, c6, c7 = _v_codes_of(x3, BITS)
        orow, ok = _out_rows(start, total_rows, H, head, 2 * MP + ml, 256)
        for k in gl.static_range(4):  # k = 2 ob + nt
            if k % 2 == 0:
                mk = m0
            else:
                mk = m1
            if k >= 2:
                mh = mk ^ _FLIP
            else:
                mh = mk
            _ntile256(a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
                      r32, COL_OFF, mk, mh, vsm, srow, zrow, out_ptr, orow, ok, IS_K, k,
                      128 * (k // 2) + 64 * (k % 2))  # fmt: skip


@gluon.jit
def _tile256(
    r32, r16, out_ptr, start, half, total_rows, H, head,
    IS_K: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr, CODES_OFF: gl.constexpr,
    COL_OFF: gl.constexpr, ZP_OFF: gl.constexpr, ROW_OFF: gl.constexpr, MP: gl.constexpr,
    MPS: gl.constexpr = 1,
):  # fmt: skip
    """Head_dim 256 (``P_256 = [[P_128, P_128], [P_128, -P_128]]`` over channel bit 7): the
    two 128-channel input halves of the tile are unpacked as at head_dim 128 (codes, scale
    pairs), and every output n-tile of output half ``ob`` is the sum of both halves'
    products, the second half's B operands sign-flipped for ``ob = 1`` (one accumulator per
    group: 32 products per n-tile instead of 16, twice the 128-channel kernel's per output
    element, nothing through shared memory but the per-tile vectors). The codes are taken
    32 tokens at a time (m-tiles ``2 MP``, ``2 MP + 1``, then the next ``MPS - 1`` pairs):
    both halves of a 64-token tile's codes and scales at once do not fit the registers (about
    1 KB of spill offline)."""
    m0 = _sign_mask(0)
    m1 = _sign_mask(1)
    HB: gl.constexpr = 256  # bytes of 128 fp16 channel values
    p0, p1, p2, p3 = _load_pair256(r32, r16, half, IS_K, BITS, G, CODES_OFF, MP)
    t0 = 64 * half
    INV: gl.constexpr = 0.0625  # 1 / sqrt(256)
    sr0, sr1, sr2, sr3 = _tok4(r16, ROW_OFF, t0, INV)
    VEC_OFF: gl.constexpr = ZP_OFF if IS_K else COL_OFF  # zero points (K), col scales (V)
    if IS_K:
        zr0, zr1, zr2, zr3 = sr0, sr1, sr2, sr3
    else:
        zr0, zr1, zr2, zr3 = _tok4(r16, ZP_OFF, t0, INV)
    z0, z1, z2, z3, z4, z5, z6, z7 = _pairs8(r32, VEC_OFF)
    w0, w1, w2, w3, w4, w5, w6, w7 = _pairs8(r32, VEC_OFF + HB)
    m0h = m0 ^ _FLIP
    m1h = m1 ^ _FLIP
    # per-tile vectors of (output half ob, n-tile nt) at 2 ob + nt: a ones row times diag(x)
    # P_256, x the zero points (K) or the column scales (V)
    vsm = gl.allocate_shared_memory(gl.float32, [4, 8, 8], _VSM)
    _vectors256(vsm, 0, m0, m0, z0, z1, z2, z3, z4, z5, z6, z7, w0, w1, w2, w3, w4, w5, w6, w7)
    _vectors256(vsm, 1, m1, m1, z0, z1, z2, z3, z4, z5, z6, z7, w0, w1, w2, w3, w4, w5, w6, w7)
    _vectors256(vsm, 2, m0, m0h, z0, z1, z2, z3, z4, z5, z6, z7, w0, w1, w2, w3, w4, w5, w6, w7)
    _vectors256(vsm, 3, m1, m1h, z0, z1, z2, z3, z4, z5, z6, z7, w0, w1, w2, w3, w4, w5, w6, w7)
    gl.thread_barrier()
    if MPS == 2:
        # the second pair's codes before the first pair's stores: loads do not move across
        # stores, and issued after them the second pair waited for its codes (3-8% slower on
        # an H100, run 126); a small spill frame is the cost (88-112 B offline)
        y0, y1, y2, y3 = _load_pair256(r32, r16, half, IS_K, BITS, G, CODES_OFF, MP + 1)
    _pair256(r32, out_ptr, start, total_rows, H, head, vsm, m0, m1,
             sr0, sr1, sr2, sr3, zr0, zr1, zr2, zr3, p0, p1, p2, p3, IS_K, BITS, COL_OFF,
             MP)  # fmt: skip
    if MPS == 2:
        _pair256(r32, out_ptr, start, total_rows, H, head, vsm, m0, m1,
                 sr0, sr1, sr2, sr3, zr0, zr1, zr2, zr3, y0, y1, y2, y3, IS_K, BITS, COL_OFF,
                 MP + 1)  # fmt: skip


@gluon.jit
def mma_materialize_kernel(
    rec16_ptr,
    rec32_ptr,
    block_table_ptr,
    seq_lens_ptr,
    cu_ptr,
    k_out_ptr,
    v_out_ptr,
    num_blocks,
    total_rows,
    max_blocks,
    H,
    G: gl.constexpr,
    REC: gl.constexpr,
    VB: gl.constexpr,
    KC_OFF: gl.constexpr,
    KS_OFF: gl.constexpr,
    KZ_OFF: gl.constexpr,
    KR_OFF: gl.constexpr,
    VC_OFF: gl.constexpr,
    VS_OFF: gl.constexpr,
    VR_OFF: gl.constexpr,
    VZ_OFF: gl.constexpr,
    KB: gl.constexpr = 4,
    PAIR: gl.constexpr = False,
    D: gl.constexpr = 128,
    MPS: gl.constexpr = 1,
):
    """Grid ``(B * max_blocks * G / 64, Hkv, 2)``, one warp: 64-token half
    ``program_id(0) % (G / 64)`` of full block ``program_id(0) / (G / 64) % max_blocks`` of
    request ``program_id(0) / (max_blocks * G / 64)``, KV head ``program_id(1)``, K (0) or V
    (1). With ``PAIR`` (head_dim 64) the grid's second size is ``ceil(Hkv / 2)`` and program
    ``j`` takes KV heads ``2 j`` and ``2 j + 1``. At ``D`` 256 the third size is 4: K or V
    (``program_id(2) % 2``) and the half-block's tokens 0-31 or 32-63 (``program_id(2) //
    2``). Programs past a request's full blocks, and those whose block-table entry is out of
    range, write nothing."""
    pid = gl.program_id(0)
    pid2 = gl.program_id(2)
    kv = pid2 % 2
    if PAIR:
        head = 2 * gl.program_id(1)
        dh = gl.minimum(head + 1, H - 1) - head  # 0: the odd head out reads its record twice
    else:
        head = gl.program_id(1)
        dh = head - head
    HALVES: gl.constexpr = G // 64
    half = pid % HALVES
    req = pid // (HALVES * max_blocks)
    blk = (pid // HALVES) % max_blocks
    seq_len = gl.load(seq_lens_ptr + req)
    if blk >= seq_len // G:
        return
    phys = gl.load(block_table_ptr + req.to(gl.int64) * max_blocks + blk).to(gl.int64)
    if (phys < 0) | (phys >= num_blocks):
        return
    rbase = phys * H + head
    r32 = rec32_ptr + rbase * (REC // 4)
    r16 = rec16_ptr + rbase * (REC // 2)
    start = gl.load(cu_ptr + req).to(gl.int64) + blk * G + 64 * half
    if D == 256 and MPS == 2:
        # the whole 64-token half, its two pairs of m-tiles one after the other
        if kv == 0:
            _tile256(r32, r16, k_out_ptr, start, half, total_rows, H, head,
                     True, KB, G, KC_OFF, KS_OFF, KZ_OFF, KR_OFF, 0, 2)  # fmt: skip
        else:
            _tile256(r32, r16, v_out_ptr, start, half, total_rows, H, head,
                     False, VB, G, VC_OFF, VS_OFF, VZ_OFF, VR_OFF, 0, 2)  # fmt: skip
    elif D == 256:
        # grid's third size 4: K or V, then the pair of m-tiles
        if pid2 == 0:
            _tile256(r32, r16, k_out_ptr, start, half, total_rows, H, head,
                     True, KB, G, KC_OFF, KS_OFF, KZ_OFF, KR_OFF, 0)  # fmt: skip
        elif pid2 == 2:
            _tile256(r32, r16, k_out_ptr, start, half, total_rows, H, head,
                     True, KB, G, KC_OFF, KS_OFF, KZ_OFF, KR_OFF, 1)  # fmt: skip
        elif pid2 == 1:
            _tile256(r32, r16, v_out_ptr, start, half, total_rows, H, head,
                     False, VB, G, VC_OFF, VS_OFF, VZ_OFF, VR_OFF, 0)  # fmt: skip
        else:
            _tile256(r32, r16, v_out_ptr, start, half, total_rows, H, head,
                     False, VB, G, VC_OFF, VS_OFF, VZ_OFF, VR_OFF, 1)  # fmt: skip
    elif kv == 0:
        _tile(r32, r16, k_out_ptr, start, half, total_rows, H, head,
              True, KB, G, KC_OFF, KS_OFF, KZ_OFF, KR_OFF, PAIR, REC, dh)  # fmt: skip
    else:
        _tile(r32, r16, v_out_ptr, start, half, total_rows, H, head,
              False, VB, G, VC_OFF, VS_OFF, VZ_OFF, VR_OFF, PAIR, REC, dh)  # fmt: skip
