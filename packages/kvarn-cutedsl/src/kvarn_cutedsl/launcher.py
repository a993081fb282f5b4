"""Launcher of the CuTe DSL decode: same contract as ``kvarn_ops.decode`` (docs/contracts.md).

Checks arguments (ValueError naming the argument), then the capability (NotImplementedError
naming the arch or format and what is supported) before any compile, then calls the compiled
function (AOT artifact or JIT with the on-disk cache, see :mod:`kvarn_cutedsl.aot`).

Memory traffic per call (the roofline the benchmark uses): read, for every request,
``seq_len // G`` records per KV head (``record_bytes``), ``(seq_len % G) * D * 2`` pool
elements, q (``B*T*Hq*D``); write ``out``; the workspace adds ``S*B*T*Hq*(D+1)*4`` bytes
written and read back.
"""

from __future__ import annotations

import math

import torch

import kvarn_formats as kf
from kvarn_cutedsl import _capability as cap
from kvarn_cutedsl._spec import KernelSpec, dtype_name, make_spec

__all__ = ["MAX_SPLITS", "decode", "decode_num_splits", "decode_workspace", "kernel_spec"]

MAX_SPLITS = 128
"""Upper bound on the split count a workspace is sized for (as kvarn-ops)."""
MIN_UNITS_PER_SPLIT = 2
_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_size: int,
    device: torch.device | str | None = None,
) -> int:
    """Split count a workspace is sized for: about 4 CTAs per SM, no more than the longest
    context can use (the same rule as kvarn-ops, so one workspace serves both)."""
    sms = 132
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    units = -(-max(1, max_seq_len) // block_size)
    want = -(-4 * sms // max(1, batch * num_kv_heads))
    by_ctx = -(-units // MIN_UNITS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, want, by_ctx))


def decode_workspace(
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    block_size: int,
    device: torch.device | str = "cuda",
    num_splits: int | None = None,
) -> torch.Tensor:
    """Scratch for :func:`decode`: float32 ``[S * B * T * Hq * (D + 1)]`` (same as kvarn-ops)."""
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_seq_len, block_size, device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: must be in [1, {MAX_SPLITS}], got {num_splits}")
    n = num_splits * batch * query_len * num_q_heads * (head_dim + 1)
    return torch.empty(n, dtype=torch.float32, device=device)


def _finite_positive(value) -> bool:
    """A real number (bool excluded) that is finite and > 0 as a float (an int too large for a
    float is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and float(value) > 0
    except OverflowError:
        return False


def _check_tensor(name, t, dtypes, ndim=None, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {list(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (where q is)")


def _check_contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous())")


def check_arguments(
    q,
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    layout,
    softmax_scale,
    out,
    workspace,
) -> int:
    """Shape / dtype / device checks of :func:`decode`; returns the workspace's split count."""
    _check_tensor("q", q, _MODEL_DTYPES, ndim=4)
    dev = q.device
    b, t, hq, d = q.shape
    if not isinstance(layout, kf.RecordLayout) or layout.kind != "dense":
        raise ValueError(f"layout: expected a dense kvarn_formats.RecordLayout, got {layout!r}")
    if layout.head_dim != d:
        raise ValueError(f"layout: head_dim {layout.head_dim}, but q has head_dim {d}")
    if not 1 <= t <= 8:
        raise ValueError(f"q: query length T must be in [1, 8], got {t}")
    _check_tensor("packed", packed, (torch.uint8,), ndim=3, device=dev)
    nb, hkv, rb = packed.shape
    if rb != layout.record_bytes:
        raise ValueError(
            f"packed: last dim must be record_bytes={layout.record_bytes} of "
            f"{layout.format_name!r} at head_dim {d}, got {rb}"
        )
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of {hkv} KV heads (packed dim 1)")
    _check_tensor("block_table", block_table, (torch.int32,), ndim=2, device=dev)
    if block_table.shape[0] != b or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        raise ValueError(
            f"block_table: expected {b} rows with unit column stride, got shape "
            f"{list(block_table.shape)} strides {block_table.stride()}"
        )
    _check_tensor("seq_lens", seq_lens, (torch.int32,), shape=(b,), device=dev)
    _check_tensor("tail_pool_block", tail_pool_block, (torch.int32,), shape=(b,), device=dev)
    _check_tensor("exact_k", exact_k, _POOL_DTYPES, ndim=4, device=dev)
    _check_tensor("exact_v", exact_v, (exact_k.dtype,), shape=tuple(exact_k.shape), device=dev)
    g = layout.block_size
    if tuple(exact_k.shape[1:]) != (g, hkv, d):
        raise ValueError(f"exact_k: expected shape [P, {g}, {hkv}, {d}], got {list(exact_k.shape)}")
    if exact_k.dtype == torch.float8_e4m3fn:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_tensor(name, sc, (torch.float32,), shape=tuple(exact_k.shape[:3]), device=dev)
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale, v_scale: must be None for a float16/bfloat16 pool")
    if not _finite_positive(softmax_scale):
        raise ValueError(f"softmax_scale: must be a finite positive float, got {softmax_scale!r}")
    _check_tensor("out", out, _MODEL_DTYPES, shape=(b, t, hq, d), device=dev)
    _check_tensor("workspace", workspace, (torch.float32,), ndim=1, device=dev)
    for name, x in (
        ("q", q),
        ("packed", packed),
        ("seq_lens", seq_lens),
        ("tail_pool_block", tail_pool_block),
        ("exact_k", exact_k),
        ("exact_v", exact_v),
        ("out", out),
        ("workspace", workspace),
    ):
        _check_contiguous(name, x)
    splits = workspace.numel() // max(1, b * t * hq * (d + 1))
    if splits < 1:
        raise ValueError(
            f"workspace: too small, {workspace.numel()} float32 elements; at least "
            f"{b * t * hq * (d + 1)} needed (use decode_workspace(...))"
        )
    if dev.type == "cpu" and b:
        # value checks only where they cost no device sync
        if bool((seq_lens < t).any()):
            raise ValueError(f"seq_lens: every entry must be >= T={t}, got {seq_lens.tolist()}")
        full = seq_lens.to(torch.int64) // g
        if int(full.max()) > block_table.shape[1]:
            raise ValueError(
                f"block_table: {block_table.shape[1]} columns, but a request has "
                f"{int(full.max())} full blocks"
            )
    return min(splits, MAX_SPLITS)


def kernel_spec(q, packed, exact_k, layout, out) -> KernelSpec:
    """The specialization a call needs (after the capability checks)."""
    b, t, hq, d = q.shape
    hkv = packed.shape[1]
    fmt = kf.parse_format(layout.format_name)
    if not isinstance(fmt, kf.DenseFormat):
        raise ValueError(f"layout: {layout.format_name} is not a dense KVarN format")
    cap.check_format(fmt.k_bits, fmt.v_bits, layout.block_size, d, layout.format_name)
    cap.check_geometry(
        hq // hkv, t, dtype_name(q.dtype), dtype_name(exact_k.dtype), dtype_name(out.dtype)
    )
    return make_spec(layout.format_name, d, hq // hkv, t, q.dtype, exact_k.dtype, out.dtype)


def decode(
    q,
    packed,
    block_table,
    seq_lens,
    exact_k,
    exact_v,
    k_scale,
    v_scale,
    tail_pool_block,
    layout,
    softmax_scale,
    out,
    workspace,
) -> None:
    """Attention of T query tokens per request over a KVarN paged cache (CuTe DSL kernel).

    Parameters
    ----------
    q : Tensor [B, T, Hq, D], float16 / bfloat16, model frame; T * (Hq / Hkv) <= 8.
    packed : uint8 [num_blocks, Hkv, record_bytes]
    block_table : int32 [B, max_blocks], unit column stride.
    seq_lens : int32 [B], tokens in the cache including the T new ones (>= T).
    exact_k, exact_v : [P, G, Hkv, D] float16 / bfloat16, rotated frame (fp8: refused).
    k_scale, v_scale : None (fp8 pools are not implemented).
    tail_pool_block : int32 [B], pool block of the ``seq_len % G`` newest tokens.
    layout : kvarn_formats.RecordLayout (dense): k4v2 / k4v4, g64 / g128, head_dim 64 / 128.
    softmax_scale : float
    out : Tensor [B, T, Hq, D], float16 / bfloat16, written in the model frame.
    workspace : float32 Tensor from :func:`decode_workspace` (the only scratch).

    Raises
    ------
    ValueError : bad arguments. NotImplementedError : unvalidated GPU arch, or a format,
    geometry or dtype the kernel does not implement (checked before any compile).
    """
    splits = check_arguments(
        q,
        packed,
        block_table,
        seq_lens,
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        tail_pool_block,
        layout,
        softmax_scale,
        out,
        workspace,
    )
    arch = cap.device_arch(q.device.index if q.device.type == "cuda" else None)
    cap.check_arch(arch)
    spec = kernel_spec(q, packed, exact_k, layout, out)
    if q.device.type != "cuda":
        raise ValueError(f"q: the CuTe DSL decode runs on CUDA tensors, got {q.device}")
    from kvarn_cutedsl.aot import get_function

    fn = get_function(spec, arch)
    b = q.shape[0]
    if b == 0:
        return
    hkv = packed.shape[1]
    bt_stride = block_table.stride(0) if block_table.shape[1] else 1
    span = (b - 1) * bt_stride + max(1, block_table.shape[1])
    bt_flat = block_table.as_strided((span,), (1,))
    stream = torch.cuda.current_stream(q.device).cuda_stream
    fn(
        q.view(-1),
        packed.view(-1),
        packed.view(torch.float16).view(-1),
        bt_flat,
        seq_lens,
        tail_pool_block,
        exact_k.view(-1),
        exact_v.view(-1),
        workspace,
        out.view(-1),
        b,
        hkv,
        bt_stride,
        splits,
        float(softmax_scale) * math.log2(math.e),
        stream,
    )
