"""materialize: dequantize the cached context of B requests into K/V in the model frame.

Memory traffic (E = pool element bytes, s = 4 if fp8 else 0, L_b = seq_lens[b]): read
``sum_b(floor(L_b/G))*Hkv*R + sum_b(L_b mod G)*2*Hkv*(D*E + s)`` plus the used block-table
entries; write ``2*sum_b(L_b)*Hkv*D*itemsize(k_out)``.

Grid: one program per (request, logical block, KV head, K or V); programs past a request's
length exit at once, so the grid is fixed by the shapes and the call never syncs with the host.
A full block is read from its record, the partial newest block from the exact pool.

The inverse rotation is folded into the dequantization (D <= 128): with ``S = diag(s_col)`` and
``P`` the +-1 Sylvester signs, ``K[t, :] H = s_row[t] * (code[:, t]^T (S P) + zp^T P) / sqrt(D)``
and ``V[t, :] H = (s_row[t] * code[t, :] (S P) + zp[t] * s_col^T P) / sqrt(D)``. Codes (< 256) and
``S P`` (fp16 values times +-1) are exact in fp16 (codes as ``(0x6400 | c) - 1024``), so one
fp16 tensor-core product with fp32 accumulation is exact up to the accumulation order. ``S P``
is built per tile from the Kronecker factors ``P_D = P_{D/16} (x) P_16`` by flipping fp16 sign
bits (``P_16``'s from a 512-byte table, so the tile is built and stored to shared memory 8
values at a time), and the vectors ``zp^T P``, ``s_col^T P`` by two small products over those
factors. The exact tail rotates fp16/bf16 (and fp8 as fp16) rows with a 16-bit product.
D = 256, 512 dequantize in fp32 first and rotate with the 3-pass product.

On CUDA GPUs with ``mma.sync`` (sm_80+), full blocks of 2/4-bit K with 2/4-bit V, G 64 or
128, D 64 (head pairs), 128 or 256 take the Gluon kernel of ``materialize_mma.py`` (no
shared-memory trips: the rotation as eight 16 x 16 products and an 8-point transform in
registers); this kernel is then launched
for the exact tails only (``TAILS_ONLY``, grid ``(B, Hkv, 2)``), so a call makes two launches.
``KVARN_MATERIALIZE_MMA=0`` keeps every block here.

Launch knobs (read at every call, so a sweep can change them between calls):
``MATERIALIZE_WARPS`` (num_warps), ``CHUNK_VALUES`` (values of a tile dequantized at once,
which sets the tokens per chunk, see :func:`tokens_per_chunk`) and
:func:`materialize_maxnreg` (the register cap).
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

import kvarn_formats as kf
from kvarn_ops._validate import check_tensor
from kvarn_ops.kernels._common import (
    INTERPRET,
    cast_rne,
    check_device,
    cuda_feature,
    device_capability,
    gluon_modules,
    hadamard_signs,
    launch_or_op,
    pack_geometry,
    rotate_rows,
    scale_inv_sqrt,
    unpack_codes_load,
)
from kvarn_ops.kernels._fastlaunch import PlanCache, constant, launch
from kvarn_ops.reference.cache import check_context_args
from kvarn_ops.reference.hadamard import hadamard_matrix

__all__ = ["materialize"]


MATERIALIZE_WARPS = 4
"""num_warps of the materialize kernel (4: one warpgroup, the 64-row fp16 wgmma tile)."""
CHUNK_VALUES = 8192
"""Values of a tile dequantized at once (tokens per chunk times D, at least 16 tokens)."""


def materialize_maxnreg(head_dim: int, group: int, arch: int) -> int | None:
    """Register cap per thread on sm_90 (``arch`` = major * 10 + minor): 128 where a tile is
    one chunk and D <= 128 (4 programs per SM instead of 3 at the compiler's 138 registers:
    0.500 -> 0.456 ms on an H200 for k4v2 g64, B=16 ~8K; 8 bytes of spill frame offline).
    Elsewhere the compiler's choice: G 128 at D 128 takes 240 registers (328 bytes of spill
    frame under the cap), and sm_120's mma.sync layouts spill 720 bytes under it."""
    if arch // 10 == 9 and head_dim <= 128 and tokens_per_chunk(head_dim, group) == group:
        return 128
    return None


_TABLES: dict = {}


def native_tail(dtype: torch.dtype, head_dim: int, interpret: bool = INTERPRET) -> bool:
    """Whether the exact tail rotates with a 16-bit tensor-core product (D <= 128; not for bf16
    under the interpreter, whose bf16 ``tl.dot`` takes the tf32 path: the same exact products,
    but the GPU parity tests are what cover bf16)."""
    return head_dim <= 128 and not (interpret and dtype == torch.bfloat16)


def _arch(device) -> int:
    """major * 10 + minor of a CUDA device; 0 elsewhere (the interpreter)."""
    if device.type != "cuda" or INTERPRET:
        return 0
    major, minor = device_capability(device.index)
    return major * 10 + minor


def _sign_table(device) -> torch.Tensor:
    """int16 ``[16, 16]``: 0x8000 where the Sylvester sign of ``P_16`` is -1 (cached per
    device; uploaded by the first call on a device, which must not be inside a CUDA-graph
    capture)."""
    key = str(device)
    if key not in _TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "materialize: the first call on a device uploads a 512-byte sign table and "
                "cannot be captured in a CUDA graph; call materialize once before capturing"
            )
        negative = hadamard_matrix(16) < 0  # the reference's Sylvester matrix, on the CPU
        _TABLES[key] = (negative.to(torch.int16) << 15).to(device)
    return _TABLES[key]


def tokens_per_chunk(head_dim: int, group: int) -> int:
    """Tokens dequantized at once: at most ``CHUNK_VALUES`` values of a tile per chunk (a power
    of two from 16 to the group)."""
    return min(group, max(16, CHUNK_VALUES // head_dim))


@triton.jit
def _load_fp16(ptr, offs):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)) + offs).to(tl.float32)


@triton.jit
def _signed_sum(v, D: tl.constexpr):
    """``v^T P_D`` for fp32 ``v [D]`` (D = 16 * O) as two small products over the Kronecker
    factors: ``t[a, jb] = sum_b v[a, b] P_16[b, jb]``, then ``sum_a P_O[a, ja] t[a, jb]``."""
    O: tl.constexpr = D // 16
    v2 = tl.reshape(v, [O, 16])
    t = tl.sum(v2[:, :, None] * hadamard_signs(16)[None, :, :], axis=1)
    u = tl.sum(hadamard_signs(O)[:, :, None] * t[:, None, :], axis=0)
    return tl.reshape(u, [D])


@triton.jit
def _tail_rows(
    pool_ptr,
    scale_ptr,
    src,
    ok,
    D: tl.constexpr,
    BT: tl.constexpr,
    FP8: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """Exact-pool rows ``src`` rotated back to the model frame, fp32 ``[BT, D]``. ``NATIVE``
    (D <= 128): a 16-bit tensor-core product with the +-1 signs (fp16/bf16 pools in their own
    type, fp8 values in fp16, both exact), whose products are exact and summed in fp32 like
    the single-pass tf32 product of ``rotate_rows``, with half its operand bytes."""
    dim = tl.arange(0, D)
    x = tl.load(pool_ptr + src[:, None] * D + dim[None, :], mask=ok[:, None], other=0.0)
    if NATIVE:
        if FP8:
            x = x.to(tl.float16)
        y = scale_inv_sqrt(tl.dot(x, hadamard_signs(D).to(x.dtype), out_dtype=tl.float32), D)
    else:
        y = rotate_rows(x.to(tl.float32), BT, D, True)
    if FP8:
        y = y * tl.load(scale_ptr + src, mask=ok, other=1.0)[:, None]
    return y


@triton.jit
def _codes_f16(codes):
    """int32 codes (< 1024) as exact fp16: ``0x6400 | c`` is the fp16 number 1024 + c, and the
    subtraction is exact (pairs of codes take one packed fp16 add, not an int-to-float
    conversion each)."""
    return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _signed_operand(t16_ptr, s_col_bits, D: tl.constexpr):
    """``S P`` as fp16 ``[D, D]`` (row ``i`` of the Sylvester signs times ``s_col[i]``),
    exact: the fp16 sign bit of ``s_col[i]`` XOR the sign of ``P_D[i, j] = P_O[i // 16, j // 16]
    * P_16[i % 16, j % 16]`` (``O = D / 16``). The ``P_16`` sign bits come from a 512-byte
    int16 table (``t16_ptr``, cache resident): loaded, the tile gets 8 contiguous values per
    thread, so it is stored to shared memory 16 bytes at a time (built from indices, it was
    one 16-bit store per value). ``s_col_bits``: int16 bits of s_col, ``[D]``."""
    i = tl.arange(0, D)
    t16 = tl.load(t16_ptr + (i[:, None] % 16) * 16 + (i[None, :] % 16))
    v = (i[:, None] // 16) & (i[None, :] // 16)  # P_O's parity, O <= 8: three bits
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    outer = ((v & 1) << 15).to(tl.int16)
    return (t16 ^ outer ^ s_col_bits[:, None]).to(tl.float16, bitcast=True)


@triton.jit
def _packed_chunk(
    rec_ptr,
    t0,
    IS_K: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BITS: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    CODES_OFF: tl.constexpr,
    COL_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    ROW_OFF: tl.constexpr,
    signs_ptr,
):
    """Tokens ``t0 .. t0 + BT`` of one record, dequantized and rotated back: fp32 [BT, D].

    ``COL_OFF``: the per-channel scale field (s_col); ``ZP_OFF``, ``ROW_OFF``: zero point and
    the per-token scale field. For K the zero point is per channel, for V per token."""
    t = t0 + tl.arange(0, BT)
    dim = tl.arange(0, D)
    s_row = _load_fp16(rec_ptr + ROW_OFF, t)
    if IS_K:
        zp = _load_fp16(rec_ptr + ZP_OFF, dim)
        # K codes [D, G] (index d*G + t): window of BT tokens of every channel row.
        codes = unpack_codes_load(rec_ptr + CODES_OFF + t0 * BITS // 8, D, BT, G, BITS, L, NB, NBP)
        if D <= 128:
            codes = _codes_f16(codes)  # transposed as fp16: half the bytes of int32
        codes = tl.trans(codes)  # [BT, D]
    else:
        zp = _load_fp16(rec_ptr + ZP_OFF, t)
        # V codes [G, D] (index t*D + d): BT whole token rows.
        codes = unpack_codes_load(
            rec_ptr + CODES_OFF + t0 * D * BITS // 8, BT, D, D, BITS, L, NB, NBP
        )
        if D <= 128:
            codes = _codes_f16(codes)
    if D <= 128:
        col_bits = tl.load((rec_ptr + COL_OFF).to(tl.pointer_type(tl.int16)) + dim)
        m = _signed_operand(signs_ptr, col_bits, D)
        acc = tl.dot(codes, m, out_dtype=tl.float32)
        if IS_K:
            zp_h = _signed_sum(zp, D)
            y = s_row[:, None] * (acc + zp_h[None, :])
        else:
            col_h = _signed_sum(col_bits.to(tl.float16, bitcast=True).to(tl.float32), D)
            y = s_row[:, None] * acc + zp[:, None] * col_h[None, :]
        y = scale_inv_sqrt(y, D)
    else:
        # Dequantize as the reference does, then rotate with the fp32-accurate product.
        s_col = _load_fp16(rec_ptr + COL_OFF, dim)
        codes = codes.to(tl.float32)
        if IS_K:
            x = (codes * s_col[None, :] + zp[None, :]) * s_row[:, None]
        else:
            x = (codes * s_row[:, None] + zp[:, None]) * s_col[None, :]
        y = rotate_rows(x, BT, D, False)
    return y


@triton.jit
def _materialize_kernel(
    packed_ptr,
    block_table_ptr,
    seq_lens_ptr,
    exact_k_ptr,
    exact_v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tail_ptr,
    cu_ptr,
    k_out_ptr,
    v_out_ptr,
    num_blocks,
    num_pool_blocks,
    total_rows,
    max_blocks,
    cols,
    signs_ptr,
    G: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    FP8: tl.constexpr,
    RECORD_BYTES: tl.constexpr,
    K_BITS: tl.constexpr,
    K_L: tl.constexpr,
    K_NB: tl.constexpr,
    K_NBP: tl.constexpr,
    V_BITS: tl.constexpr,
    V_L: tl.constexpr,
    V_NB: tl.constexpr,
    V_NBP: tl.constexpr,
    KC_OFF: tl.constexpr,
    KS_OFF: tl.constexpr,
    KZ_OFF: tl.constexpr,
    KR_OFF: tl.constexpr,
    VC_OFF: tl.constexpr,
    VS_OFF: tl.constexpr,
    VR_OFF: tl.constexpr,
    VZ_OFF: tl.constexpr,
    NATIVE_TAIL: tl.constexpr,
    TAILS_ONLY: tl.constexpr = False,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    is_k = tl.program_id(2) == 0
    if TAILS_ONLY:  # grid (B, Hkv, 2): the full blocks are another kernel's
        req = pid
    else:
        req = pid // cols
    seq_len = tl.load(seq_lens_ptr + req)
    n_full = seq_len // G
    rem = seq_len % G
    if TAILS_ONLY:
        blk = n_full
    else:
        blk = pid % cols
    start = tl.load(cu_ptr + req).to(tl.int64) + blk * G
    dim = tl.arange(0, D)
    if (blk < n_full) & (blk < max_blocks):
        phys = tl.load(block_table_ptr + req.to(tl.int64) * max_blocks + blk).to(tl.int64)
        # Out-of-range entries (rejected on the CPU by the launcher) write nothing on a GPU.
        if (phys >= 0) & (phys < num_blocks):
            rec_ptr = packed_ptr + (phys * H + head) * RECORD_BYTES
            for t0 in range(0, G, BT):
                row = start + t0 + tl.arange(0, BT)
                ok = (row >= 0) & (row < total_rows)
                row = tl.where(ok, row, 0)
                offs = (row[:, None] * H + head) * D + dim[None, :]
                if is_k:
                    y = _packed_chunk(
                        rec_ptr,
                        t0,
                        True,
                        G,
                        D,
                        BT,
                        K_BITS,
                        K_L,
                        K_NB,
                        K_NBP,
                        KC_OFF,
                        KS_OFF,
                        KZ_OFF,
                        KR_OFF,
                        signs_ptr,
                    )
                    tl.store(
                        k_out_ptr + offs, cast_rne(y, k_out_ptr.dtype.element_ty), mask=ok[:, None]
                    )
                else:
                    y = _packed_chunk(
                        rec_ptr,
                        t0,
                        False,
                        G,
                        D,
                        BT,
                        V_BITS,
                        V_L,
                        V_NB,
                        V_NBP,
                        VC_OFF,
                        VS_OFF,
                        VZ_OFF,
                        VR_OFF,
                        signs_ptr,
                    )
                    tl.store(
                        v_out_ptr + offs, cast_rne(y, v_out_ptr.dtype.element_ty), mask=ok[:, None]
                    )
    elif (blk == n_full) & (rem > 0):
        pool_blk = tl.load(tail_ptr + req).to(tl.int64)
        if (pool_blk >= 0) & (pool_blk < num_pool_blocks):
            for t0 in range(0, G, BT):
                t = t0 + tl.arange(0, BT)
                row = start + t
                ok = (t < rem) & (row >= 0) & (row < total_rows)
                row = tl.where(ok, row, 0)
                src = (pool_blk * G + t) * H + head
                offs = (row[:, None] * H + head) * D + dim[None, :]
                if is_k:
                    y = _tail_rows(exact_k_ptr, k_scale_ptr, src, ok, D, BT, FP8, NATIVE_TAIL)
                    tl.store(
                        k_out_ptr + offs, cast_rne(y, k_out_ptr.dtype.element_ty), mask=ok[:, None]
                    )
                else:
                    y = _tail_rows(exact_v_ptr, v_scale_ptr, src, ok, D, BT, FP8, NATIVE_TAIL)
                    tl.store(
                        v_out_ptr + offs, cast_rne(y, v_out_ptr.dtype.element_ty), mask=ok[:, None]
                    )


_FIELD_KEYS = {
    "k_codes": "KC",
    "k_col_scale": "KS",
    "k_zero_point": "KZ",
    "k_row_scale": "KR",
    "v_codes": "VC",
    "v_col_scale": "VS",
    "v_row_scale": "VR",
    "v_zero_point": "VZ",
}


def launch_config(layout, pool_dtype: torch.dtype, arch: int = 0) -> tuple[dict, dict]:
    """Constexpr arguments of ``_materialize_kernel`` (all but ``H``) and launch options for a
    dense layout, pool dtype and GPU architecture (major * 10 + minor; 0: none), from the
    module's knobs."""
    d = layout.head_dim
    consts = dict(
        G=layout.block_size,
        D=d,
        BT=tokens_per_chunk(d, layout.block_size),
        FP8=pool_dtype == torch.float8_e4m3fn,
        NATIVE_TAIL=native_tail(pool_dtype, d),
        TAILS_ONLY=False,
        **record_offsets(layout),
    )
    opts = {"num_warps": MATERIALIZE_WARPS}
    maxnreg = materialize_maxnreg(d, layout.block_size, arch)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return consts, opts


@functools.lru_cache(maxsize=64)
def record_offsets(layout) -> Mapping[str, int]:
    """Constexpr arguments of ``_materialize_kernel``: field offsets and pack geometry (read-only,
    computed once per layout: the field lookups cost host time on every call otherwise)."""
    out = {"RECORD_BYTES": layout.record_bytes}
    for name, key in _FIELD_KEYS.items():
        out[f"{key}_OFF"] = layout.field(name).offset
    for prefix, name in (("K", "k_codes"), ("V", "v_codes")):
        bits = layout.field(name).bits
        group, nb, nbp = pack_geometry(bits)
        out.update(
            {f"{prefix}_BITS": bits, f"{prefix}_L": group, f"{prefix}_NB": nb, f"{prefix}_NBP": nbp}
        )
    return types.MappingProxyType(out)


def _launch(
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    format_name: str,
    k_out,
    v_out,
    cu_seqlens,
) -> None:
    b, max_blocks = block_table.shape
    p, g, hkv, d = exact_k.shape
    # Programs for block index max_blocks hold a tail after max_blocks full blocks.
    cols = max_blocks + 1
    if b == 0 or k_out.shape[0] == 0:
        return
    layout = kf.dense_layout(format_name, d)
    fp8 = exact_k.dtype == torch.float8_e4m3fn
    ks = k_scale if fp8 else exact_k
    vs = v_scale if fp8 else exact_v
    consts, opts = launch_config(layout, exact_k.dtype, _arch(packed.device))
    table = constant(_sign_table(packed.device))
    mma = _mma_module() if _use_mma_kernel(layout, packed) else None
    if mma is not None:
        if max_blocks:
            _launch_mma(mma, packed, block_table, seq_lens, cu_seqlens, k_out, v_out, layout)
        consts["TAILS_ONLY"] = True
    grid = (b, hkv, 2) if mma is not None else (b * cols, hkv, 2)
    launch(
        _materialize_kernel,
        grid,
        packed,
        block_table,
        seq_lens,
        exact_k,
        exact_v,
        ks,
        vs,
        tail_pool_block,
        cu_seqlens,
        k_out,
        v_out,
        packed.shape[0],
        p,
        k_out.shape[0],
        max_blocks,
        cols,
        table,
        H=hkv,
        **consts,
        **opts,
    )


MMA_MAXNREG: int | None = None
"""Register cap of the Gluon full-block kernel (None: the compiler's choice)."""
MMA_D256_PAIRS = 2
"""Pairs of 16-token m-tiles a program of the Gluon kernel takes at head_dim 256: 2 (the whole
64-token half, its two 32-token pairs in turn: 11-15% faster on an H100) or 1 (32 tokens, K and
V each in two programs a half-block); ``KVARN_MATERIALIZE_D256_PAIRS`` overrides it (read at
every call, a tuning knob)."""


def d256_pairs() -> int:
    """:data:`MMA_D256_PAIRS`, or ``KVARN_MATERIALIZE_D256_PAIRS`` where set (1 or 2)."""
    value = os.environ.get("KVARN_MATERIALIZE_D256_PAIRS", "")
    if not value:
        return MMA_D256_PAIRS
    if value not in ("1", "2"):
        raise ValueError(f"KVARN_MATERIALIZE_D256_PAIRS: must be 1 or 2, got {value!r}")
    return int(value)


def _use_mma_kernel(layout, packed: torch.Tensor) -> bool:
    """Full blocks of 2/4-bit K, 2/4-bit V, G 64/128, D 64 (head pairs), 128 or 256 on sm_80+
    take the Gluon kernel (``materialize_mma.py``); ``KVARN_MATERIALIZE_MMA=0`` turns it off."""
    if not cuda_feature(packed, "KVARN_MATERIALIZE_MMA", (8, 0)) or _mma_module() is None:
        return False
    kb = layout.field("k_codes").bits
    vb = layout.field("v_codes").bits
    return _mma_module().mma_materialize_supported(kb, vb, layout.block_size, layout.head_dim)


@functools.cache
def _mma_module():
    mods = gluon_modules("materialize_mma")
    return None if mods is None else mods[0]


def _launch_mma(mod, packed, block_table, seq_lens, cu_seqlens, k_out, v_out, layout) -> None:
    b, max_blocks = block_table.shape
    hkv = packed.shape[1]
    offs = record_offsets(layout)
    pair = layout.head_dim == 64  # two KV heads a program
    heads = -(-hkv // 2) if pair else hkv
    mps = d256_pairs() if layout.head_dim == 256 else 1
    kinds = 4 if mps == 1 and layout.head_dim == 256 else 2  # K, V (256: in 32-token programs)
    launch(
        mod.mma_materialize_kernel,
        (b * max_blocks * (layout.block_size // 64), heads, kinds),
        packed.view(torch.float16),
        packed.view(torch.int32),
        block_table,
        seq_lens,
        cu_seqlens,
        k_out,
        v_out,
        packed.shape[0],
        k_out.shape[0],
        max_blocks,
        hkv,
        G=layout.block_size,
        REC=layout.record_bytes,
        VB=offs["V_BITS"],
        KB=offs["K_BITS"],
        PAIR=pair,
        D=layout.head_dim,
        MPS=mps,
        **{k: v for k, v in offs.items() if k.endswith("_OFF")},
        num_warps=1,
        **({} if MMA_MAXNREG is None else {"maxnreg": MMA_MAXNREG}),
    )


@torch.library.custom_op("kvarn::materialize", mutates_args=("k_out", "v_out"))
def _materialize_op(
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    format_name: str,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> None:
    _launch(
        packed,
        block_table,
        seq_lens,
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        tail_pool_block,
        format_name,
        k_out,
        v_out,
        cu_seqlens,
    )


@_materialize_op.register_fake
def _materialize_fake(
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    format_name,
    k_out,
    v_out,
    cu_seqlens,
) -> None:
    return None


def _materialize_switches() -> tuple:
    """What :func:`materialize`'s path reads besides its arguments: environment switches and
    the module settings and choices that tests and benchmarks replace."""
    env = os.environ.get
    return (
        env("KVARN_MATERIALIZE_MMA"), env("KVARN_MATERIALIZE_D256_PAIRS"), MATERIALIZE_WARPS,
        CHUNK_VALUES, MMA_MAXNREG, MMA_D256_PAIRS, materialize_maxnreg, native_tail,
        _use_mma_kernel, _mma_module, _materialize_kernel, launch_config,
    )  # fmt: skip


_PLANS = PlanCache(_materialize_switches)
"""Recorded launches of :func:`materialize` calls (host time: see :mod:`._fastlaunch`)."""


def materialize(
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    layout,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> None:
    """Write every cached token of each request, dequantized, model frame (Triton).

    Rows ``cu_seqlens[b] .. cu_seqlens[b] + seq_lens[b]`` of ``k_out``/``v_out`` receive request
    ``b``: logical block ``i < seq_lens[b] // G`` from ``packed[block_table[b, i]]``, the
    ``seq_lens[b] % G`` newest tokens from exact-pool block ``tail_pool_block[b]``.

    Parameters
    ----------
    packed : uint8 [num_blocks, Hkv, R]; block_table : int32 [B, max_blocks];
    seq_lens : int32 [B] (may be 0); exact_k, exact_v : [P, G, Hkv, D] pool;
    k_scale, v_scale : float32 [P, G, Hkv] for an fp8 pool, else None;
    tail_pool_block : int32 [B]; layout : dense kvarn_formats.RecordLayout;
    k_out, v_out : [total_tokens, Hkv, D] bfloat16 or float16, contiguous (written at those
        rows only); cu_seqlens : int32 [B + 1] (entry B is not read).

    Raises
    ------
    ValueError
        Naming the bad argument. Index ranges (block table, tail blocks, output rows) are
        checked for CPU tensors; on a GPU an out-of-range entry makes its program write
        nothing.
    RuntimeError
        If the first call on a CUDA device is made inside a CUDA-graph capture (it uploads a
        512-byte sign table; later calls can be captured).

    A repeated call of one signature replays the launches of the first without its checks
    (:mod:`._fastlaunch`; the sign table is a constant of the plan).
    """
    tensors = (packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block,
               k_out, v_out, cu_seqlens)  # fmt: skip
    key = _PLANS.key(tensors, (id(layout),))
    if _PLANS.replay(key, tensors):
        return
    with _PLANS.recording(key, tensors, keep=(layout,)):
        _checked_materialize(*tensors, layout)


def _checked_materialize(
    packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block, k_out,
    v_out, cu_seqlens, layout,
) -> None:  # fmt: skip
    b, g, hkv, d = check_context_args(
        packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block, layout
    )
    dev = exact_k.device
    check_tensor("k_out", k_out, dtypes=(torch.bfloat16, torch.float16), ndim=3, device=dev)
    total = k_out.shape[0]
    check_tensor("k_out", k_out, shape=(total, hkv, d))
    check_tensor("v_out", v_out, dtypes=(k_out.dtype,), shape=(total, hkv, d), device=dev)
    check_tensor("cu_seqlens", cu_seqlens, dtypes=torch.int32, shape=(b + 1,), device=dev)
    if cu_seqlens.device.type == "cpu" and b:
        start = cu_seqlens[:b].to(torch.int64)
        end = start + seq_lens
        if bool((start < 0).any()) or bool((end > total).any()):
            raise ValueError(
                f"cu_seqlens: rows cu_seqlens[b] .. cu_seqlens[b] + seq_lens[b] must lie in "
                f"[0, {total}) of k_out"
            )
    check_device(exact_k)
    launch_or_op(
        _materialize_op,
        _launch,
        packed,
        block_table,
        seq_lens,
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        tail_pool_block,
        layout.format_name,
        k_out,
        v_out,
        cu_seqlens,
    )
