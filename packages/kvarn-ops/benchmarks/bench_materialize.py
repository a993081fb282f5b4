"""Dense materialize on a CUDA GPU: the Gluon full-block kernel against the Triton kernel.

Both paths are timed in one process, interleaved, several rounds; each measurement is next to
its own copy-bandwidth measurement (so a slower machine state shows in both), and the GPU's
clocks are read (``nvidia-smi``, read only) before each round. The table printed last holds
medians over the rounds; the JSON holds every measurement.

    python benchmarks/bench_materialize.py --out results/materialize.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels  # noqa: E402

FORMATS = ("kvarn_k4v2_g64", "kvarn_k4v4_g64", "kvarn_k4v2_g128", "kvarn_k4v4_g128")
POOLS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _clocks() -> str:
    try:
        r = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--pools", default="bf16,fp8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_materialize: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    rows = []
    cases = [(f, p) for f in args.formats.split(",") for p in args.pools.split(",")]
    for rnd in range(args.rounds):
        clocks = _clocks()
        for fmt, pool in cases:
            for path in ("triton", "mma"):
                os.environ["KVARN_MATERIALIZE_MMA"] = "1" if path == "mma" else "0"
                bw = bench_kernels.copy_bandwidth()
                r = bench_kernels.bench_materialize(
                    fmt, 128, 8, args.batch, args.context, POOLS[pool]
                )
                assert r["kernel"] == path, (r["kernel"], path)
                r.update(
                    round=rnd,
                    format=fmt,
                    pool=pool,
                    copy_gbps=bw / 1e9,
                    fraction_of_copy=r["bytes"] / (r["ms"] * 1e-3) / bw,
                    clocks_before_round=clocks,
                )
                rows.append(r)
                print(rnd, fmt, pool, path, f"{r['ms'] * 1e3:.1f} us", flush=True)
    os.environ.pop("KVARN_MATERIALIZE_MMA", None)
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'format':16} {'pool':5} {'triton us':>10} {'%copy':>6} {'mma us':>8} {'%copy':>6}")
    for fmt, pool in cases:
        med = {}
        for path in ("triton", "mma"):
            sel = [r for r in rows if r["format"] == fmt and r["pool"] == pool]
            sel = [r for r in sel if r["kernel"] == path]
            med[path] = (
                statistics.median(r["ms"] * 1e3 for r in sel),
                statistics.median(100 * r["fraction_of_copy"] for r in sel),
            )
        t, m = med["triton"], med["mma"]
        print(f"{fmt:16} {pool:5} {t[0]:10.1f} {t[1]:6.1f} {m[0]:8.1f} {m[1]:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
