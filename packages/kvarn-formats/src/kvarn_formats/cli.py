"""``kvarn-formats``: describe and list KV-cache formats, and size a cache with one."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from .capacity import (
    POOL_DTYPES,
    baseline_bytes_per_token,
    compression_ratio,
    exact_pool_bytes_per_request,
    tokens_that_fit,
)
from .grammar import FormatError, MlaFormat, all_format_names, parse_format
from .layouts import LayoutError, RecordLayout, layout_for

GIB = 1 << 30


def _table(layout: RecordLayout) -> str:
    lines = [
        f"{layout.format_name}  ({layout.kind}, head_dim {layout.head_dim}"
        + (f" + RoPE {layout.rope_dim}" if layout.rope_dim else "")
        + f", {layout.block_size} tokens per record)",
        f"record bytes      {layout.record_bytes}",
        f"bytes per token   {layout.bytes_per_token:g}"
        + (" per KV head" if layout.kind == "dense" else ""),
        f"vs bfloat16       {compression_ratio(layout, 'bfloat16'):.2f}x smaller",
        f"vs float8         {compression_ratio(layout, 'float8'):.2f}x smaller",
        "",
        f"{'field':<14}{'offset':>8}{'size':>8}  {'dtype':<16}shape",
    ]
    for f in layout.fields:
        dtype = f"codes u{f.bits}" if f.dtype == "codes" else f.dtype
        shape = "x".join(map(str, f.shape))
        lines.append(f"{f.name:<14}{f.offset:>8}{f.size:>8}  {dtype:<16}[{shape}]")
    return "\n".join(lines)


def _plain_tokens(memory: int, layout: RecordLayout, heads: int, layers: int, base: str) -> int:
    """Tokens an unquantized ``base`` cache of the same model holds in ``memory`` bytes, in
    whole blocks of the format's block size (as a paged cache allocates them)."""
    per_block = baseline_bytes_per_token(layout, base) * heads * layers * layout.block_size
    return memory // per_block * layout.block_size


def _capacity(layout: RecordLayout, args: argparse.Namespace) -> str:
    """Tokens a cache of ``args.memory_gib`` holds with ``layout`` (the exact pools of
    ``args.max_requests`` requests set aside first) and with bf16 and fp8 caches."""
    memory = int(args.memory_gib * GIB)
    heads = args.kv_heads if layout.kind == "dense" else 1
    pool = (args.pool_dtype, args.exact_blocks)
    tokens = tokens_that_fit(memory, layout, args.layers, heads, args.max_requests, *pool)
    pools = args.max_requests * exact_pool_bytes_per_request(layout, args.layers, heads, *pool)
    model = f"{args.layers} layers" + (f", {heads} KV heads" if layout.kind == "dense" else "")
    rope = f" + RoPE {layout.rope_dim}" if layout.rope_dim else ""
    lines = [
        f"{layout.format_name}  ({model}, head_dim {layout.head_dim}{rope}; "
        f"{args.memory_gib:g} GiB)",
        f"exact pools       {pools / 2**20:,.1f} MiB ({args.max_requests} requests x "
        f"{args.exact_blocks} block(s) of {args.pool_dtype})",
        f"{'cache':<18}{'tokens':>14}{'vs bfloat16':>14}",
    ]
    bf16 = _plain_tokens(memory, layout, heads, args.layers, "bfloat16")
    rows = [(layout.format_name, tokens)]
    for base in ("bfloat16", "float8"):
        rows.append((base, _plain_tokens(memory, layout, heads, args.layers, base)))
    for name, count in rows:
        lines.append(f"{name:<18}{count:>14,}{count / bf16:>13.2f}x")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvarn-formats",
        description="Describe KVarN KV-cache formats and their records, and size a cache.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    describe = sub.add_parser("describe", help="byte layout of one format")
    describe.add_argument("name", help="e.g. kvarn_k4v2_g64 or kvarn_mla_k5_g64")
    describe.add_argument("--head-dim", type=int, default=None, help="dense only (default 128)")
    describe.add_argument("--json", action="store_true", help="print the JSON layout")
    sub.add_parser("list", help="every valid format name")
    cap = sub.add_parser("capacity", help="tokens a cache holds, against bf16 and fp8 caches")
    cap.add_argument("name", help="e.g. kvarn_k4v2_g64 or kvarn_mla_k5_g64")
    cap.add_argument("--memory-gib", type=_positive_float, required=True, help="cache memory")
    cap.add_argument("--layers", type=_positive_int, required=True, help="attention layers")
    cap.add_argument("--kv-heads", type=_positive_int, help="KV heads per layer (dense only)")
    cap.add_argument("--head-dim", type=int, default=None, help="dense only (default 128)")
    cap.add_argument(
        "--max-requests", type=_positive_int, default=256,
        help="concurrent requests, each holding an exact pool (default 256)",
    )  # fmt: skip
    cap.add_argument(
        "--pool-dtype", choices=POOL_DTYPES, default="bfloat16",
        help="element type of the exact pool (default bfloat16)",
    )  # fmt: skip
    cap.add_argument(
        "--exact-blocks", type=_positive_int, default=1,
        help="exact blocks per request (default 1: the block still filling)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        print("\n".join(all_format_names()))
        return 0
    try:
        fmt = parse_format(args.name)
        head_dim = args.head_dim
        if head_dim is None and not isinstance(fmt, MlaFormat):
            head_dim = 128
        layout = layout_for(fmt, head_dim)
        if args.command == "capacity":
            if layout.kind == "dense" and args.kv_heads is None:
                raise ValueError("--kv-heads is required for a dense format")
            if layout.kind != "dense" and args.kv_heads is not None:
                raise ValueError("--kv-heads is for dense formats (an MLA cache has one latent)")
            print(_capacity(layout, args))
            return 0
    except (FormatError, LayoutError, ValueError) as exc:
        print(f"kvarn-formats: error: {exc}", file=sys.stderr)
        return 2
    print(layout.to_json() if args.json else _table(layout))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
