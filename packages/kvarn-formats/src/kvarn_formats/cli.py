"""``kvarn-formats``: describe and list KV-cache formats."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .capacity import compression_ratio
from .grammar import FormatError, MlaFormat, all_format_names, parse_format
from .layouts import LayoutError, RecordLayout, layout_for


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvarn-formats", description="Describe KVarN KV-cache formats and their records."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    describe = sub.add_parser("describe", help="byte layout of one format")
    describe.add_argument("name", help="e.g. kvarn_k4v2_g64 or kvarn_mla_k5_g64")
    describe.add_argument("--head-dim", type=int, default=None, help="dense only (default 128)")
    describe.add_argument("--json", action="store_true", help="print the JSON layout")
    sub.add_parser("list", help="every valid format name")
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(all_format_names()))
        return 0
    try:
        fmt = parse_format(args.name)
        head_dim = args.head_dim
        if head_dim is None and not isinstance(fmt, MlaFormat):
            head_dim = 128
        layout = layout_for(fmt, head_dim)
    except (FormatError, LayoutError) as exc:
        print(f"kvarn-formats: error: {exc}", file=sys.stderr)
        return 2
    print(layout.to_json() if args.json else _table(layout))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
