"""Latency of the MLA pack for the few blocks a serving step packs (CUDA GPU, one JSON).

An MLA model has one latent tile per block and layer, so a decode step in which requests
fill blocks packs a handful of them per layer: one program per block, and the launch takes
one program's latency (``flush_latency.py`` says the same of the dense flush). This script
times ``kernels.mla_pack`` at small and large N as CUDA-graph replays (a graph of
``--launches`` launches, median over ``--replays`` replays, per launch) for each entry of
``--parts`` (programs per tile, ``mla_pack_split.FORCE_PARTS``; 0 = the shipped choice, 1 =
the single-program kernel; list 1 first), compares every configuration's records with the
single-program kernel's, and prints a table.

    python benchmarks/mla_pack_latency.py --out results/mla_pack_latency.json
        [--blocks 1,2,4,8,64,2048] [--bits 4] [--pool bf16,fp8] [--parts 1,0,8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mla import random_cache  # noqa: E402
from flush_latency import graph_ms, write_results  # noqa: E402

from kvarn_ops.kernels import mla_pack  # noqa: E402

try:  # builds before the split pack have no such module
    from kvarn_ops.kernels import mla_pack_split  # noqa: E402
except ImportError:
    mla_pack_split = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", default="1,2,4,8,64,2048")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--pool", default="bf16,fp8")
    ap.add_argument("--parts", default="0", help="programs per tile; 0 = the shipped choice")
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_pack_latency.py needs a CUDA GPU")
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    rows = []
    for bits in map(int, args.bits.split(",")):
        for pool in args.pool.split(","):
            for n in map(int, args.blocks.split(",")):
                torch.manual_seed(4321 + n)
                layout, packed, pl, ps, pr = random_cache(bits, max(n, 8), max(n, 8), dtypes[pool])
                src = torch.randperm(max(n, 8), device="cuda")[:n].int()
                dst = torch.randperm(max(n, 8), device="cuda")[:n].int()

                single = None
                for parts in map(int, args.parts.split(",")):
                    row = dict(bits=bits, pool=pool, blocks=n, parts=parts)
                    if mla_pack_split is not None:
                        mla_pack_split.FORCE_PARTS = parts or None
                    elif parts:
                        continue

                    def call(pl=pl, ps=ps, pr=pr, src=src, dst=dst, packed=packed, lay=layout):
                        mla_pack.mla_pack(pl, ps, pr, src, dst, packed, lay)

                    try:
                        call()
                        torch.cuda.synchronize()
                        records = packed[dst.long()].clone()
                        us = graph_ms(call, args.launches, args.replays) * 1e3
                        row.update(us=us, us_per_block=us / n)
                        if parts == 1:
                            single = records
                        elif single is not None:
                            equal = (records == single).float().mean().item()
                            row["bytes_equal_to_single"] = equal
                    except ValueError as exc:  # a split that does not fit the GPU
                        row["error"] = str(exc)[:200]
                    finally:
                        if mla_pack_split is not None:
                            mla_pack_split.FORCE_PARTS = None
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    write_results(args.out, rows, launches=args.launches, replays=args.replays)
    print(f"\n{'bits':>4} {'pool':5} {'N':>5} {'parts':>5} {'us':>10} {'us/block':>9}")
    for r in rows:
        if "us" not in r:
            continue
        per = r["us_per_block"]
        head = f"{r['bits']:>4} {r['pool']:5} {r['blocks']:>5} {r['parts']:>5}"
        print(f"{head} {r['us']:>10.1f} {per:>9.2f}")


if __name__ == "__main__":
    main()
