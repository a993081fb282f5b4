"""Where the host time of one kernel call goes (CUDA GPU needed; no timing of the GPU).

Each op is set up by its benchmark function in ``bench_kernels.py``; instead of timing the
call, the call is made ``--calls`` times under ``cProfile`` (after warm-up calls, so no
compilation is counted), the GPU synchronized only at the end. Reports per op the host
microseconds per call (wall clock, without the profiler: the median of five blocks of
``--calls`` calls, each block's mean kept) and the functions with the most
own time per call under the profiler (which adds its own cost to every Python call).

    python benchmarks/host_overhead.py --out results/host.json [--ops store,materialize]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels  # noqa: E402

OPS = {
    "store_bf16": lambda: bench_kernels.bench_store(128, 8, 32768, 64, torch.bfloat16),
    "store_fp8": lambda: bench_kernels.bench_store(128, 8, 32768, 64, torch.float8_e4m3fn),
    "materialize_triton": lambda: _materialize("0"),
    "materialize_mma": lambda: _materialize("1"),
    "decode_b8_32k": lambda: _decode(8, 32768),
    "decode_b1_32k": lambda: _decode(1, 32768),
}


def _decode(batch: int, context: int) -> dict:
    import bench_decode

    from kvarn_ops import kernels

    args, _ = bench_decode.make_inputs(batch, context, 32, 8, 128, "kvarn_k4v2_g64")
    bench_kernels.do_bench(lambda: kernels.decode(*args))
    return {}


def _materialize(mma: str) -> dict:
    os.environ["KVARN_MATERIALIZE_MMA"] = mma
    try:
        return bench_kernels.bench_materialize("kvarn_k4v2_g64", 128, 8, 16, 8192, torch.bfloat16)
    finally:
        os.environ.pop("KVARN_MATERIALIZE_MMA", None)


def _profiler(calls: int, found: dict):
    """A stand-in for ``do_bench``: profiles ``fn`` instead of timing the GPU."""

    def run(fn, **_):
        for _ in range(5):
            fn()
        blocks = [1e3 * bench_kernels.host_ms_per_call(fn, calls) for _ in range(5)]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof)
        rows = []
        for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
            rows.append(
                dict(
                    function=f"{Path(file).name}:{line}({name})",
                    calls_per_call=ncalls / calls,
                    own_us=1e6 * tottime / calls,
                    cumulative_us=1e6 * cumtime / calls,
                )
            )
        rows.sort(key=lambda r: -r["own_us"])
        found.update(
            host_us_per_call=statistics.median(blocks), host_us_blocks=blocks, top=rows[:25]
        )
        return 1.0

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead: no CUDA device; this measurement needs a GPU", file=sys.stderr)
        return 2
    result = {}
    for name in args.ops.split(","):
        found: dict = {}
        bench_kernels.do_bench = _profiler(args.calls, found)
        OPS[name]()
        result[name] = found
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, found in result.items():
        blocks = " ".join(f"{b:.1f}" for b in found["host_us_blocks"])
        print(f"{name}: {found['host_us_per_call']:.1f} us per call on the host ({blocks})")
        for r in found["top"][:10]:
            print(
                f"  {r['own_us']:7.1f} us own {r['cumulative_us']:7.1f} us cum "
                f"{r['calls_per_call']:5.1f}x {r['function']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
