"""store: rotate new K/V tokens and scatter them into the exact pool by slot.

Memory traffic (E = pool element bytes, s = 4 if fp8 else 0): read
``T*Hkv*D*(itemsize(k) + itemsize(v)) + 8T``; write ``2*T'*Hkv*(D*E + s)`` for the T' tokens
with a slot (docs/contracts.md; the same formula as ``kvarn_ops.reference.store``).

One program per (``TILES * BLOCK_T`` tokens, KV head) does K then V of each of its ``TILES``
token tiles; the Hadamard signs are built (and staged as a tensor-core operand) once per program,
not once per tile. Slot -1 skips a token; a slot outside the pool is also skipped in the kernel
(on the CPU the launcher rejects it first), so no input writes outside the pool.

fp8 pools: per token, ``scale = amax / 448`` (IEEE division, as the reference) and codes
``e4m3(y / scale)``. How the quotient is formed is ``FP8_QUOTIENT``: by default the rotation's
fp32 sums ``a`` (before the ``1/sqrt(D)`` factor ``c``) times the row's ``c / scale``, one
multiply per element; ``amax`` itself is exact (``max |fl(a c)| = fl(max |a| c)``: rounding is
monotone). The quotient is then within about one fp32 ulp of the reference's ``fl(fl(a c) /
scale)``, so a code can differ from the reference's only where the quotient sits at an e4m3
rounding boundary (tests: at most one e4m3 step, on at most 2% of the values). Compiled, the
conversion saturates at 448 (``cvt.rn.satfinite``), so no clamp is needed; the interpreter
clamps and rounds in software.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import (
    INTERPRET,
    abs_max,
    cast_rne,
    check_device,
    clamp_e4m3,
    exact_in_tf32,
    hadamard_signs,
    launch_or_op,
    rotate_rows,
    round_to_e4m3,
    scale_inv_sqrt,
    to_e4m3,
)
from kvarn_ops.kernels._fastlaunch import PlanCache, launch
from kvarn_ops.reference.cache import check_store_args

__all__ = ["store"]


_EMULATE_E4M3 = tl.constexpr(INTERPRET)
"""Round to e4m3 in software under the interpreter only, whose own conversion rounds wrongly
where the mantissa carries into the exponent; compiled, the conversion rounds to nearest even
(the same values, about a dozen instructions per element fewer)."""


def tokens_per_program(head_dim: int, fp8: bool = False) -> int:
    """16 (the smallest ``tl.dot`` M) up to 8192 values per operand tile, at most 64 tokens
    (more spill in the fp32-input path at D 64). H200 sweep (T = 32768, Hkv 8, D 128,
    ``benchmarks/tune_launch.py``, ``results/tune_h200_2026-11-30_store.json``): bf16 pool, 8
    tiles per program: 64 tokens 0.086 ms (32: 0.095, 16: 0.115); fp8 pool, one tile: 64
    tokens 0.139 ms (32: 0.209, 128: 0.375)."""
    return max(16, min(64, 8192 // head_dim))


def tiles_per_program(head_dim: int, fp8: bool = False) -> int:
    """Token tiles of ``tokens_per_program`` tokens one program stores in turn: the signs
    operand is built once per program. Same sweep: bf16 pool 8 tiles 0.086 ms (1: 0.104, 2:
    0.097, 16: 0.086). The fp8 pool was fastest with one while it divided every element
    (0.139 ms; 2: 0.207, 8: 0.194); with the reciprocal (``FP8_QUOTIENT`` 1) 8 tiles are
    (2026-12-01, ``results/tune_h200_2026-12-01_store_fp8.json``: 1 tile 0.098 ms, 2 0.102,
    8 0.091)."""
    return 8


def pipeline_stages(head_dim: int, fp8: bool = False) -> int:
    """Software-pipeline depth of the token-tile loop (Triton's ``num_stages``): 3 stages stage
    both K and V tiles ahead by ``cp.async`` (107 KB of shared memory at D 128 with the signs
    operand, 2 programs per SM); 1 loads in place (48 KB, 4 programs per SM)."""
    return 3


def warps_per_program(head_dim: int) -> int:
    """Warps per program (8 was no faster at any tile size of the sweep above)."""
    return 4


FP8_QUOTIENT = 2
"""fp8 pools, how ``y / scale`` is formed: 0 one IEEE division per element; 1 the row's
reciprocal ``r`` and one fma residual step, ``q0 = y r``, ``q0 + (y - q0 scale) r`` (correctly
rounded but for rare cases; four operations per element); 2 (default) the unscaled rotation
sums times the row's ``c / scale`` (one multiply per element, within about one fp32 ulp)."""


def native_dot(dtype: torch.dtype, head_dim: int, interpret: bool = INTERPRET) -> bool:
    """Whether the rotation runs as a 16-bit tensor-core product (fp16/bf16 inputs, D <= 128):
    the +-1 signs are exact in both types, products are exact and the sum is accumulated in
    fp32, as in the single-pass tf32 product, at twice its rate and half its operand bytes.
    Not for bf16 under the interpreter, whose bf16 ``tl.dot`` is wrong (it takes the tf32
    path, which computes the same exact products); the GPU parity tests cover bf16."""
    if interpret and dtype == torch.bfloat16:
        return False
    return dtype in (torch.float16, torch.bfloat16) and head_dim <= 128


@triton.jit
def _signs_operand(src_ptr, D: tl.constexpr, NATIVE: tl.constexpr):
    """The +-1 Hadamard signs in the input's 16-bit type (the ``NATIVE`` product's operand),
    built once per program; 0 when the rotation takes the fp32 path."""
    if NATIVE:
        return hadamard_signs(D).to(src_ptr.dtype.element_ty)
    else:
        return 0


@triton.jit
def _store_one(
    src_ptr,
    src_stride,
    pool_ptr,
    scale_ptr,
    signs,
    tok,
    slot,
    ok,
    head,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXACT_TF32: tl.constexpr,
    FP8: tl.constexpr,
    NATIVE: tl.constexpr,
    QUOTIENT: tl.constexpr,
):
    d = tl.arange(0, D)
    src = tok[:, None] * src_stride + head * D + d[None, :]
    # FOLD: keep the native product's sums unscaled; the fp8 quotient takes fp32(1/sqrt(D))
    # per row.
    FOLD: tl.constexpr = FP8 and NATIVE and QUOTIENT == 2
    if NATIVE:
        x16 = tl.load(src_ptr + src, mask=ok[:, None], other=0.0)
        y = tl.dot(x16, signs, out_dtype=tl.float32)
        if not FOLD:
            y = scale_inv_sqrt(y, D)
    else:
        x = tl.load(src_ptr + src, mask=ok[:, None], other=0.0).to(tl.float32)
        y = rotate_rows(x, BLOCK_T, D, EXACT_TF32)
    row = slot * H + head
    dst = row[:, None] * D + d[None, :]
    if FP8:
        amax = abs_max(y, 1)  # NaN for a token holding NaN: scale 1.0, as the reference
        if FOLD:
            amax = scale_inv_sqrt(amax, D)  # == max |fl(y c)|: rounding is monotone
        # amax / 448 (FP8_MAX, the largest e4m3 value), IEEE-rounded like torch.
        scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
        if FOLD:
            c = scale_inv_sqrt(tl.full(scale.shape, 1.0, tl.float32), D)
            q = y * tl.div_rn(c, scale)[:, None]
        elif QUOTIENT == 0:
            q = tl.div_rn(y, tl.broadcast_to(scale[:, None], y.shape))
        else:
            # y / scale correctly rounded in all but rare cases, from the row's reciprocal and
            # one fma residual step (no per-element division): q0 = y r, q = q0 + (y - q0 s) r
            r = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
            q0 = y * r
            q = tl.fma(tl.fma(-q0, scale[:, None], y), r, q0)
        if _EMULATE_E4M3:
            q = round_to_e4m3(clamp_e4m3(q))
        # compiled: the conversion rounds to nearest even and saturates at +-448
        # (cvt.rn.satfinite), the reference's clamp; NaN stays NaN (flush zeroes the token)
        tl.store(pool_ptr + dst, to_e4m3(q), mask=ok[:, None])
        tl.store(scale_ptr + row, scale, mask=ok)
    else:
        tl.store(pool_ptr + dst, cast_rne(y, pool_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _store_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    exact_k_ptr,
    exact_v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    T,
    num_slots,
    k_stride,
    v_stride,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILES,
    EXACT_K: tl.constexpr,
    EXACT_V: tl.constexpr,
    FP8: tl.constexpr,
    NATIVE_K: tl.constexpr,
    NATIVE_V: tl.constexpr,
    QUOTIENT: tl.constexpr,
):
    head = tl.program_id(1)
    chunk = tl.program_id(0).to(tl.int64)
    signs_k = _signs_operand(k_ptr, D, NATIVE_K)
    signs_v = _signs_operand(v_ptr, D, NATIVE_V)
    for i in tl.range(0, TILES):
        tok = (chunk * TILES + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = tok < T
        slot = tl.load(slots_ptr + tok, mask=in_range, other=-1)
        ok = in_range & (slot >= 0) & (slot < num_slots)
        # Masked-off lanes still form addresses: keep them inside the tensors.
        tok = tl.where(in_range, tok, 0)
        slot = tl.where(ok, slot, 0)
        _store_one(
            k_ptr,
            k_stride,
            exact_k_ptr,
            k_scale_ptr,
            signs_k,
            tok,
            slot,
            ok,
            head,
            H,
            D,
            BLOCK_T,
            EXACT_K,
            FP8,
            NATIVE_K,
            QUOTIENT,
        )
        _store_one(
            v_ptr,
            v_stride,
            exact_v_ptr,
            v_scale_ptr,
            signs_v,
            tok,
            slot,
            ok,
            head,
            H,
            D,
            BLOCK_T,
            EXACT_V,
            FP8,
            NATIVE_V,
            QUOTIENT,
        )


def _launch(k, v, pool_slots, exact_k, exact_v, k_scale, v_scale) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    p, g = exact_k.shape[:2]
    fp8 = exact_k.dtype == torch.float8_e4m3fn
    block_t = tokens_per_program(d, fp8)
    tiles = max(1, min(tiles_per_program(d, fp8), triton.cdiv(t, block_t)))
    chunks = triton.cdiv(t, block_t * tiles)
    grid = (chunks, hkv)
    # Without an fp8 pool the scale pointers are never dereferenced (FP8 is a constexpr).
    ks = k_scale if fp8 else exact_k
    vs = v_scale if fp8 else exact_v
    launch(
        _store_kernel,
        grid,
        k,
        v,
        pool_slots,
        exact_k,
        exact_v,
        ks,
        vs,
        t,
        p * g,
        k.stride(0),
        v.stride(0),
        H=hkv,
        D=d,
        BLOCK_T=block_t,
        TILES=tiles,
        EXACT_K=exact_in_tf32(k.dtype),
        EXACT_V=exact_in_tf32(v.dtype),
        FP8=fp8,
        NATIVE_K=native_dot(k.dtype, d),
        NATIVE_V=native_dot(v.dtype, d),
        QUOTIENT=FP8_QUOTIENT,
        num_warps=warps_per_program(d),
        num_stages=pipeline_stages(d, fp8),
    )


@torch.library.custom_op("kvarn::store", mutates_args=("exact_k", "exact_v", "k_scale", "v_scale"))
def _store_op(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_slots: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    _launch(k, v, pool_slots, exact_k, exact_v, k_scale, v_scale)


@_store_op.register_fake
def _store_fake(k, v, pool_slots, exact_k, exact_v, k_scale, v_scale) -> None:
    return None


def _store_switches() -> tuple:
    """The module settings :func:`store`'s launch reads (``benchmarks/tune_launch.py``
    replaces them): part of every plan's signature (:mod:`._fastlaunch`)."""
    return (tokens_per_program, tiles_per_program, pipeline_stages, warps_per_program,
            native_dot, FP8_QUOTIENT, _store_kernel)  # fmt: skip


_PLANS = PlanCache(_store_switches)
"""Recorded launches of :func:`store` calls (host time: see :mod:`._fastlaunch`)."""


def store(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_slots: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate new tokens by ``H_D`` and write them into the exact pool (Triton).

    Parameters
    ----------
    k, v : Tensor [T, Hkv, D], float16/bfloat16/float32, model frame; each token's
        ``[Hkv, D]`` contiguous, tokens at any stride (e.g. slices of a fused QKV projection:
        no copy needed).
    pool_slots : int64 [T]; token i goes to pool block ``slot // G``, offset ``slot % G``;
        -1 skips the token. Duplicate slots: which token lands is unspecified.
    exact_k, exact_v : [P, G, Hkv, D] float16/bfloat16/float8_e4m3fn pool (written).
    k_scale, v_scale : float32 [P, G, Hkv] for an fp8 pool (written), else None.
        fp8: ``scale = amax/448`` per token (1.0 when amax is 0), values
        ``clamp(x/scale, -448, 448)`` rounded to nearest even e4m3.

    Raises
    ------
    ValueError
        Naming the bad argument; slots outside ``[-1, P*G)`` are reported for CPU tensors (on a
        GPU the kernel skips them instead of syncing to check).

    A repeated call of one signature (shapes, strides, dtypes, alignment) replays the launch
    of the first without its checks (:mod:`._fastlaunch`).
    """
    tensors = (k, v, pool_slots, exact_k, exact_v, k_scale, v_scale)
    key = _PLANS.key(tensors, ())
    if _PLANS.replay(key, tensors):
        return
    with _PLANS.recording(key, tensors):
        check_store_args(k, v, pool_slots, exact_k, exact_v, k_scale, v_scale)
        check_device(exact_k)
        launch_or_op(_store_op, _launch, k, v, pool_slots, exact_k, exact_v, k_scale, v_scale)
