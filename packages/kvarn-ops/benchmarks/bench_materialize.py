"""Dense materialize on a CUDA GPU: the Gluon full-block kernel against the Triton kernel.

The paths are timed in one process, interleaved, several rounds; each measurement is next to
its own copy-bandwidth measurement (so a slower machine state shows in both), and the GPU's
clocks are read (``nvidia-smi``, read only) before each round. Every repetition's time is kept
(``do_bench`` with ``return_mode="all"``): the table printed last holds medians over the
rounds of the means, and the spread of single repetitions.

    python benchmarks/bench_materialize.py --out results/materialize.json [--rounds 3]
        [--timers do_bench,gpu]

Each measurement is made with every timer given (``bench_kernels.TIMERS``): ``gpu`` is the
kernels' time alone; ``do_bench`` also counts the host's cost of a call where it outlasts the
cache clear between repetitions (how the Gluon path's two launches looked slow and erratic).
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


_DO_BENCH = bench_kernels.do_bench


def _recording(reps: list[float], timer: str = "do_bench"):
    """The timer ``bench_kernels.TIMERS[timer]``, keeping every repetition's time (ms) in
    ``reps`` and returning the mean, as the benchmark functions expect."""
    base = bench_kernels.TIMERS[timer]

    def run(fn, **kwargs):
        times = base(fn, return_mode="all", **kwargs)
        reps.extend(times)
        return statistics.mean(times)

    return run


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
    ap.add_argument(
        "--paths",
        default="triton,mma",
        help="triton, mma (the Gluon kernel for full blocks)",
    )
    ap.add_argument(
        "--timers",
        default="do_bench,gpu",
        help="comma-separated: do_bench (triton's: host cost counted where it exceeds the "
        "cache clear), gpu (bench_kernels.do_bench_gpu: the kernels alone)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_materialize: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    rows = []
    paths = args.paths.split(",")
    timers = args.timers.split(",")
    cases = [(f, p) for f in args.formats.split(",") for p in args.pools.split(",")]
    for rnd in range(args.rounds):
        clocks = _clocks()
        for fmt, pool in cases:
            for path, timer in [(p, t) for p in paths for t in timers]:
                os.environ["KVARN_MATERIALIZE_MMA"] = "0" if path == "triton" else "1"
                bw = bench_kernels.copy_bandwidth()
                reps: list[float] = []
                bench_kernels.do_bench = _recording(reps, timer)
                try:
                    r = bench_kernels.bench_materialize(
                        fmt, 128, 8, args.batch, args.context, POOLS[pool]
                    )
                finally:
                    bench_kernels.do_bench = _DO_BENCH
                assert r["kernel"] == path, (r["kernel"], path)
                if timer == "gpu":
                    r["host_ms_per_call"] = bench_kernels.LAST_HOST_MS[0]
                r.update(
                    path=path,
                    timer=timer,
                    rep_ms=reps,
                    round=rnd,
                    format=fmt,
                    pool=pool,
                    copy_gbps=bw / 1e9,
                    fraction_of_copy=r["bytes"] / (r["ms"] * 1e-3) / bw,
                    clocks_before_round=clocks,
                )
                rows.append(r)
                print(rnd, fmt, pool, path, timer, f"{r['ms'] * 1e3:.1f} us", flush=True)
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
    print(f"{'format':16} {'pool':5} {'path':7} {'timer':8} {'mean us':>8} {'%copy':>6} "
          f"{'rep min':>8} {'rep med':>8} {'rep max':>8} {'slow reps':>9}")  # fmt: skip
    for fmt, pool in cases:
        for path, timer in [(p, t) for p in paths for t in timers]:
            key = (fmt, pool, path, timer)
            sel = [r for r in rows if (r["format"], r["pool"], r["path"], r["timer"]) == key]
            reps = sorted(t for r in sel for t in r["rep_ms"])
            slow = sum(t > 1.3 * reps[0] for t in reps) / len(reps)
            print(
                f"{fmt:16} {pool:5} {path:7} {timer:8} "
                f"{statistics.median(r['ms'] * 1e3 for r in sel):8.1f} "
                f"{statistics.median(100 * r['fraction_of_copy'] for r in sel):6.1f} "
                f"{reps[0] * 1e3:8.1f} {statistics.median(reps) * 1e3:8.1f} {reps[-1] * 1e3:8.1f} "
                f"{100 * slow:8.0f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
