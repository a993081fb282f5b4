"""Byte maths: bytes per token, compression ratios and how many tokens fit in memory."""

from __future__ import annotations

from .layouts import ELEMENT_BYTES, RecordLayout

POOL_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
"""Element types of the exact pool (tokens of blocks still filling)."""
FP8_SCALE_BYTES = 4
"""A float32 scale per token (per KV head and per K/V) when the exact pool is fp8."""


def baseline_bytes_per_token(layout: RecordLayout, baseline: str) -> int:
    """Bytes per token (per KV head for dense) of an unquantized cache.

    ``baseline`` is ``"bfloat16"`` (or ``"float16"``) or ``"float8"``. For MLA the fp8
    baseline is vLLM's fp8 latent cache (576 one-byte elements).
    """
    if baseline in ("bfloat16", "float16"):
        elem = 2
    elif baseline == "float8":
        elem = 1
    else:
        raise ValueError(f"baseline must be 'bfloat16', 'float16' or 'float8', got {baseline!r}")
    if layout.kind == "dense":
        return 2 * layout.head_dim * elem
    return (layout.head_dim + layout.rope_dim) * elem


def compression_ratio(layout: RecordLayout, baseline: str = "bfloat16") -> float:
    """How many times smaller than ``baseline`` the packed records are."""
    return baseline_bytes_per_token(layout, baseline) / layout.bytes_per_token


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def packed_bytes_per_block(layout: RecordLayout, num_layers: int, num_kv_heads: int) -> int:
    """Bytes of one paged-cache block across all layers (and KV heads for dense)."""
    _check_positive(num_layers=num_layers, num_kv_heads=num_kv_heads)
    heads = num_kv_heads if layout.kind == "dense" else 1
    return layout.record_bytes * heads * num_layers


def exact_pool_bytes_per_request(
    layout: RecordLayout,
    num_layers: int,
    num_kv_heads: int,
    pool_dtype: str = "bfloat16",
    exact_blocks: int = 1,
) -> int:
    """Exact-pool bytes one request holds: ``exact_blocks`` blocks of unquantized tokens.

    Dense: K and V, ``head_dim`` elements each, per KV head per token (plus a float32 scale
    each when fp8). MLA: the latent in ``pool_dtype`` plus bf16 RoPE per token (plus one
    float32 scale when fp8).
    """
    _check_positive(num_layers=num_layers, num_kv_heads=num_kv_heads, exact_blocks=exact_blocks)
    if pool_dtype not in POOL_DTYPES:
        raise ValueError(f"pool_dtype must be one of {', '.join(POOL_DTYPES)}, got {pool_dtype!r}")
    elem = ELEMENT_BYTES[pool_dtype]
    scale = FP8_SCALE_BYTES if pool_dtype == "float8_e4m3fn" else 0
    if layout.kind == "dense":
        per_token = num_kv_heads * 2 * (layout.head_dim * elem + scale)
    elif layout.kind == "mla":
        per_token = layout.head_dim * elem + layout.rope_dim * 2 + scale
    else:
        raise ValueError(f"{layout.format_name} is not a cache format")
    return exact_blocks * layout.block_size * per_token * num_layers


def tokens_that_fit(
    memory_bytes: int,
    layout: RecordLayout,
    num_layers: int,
    num_kv_heads: int,
    max_requests: int,
    pool_dtype: str = "bfloat16",
    exact_blocks: int = 1,
) -> int:
    """Cached tokens that fit in ``memory_bytes`` once ``max_requests`` exact pools are set aside.

    Raises
    ------
    ValueError
        Naming ``max_requests`` when the exact pools alone do not fit.
    """
    _check_positive(memory_bytes=memory_bytes, max_requests=max_requests)
    pools = max_requests * exact_pool_bytes_per_request(
        layout, num_layers, num_kv_heads, pool_dtype, exact_blocks
    )
    if pools >= memory_bytes:
        raise ValueError(
            f"max_requests={max_requests}: the exact pools need {pools} bytes, leaving nothing "
            f"of the {memory_bytes} available for packed blocks; lower max_requests or give "
            "more memory"
        )
    blocks = (memory_bytes - pools) // packed_bytes_per_block(layout, num_layers, num_kv_heads)
    return blocks * layout.block_size
