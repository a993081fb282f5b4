"""Small @triton.jit helpers shared by the dense KVarN kernels, and two launcher checks.

Everything here runs both compiled and under ``TRITON_INTERPRET=1``: no inline asm, no
libdevice, fp32 arithmetic only (the interpreter gets bf16 arithmetic and bf16 ``tl.dot``
wrong, so callers upcast right after loading).

Jit helpers
-----------
``pow2(n)``                 exact ``2.0**n`` (fp32) for int32 ``n`` in [-252, 254].
``frexp_exponent(v)``       ``torch.frexp(v)[1]`` for normal fp32 ``v`` (``v = m * 2**E``).
``round_half_even(v)``      ``torch.round`` for ``|v| < 2**22``.
``cast_rne(x, dtype)``      ``x.to(dtype)`` rounding to nearest even also in the interpreter.
``round_to_e4m3(x)``        ``x`` (already in [-448, 448]) rounded to the float8_e4m3fn grid
                            with ties to even, so the later cast is exact everywhere.
``abs_max(x, axis)``        ``max |x|`` along ``axis``, NaN when any element is NaN (as torch's
                            ``amax``; ``tl.max`` may drop NaN on a GPU).
``clamp_e4m3(x)``           ``x`` clamped to [-448, 448], NaN kept.
``to_e4m3(x)``              ``x.to(float8e4nv)`` with NaN kept as NaN also in the interpreter
                            (whose cast turns NaN into 384).
``hadamard_signs(N)``       ``[N, N]`` fp32 matrix of ``(-1)**popcount(i & j)`` (unnormalized).
``rotate_rows(x, D, EXACT)`` ``x [M, D] @ H_D`` (normalized), fp32 in and out.
``scale_inv_sqrt(x, D)``    ``x * fp32(1/sqrt(D))``, the normalization of ``H_D``.
``pack_codes_store(...)``   bit-pack a ``[R, C]`` code tile (stream order ``r*C + c``).
``unpack_codes_load(...)``  the inverse, for a ``[R, C]`` window of a packed field.
``line_spread``, ``apply_log_scales``: steps of the reference quantizer
(``kvarn_ops/reference/quantize.py``) as the MLA pack computes them; ``clip_ratio``,
``clip_codes``: the clipping search's candidates (``reference/rounding.py``), used by the
flush (``flush_math.py``).

Bit packing (docs/contracts.md): code ``i`` of width ``b`` occupies stream bits
``[i*b, (i+1)*b)``, stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``. ``L`` consecutive codes
(``L = 8 / gcd(b, 8)``) fill exactly ``NB = b*L/8`` whole bytes, so a tile is handled as rows of
``L`` codes <-> ``NB`` bytes, with ``NB`` padded to the power of two ``NBP`` for the tensor shape.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvarn_ops.reference.rounding import CLIP_COUNTS, CLIP_RATIOS

__all__ = [
    "INTERPRET",
    "abs_max",
    "clamp_e4m3",
    "to_e4m3",
    "tracing",
    "cast_rne",
    "check_device",
    "clip_codes",
    "CLIP_COUNT_BY_LEVELS",
    "clip_ratio",
    "cuda_feature",
    "exact_in_tf32",
    "f16_parts",
    "fp16_balance_shift",
    "frexp_exponent",
    "gluon_modules",
    "hadamard_signs",
    "pack_codes_store",
    "pack_geometry",
    "pow2",
    "rotate_rows",
    "round_half_even",
    "round_to_bf16",
    "round_to_e4m3",
    "scale_inv_sqrt",
    "unpack_codes_load",
]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when Triton runs kernels on the CPU interpreter (set before triton is imported)."""


def cuda_feature(t: torch.Tensor, env_off: str, capability: tuple[int, int]) -> bool:
    """Whether a compiled-only GPU feature may serve tensors on ``t``'s device: a CUDA device of
    compute capability ``capability`` or newer (``(8, 0)`` for the Gluon ``mma.sync`` kernels,
    ``(9, 0)`` for programmatic dependent launch), not under the Triton interpreter (inline PTX
    and Gluon do not run there), and the environment variable ``env_off`` not set to ``0``."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or t.device.type != "cuda":
        return False
    if os.environ.get(env_off) == "0":
        return False
    return device_capability(t.device.index) >= capability


@functools.lru_cache(maxsize=16)
def device_capability(index: int | None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of CUDA device ``index`` (None: the current one,
    read at the first call), once per device: the lookup costs about 8 us of host time on every
    launch otherwise."""
    return torch.cuda.get_device_capability(index)


def gluon_modules(*names: str) -> tuple | None:
    """The kernel modules ``kvarn_ops.kernels.<name>`` written in Gluon, or None where this
    Triton has no Gluon (or another Gluon API than Triton 3.6's): the Triton kernels then serve
    every case."""
    try:
        return tuple(importlib.import_module(f"kvarn_ops.kernels.{n}") for n in names)
    except (ImportError, AttributeError, TypeError):
        return None


def check_device(t: torch.Tensor) -> None:
    """Triton kernels run on CUDA devices, or on the CPU under ``TRITON_INTERPRET=1``."""
    if t.device.type == "cuda" or (INTERPRET and t.device.type == "cpu"):
        return
    raise NotImplementedError(
        f"kvarn_ops Triton kernels run on CUDA devices (or on the CPU with TRITON_INTERPRET=1 set "
        f"before triton is imported), got a tensor on {t.device}; use kvarn_ops.reference there"
    )


_dispatch_mode: Callable[[], object] = getattr(
    importlib.import_module("torch.utils._python_dispatch"),
    "_get_current_dispatch_mode",
    lambda: None,  # a torch without it: no dispatch-mode check
)


def launch_or_op(op, launch, *args) -> None:
    """Call ``launch(*args)``, the body of the custom op ``op``, directly; only while
    ``torch.compile`` traces, or a dispatch mode is active (``FakeTensorMode``, ``make_fx``
    tracing), call ``op`` itself, so that graphs hold the op and fake tensors take its fake
    implementation.

    In eager mode the op's dispatch adds host time to every call without doing anything for
    the caller (the dispatcher's autograd and in-place keys, version-counter bumps of the
    mutated tensors, an aliasing check of the result): 26 us per call on a 2-core x86 host,
    tens of microseconds on the H200 machine's host (``benchmarks/host_overhead.py``), paid
    on every layer of every step by an attention backend outside CUDA graphs."""
    if tracing():
        op(*args)
    else:
        launch(*args)


def tracing() -> bool:
    """Whether ``torch.compile`` traces or a dispatch mode is active (ops must then be called
    as registered custom ops, not launched directly)."""
    return torch.compiler.is_compiling() or _dispatch_mode() is not None


def exact_in_tf32(dtype: torch.dtype) -> bool:
    """Whether every value of ``dtype`` has at most 11 significant bits (one tf32 pass is
    exact)."""
    return dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def pack_geometry(bits: int) -> tuple[int, int, int]:
    """``(L, NB, NBP)`` for ``bits``-bit codes: ``L`` codes fill ``NB`` whole bytes; ``NBP`` is
    ``NB`` rounded up to a power of two (the tensor width used for those bytes)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits: must be from 2 to 8, got {bits}")
    group = 8 // math.gcd(bits, 8)
    nb = bits * group // 8
    return group, nb, triton.next_power_of_2(nb)


@triton.jit
def f16_parts(x):
    """``x`` (fp32) as two fp16 dot operands ``hi + lo``, relative error about 2^-22: the
    decode kernels' score operand ``q * s_col``, where one fp16 operand's 2^-12 is not enough
    on records whose zero-point term nearly cancels the code term (see
    ``decode_mma_t._qs_t``)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _pow2_normal(n):
    # 2**n from the exponent field; valid for n in [-126, 127].
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2(n):
    """Exact ``2.0**n`` for int32 ``n`` in [-252, 254] (a product of two normal powers)."""
    first = tl.minimum(tl.maximum(n, -126), 127)
    return _pow2_normal(first) * _pow2_normal(n - first)


@triton.jit
def frexp_exponent(v):
    """Exponent ``E`` with ``v = m * 2**E``, ``0.5 <= |m| < 1``, for normal fp32 ``v`` (as
    ``torch.frexp``); 0 for ``v == 0``. Subnormal ``v`` give -126."""
    field = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(v == 0.0, 0, field - 126)


@triton.jit
def fp16_balance_shift(s, z, w, e):
    """Reference quantizer step 6 for one tile: the power-of-two exponent ``j`` to move between
    its sides so every fp16 field is normal where possible. Row side: folded scales ``s`` and
    zero points ``z`` in prescaled units (stored as ``* 2**(e + j)``, ``e`` the prescale
    exponent); column side: scales ``w`` (stored as ``* 2**-j``). Rows that are all zero do
    not constrain ``j``."""
    mag = tl.maximum(tl.abs(s), tl.abs(z))
    nz = mag > 0.0
    ea = frexp_exponent(mag) + e
    big = 536870911  # int32 max // 4, as the reference
    a_lo = tl.min(tl.where(nz, ea, big), axis=0)
    a_hi = tl.max(tl.where(nz, ea, -big), axis=0)
    eb = frexp_exponent(w)
    b_lo = tl.min(eb, axis=0)
    b_hi = tl.max(eb, axis=0)
    has_a = tl.max(nz.to(tl.int32), axis=0) > 0
    lower = tl.where(has_a, tl.maximum(-13 - a_lo, b_hi - 15), b_hi - 15)
    upper = tl.where(has_a, tl.minimum(15 - a_hi, b_lo + 13), b_lo + 13)
    return (lower + upper) >> 1  # arithmetic shift: floor division by 2


@triton.jit
def round_half_even(v):
    """``torch.round`` (half to even) for fp32 ``|v| < 2**22``: adding 1.5 * 2**23 leaves no
    fraction bits, so the fp32 add rounds to an integer with the hardware's ties-to-even."""
    magic = 12582912.0
    return (v + magic) - magic


@triton.jit
def round_to_e4m3(x):
    """Round fp32 ``x`` (|x| <= 448) to the nearest float8_e4m3fn value, ties to even.

    The result converts to ``tl.float8e4nv`` exactly on every backend (the interpreter's own
    conversion rounds wrongly where the mantissa carries into the exponent)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below 2**-6 the grid is the fixed subnormal step 2**-9.
    ulp_exp = tl.maximum(exponent, -6) - 3
    r = round_half_even(x * pow2(-ulp_exp)) * pow2(ulp_exp)
    # A negative value that rounds to zero is -0 (0x80), as the hardware and torch casts give.
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """``max |x|`` along ``axis``; NaN when any element is NaN, as ``torch.amax``, so a token
    holding NaN gets the reference's fp8 scale (1.0: NaN is not > 0) on every backend."""
    return tl.reduce(tl.abs(x), axis, _max_keep_nan)


@triton.jit
def clamp_e4m3(x):
    """``x`` clamped to the float8_e4m3fn range [-448, 448] with NaN kept (as ``torch.clamp``;
    ``tl.minimum``/``tl.maximum`` may turn NaN into a bound on a GPU)."""
    return tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)


_FIX_FP8_NAN: tl.constexpr = tl.constexpr(INTERPRET)
"""The interpreter's fp32 -> float8e4nv cast turns NaN into 384; compiled, the conversion
keeps NaN."""


@triton.jit
def to_e4m3(x):
    """fp32 ``x`` as ``float8e4nv`` (compiled: rounded to nearest even, saturating at +-448),
    NaN kept as NaN (0x7F) on every backend."""
    y = x.to(tl.float8e4nv)
    if _FIX_FP8_NAN:
        bits = tl.where(x != x, 0x7F, y.to(tl.uint8, bitcast=True))
        y = bits.to(tl.float8e4nv, bitcast=True)
    return y


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bfloat16 value (ties to even), still as fp32, so the
    later cast is exact everywhere (the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


_SOFTWARE_BF16: tl.constexpr = tl.constexpr(INTERPRET)
"""Round fp32 to bf16 in software under the interpreter only, whose cast truncates; compiled,
the conversion instruction rounds to nearest even itself (``cvt.rn.bf16x2.f32``: half an
instruction per value instead of about five)."""


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even on every backend (dtype fp32/fp16/bf16)."""
    if dtype == tl.bfloat16 and _SOFTWARE_BF16:
        return round_to_bf16(x).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def hadamard_signs(N: tl.constexpr):
    """``[N, N]`` fp32 Sylvester signs ``(-1)**popcount(i & j)`` (not normalized)."""
    i = tl.arange(0, N)
    v = i[:, None] & i[None, :]
    # Parity of the popcount by folding (indices have at most 9 bits).
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def rotate_rows(x, M: tl.constexpr, D: tl.constexpr, EXACT_TF32: tl.constexpr):
    """``x [M, D] @ H_D`` (normalized Sylvester Hadamard), fp32 in and out; ``M >= 16`` for
    D = 64, 128 (the dot's M), any ``M >= 1`` for D = 256, 512 (the products' M is ``16 M``
    or more).

    ``EXACT_TF32``: every value of ``x`` has at most 11 significant bits (it was loaded from
    fp16, bf16 or fp8), so a single-pass tf32 product with the +-1 signs is exact and the
    tensor cores lose nothing; otherwise the 3-pass tf32 split keeps fp32 accuracy.
    D = 64, 128: one ``[D, D]`` product. D = 256, 512: ``H_D = H_{D/16} (x) H_16`` applied as two
    small products (16 and D/16 deep) with a transpose between, ~10x fewer FLOPs.
    """
    if D <= 128:
        if EXACT_TF32:
            y = tl.dot(x, hadamard_signs(D), input_precision="tf32")
        else:
            y = tl.dot(x, hadamard_signs(D), input_precision="tf32x3")
    else:
        OUTER: tl.constexpr = D // 16
        # index i = i_outer * 16 + i_inner; H_D[i, j] = H_OUTER[i_o, j_o] * H_16[i_i, j_i].
        flat = tl.reshape(x, [M * OUTER, 16])
        if EXACT_TF32:
            y = tl.dot(flat, hadamard_signs(16), input_precision="tf32")
        else:
            y = tl.dot(flat, hadamard_signs(16), input_precision="tf32x3")
        y = tl.permute(tl.reshape(y, [M, OUTER, 16]), (0, 2, 1))
        y = tl.dot(tl.reshape(y, [M * 16, OUTER]), hadamard_signs(OUTER), input_precision="tf32x3")
        y = tl.reshape(tl.permute(tl.reshape(y, [M, 16, OUTER]), (0, 2, 1)), [M, D])
    return scale_inv_sqrt(y, D)


@triton.jit
def scale_inv_sqrt(x, D: tl.constexpr):
    """``x * fp32(1/sqrt(D))``, the constant the reference multiplies by (D 64 to 512)."""
    if D == 64:
        return x * 0.125
    elif D == 128:
        return x * 0.08838834764831845
    elif D == 256:
        return x * 0.0625
    else:
        return x * 0.044194173824159216


@triton.jit
def pack_codes_store(
    ptr,
    codes,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
):
    """Bit-pack int32 ``codes [R, C]`` (values in [0, 2**BITS)) as stream ``r*C + c`` and store
    the ``R*C*BITS/8`` bytes at uint8 ``ptr``. ``(L, NB, NBP) = pack_geometry(BITS)``."""
    CHUNKS: tl.constexpr = R * C // L
    if BITS == 8:
        tl.store(ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], codes.to(tl.uint8))
    else:
        groups = tl.reshape(codes, [CHUNKS, L])
        shifts = tl.arange(0, L) * BITS
        # The L codes of a chunk hold disjoint bits, so their sum is their bitwise OR.
        if L * BITS > 32:
            word = tl.sum(groups.to(tl.int64) << shifts.to(tl.int64)[None, :], axis=1)
        else:
            word = tl.sum(groups << shifts[None, :], axis=1)
        k = tl.arange(0, NBP)
        out = ((word[:, None] >> (k * 8)[None, :]) & 0xFF).to(tl.uint8)
        offs = tl.arange(0, CHUNKS)[:, None] * NB + k[None, :]
        if NBP == NB:
            tl.store(ptr + offs, out)
        else:
            tl.store(ptr + offs, out, mask=(k < NB)[None, :])


@triton.jit
def unpack_codes_load(
    ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    BITS: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
):
    """Load int32 codes ``[R, C]``: code ``(r, c)`` is stream index ``r*ROW_STRIDE + c`` of the
    packed field starting at uint8 ``ptr``. ``C`` and ``ROW_STRIDE`` are multiples of ``L``."""
    CHUNKS: tl.constexpr = R * C // L
    m = tl.arange(0, CHUNKS)
    # First byte of chunk m: its first code's stream index times BITS / 8.
    base = ((m // (C // L)) * (ROW_STRIDE // L) + m % (C // L)) * NB
    if BITS == 8:
        codes = tl.load(ptr + base).to(tl.int32)
    else:
        k = tl.arange(0, NBP)
        if NBP == NB:
            raw = tl.load(ptr + base[:, None] + k[None, :])
        else:
            raw = tl.load(ptr + base[:, None] + k[None, :], mask=(k < NB)[None, :], other=0)
        shifts = tl.arange(0, L) * BITS
        if L * BITS > 32:
            word = tl.sum(raw.to(tl.int64) << (k * 8).to(tl.int64)[None, :], axis=1)
            codes = (word[:, None] >> shifts.to(tl.int64)[None, :]) & ((1 << BITS) - 1)
            codes = codes.to(tl.int32)
        else:
            word = tl.sum(raw.to(tl.int32) << (k * 8)[None, :], axis=1)
            codes = (word[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [R, C])


# The reference quantizer's normalization steps (kvarn_ops/reference/quantize.py), shared by
# the dense flush and the MLA pack kernels.


@triton.jit
def line_spread(y, AXIS: tl.constexpr, N: tl.constexpr, STD_FLOOR: tl.constexpr):
    """The reference quantizer's ``_spread``: max(std, floor * rms) of every line along AXIS
    (N values), zero lines filled with the geometric mean of the positive spreads (1 if none)."""
    mean = tl.sum(y, axis=AXIS) / N
    if AXIS == 0:
        dev = y - mean[None, :]
    else:
        dev = y - mean[:, None]
    std = tl.sqrt_rn(tl.sum(dev * dev, axis=AXIS) / N)
    rms = tl.sqrt_rn(tl.sum(y * y, axis=AXIS) / N)
    s = tl.maximum(std, STD_FLOOR * rms)
    pos = s > 0.0
    logs = tl.where(pos, tl.log(tl.maximum(s, 1.1754943508222875e-38)), 0.0)
    count = tl.sum(pos.to(tl.int32), axis=0)
    mean_log = tl.sum(logs, axis=0) / tl.maximum(count, 1).to(tl.float32)
    fill = tl.where(count > 0, tl.exp(mean_log), 1.0)
    return tl.where(pos, s, fill)


@triton.jit
def apply_log_scales(xp, lr, lc):
    """The reference quantizer's ``_apply``: ``(xp * exp(-lr)[:, None]) * exp(-lc)[None, :]``."""
    return (xp * tl.exp(-lr)[:, None]) * tl.exp(-lc)[None, :]


# The reference's clip ratios as compile-time constants: ``_CLIP_RATIOS[i]`` (Python float)
# meets fp32 operands as fp32(ratio), the value torch uses for ``ratio * tensor``.
_CLIP_RATIOS = tl.constexpr(CLIP_RATIOS)
_NUM_CLIP_RATIOS = tl.constexpr(len(CLIP_RATIOS))
#: The clipping search's window per code width (reference ``CLIP_COUNTS``), indexed by
#: ``LEVELS = 2**bits - 1``: ``CLIP_COUNT_BY_LEVELS[LEVELS]`` ratios from 1.0 down.
CLIP_COUNT_BY_LEVELS = tl.constexpr(
    tuple(CLIP_COUNTS.get((n + 1).bit_length() - 1, 0) for n in range(256))
)


@triton.jit
def clip_ratio(i, COUNT: tl.constexpr = _NUM_CLIP_RATIOS):
    """``CLIP_RATIOS[i]`` as fp32 (the value torch multiplies fp32 tensors by) for a runtime
    index ``0 <= i < COUNT``."""
    ratio = 0.0
    for j in tl.static_range(COUNT):
        ratio = tl.where(i == j, _CLIP_RATIOS[j], ratio)
    return ratio


@triton.jit
def clip_codes(b, lo, step, LEVELS: tl.constexpr):
    """The reference rounding's ``_codes``: ``clamp(rint((b - lo) * (1 / step)), 0, LEVELS)``
    per row of ``b [R, C]`` (inverse 0 where ``step <= 0``), fp32 integers."""
    pos = step > 0.0
    one = tl.full(step.shape, 1.0, tl.float32)
    inv = tl.where(pos, tl.div_rn(one, tl.where(pos, step, 1.0)), 0.0)
    q = round_half_even((b - lo[:, None]) * inv[:, None])
    return tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0)
