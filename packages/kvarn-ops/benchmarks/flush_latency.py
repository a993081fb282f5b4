"""Latency of the flush for the few blocks a serving step packs (CUDA GPU, one JSON).

In steady-state decode each request fills a 64-token block every 64 steps, so a step flushes
about batch / 64 blocks per layer, one launch per layer, in the step's critical path. Such a
launch has N * Hkv * 2 programs (a handful to a few hundred), fewer than the GPU's SMs: its
time is one program's latency, not the throughput that ``bench_kernels.py`` measures at
N = 4096. This script times the flush at small N as CUDA-graph replays (a graph of
``--launches`` back-to-back launches, replayed; median over replays, per launch), for each
launch configuration in ``--warps`` (``flush.warps_for`` replaced for the run) and each
``--variants`` entry, and checks every configuration's records against the shipped
configuration's bytes (codes may differ where a reduction order flips a rounding).

    python benchmarks/flush_latency.py --out results/flush_latency.json
        [--blocks 1,4,16,64,256] [--warps 0,8] [--parts 0,1,2,4,8] [--pool bf16,fp8]
        [--iters 4] [--sink 1]

``0`` in ``--warps`` and ``--parts`` (programs per tile, ``flush.FORCE_PARTS``) is the shipped
choice. ``--iters`` times the flush of ``DEFAULT_CONFIG`` with that many normalization
iterations instead (its bytes are then compared with the shipped configuration's of the same
iterations). ``--sink k`` passes ``sink_rows`` with the first k blocks marked (token 0), as
the vLLM plugin does (``--sink 0``: every block -1, its usual step). The table printed last
has one row per N.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

import kvarn_formats as kf
from kvarn_ops.reference import DEFAULT_CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _pool  # noqa: E402

# the module (kvarn_ops.kernels re-exports the function under the same name)
flush_mod = importlib.import_module("kvarn_ops.kernels.flush")


def graph_ms(fn, launches: int, replays: int) -> float:
    """Median GPU time of one call of ``fn``: ``launches`` calls captured in one CUDA graph,
    the graph replayed ``replays`` times, each replay timed by events."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def write_results(out, rows: list, **meta) -> None:
    """``{"meta": ..., "rows": rows}`` as JSON at ``out``; the meta names the GPU and the
    software, plus ``meta``."""
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        **meta,
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def run_case(args, n, pool, warps, parts, reference=None):
    """One configuration at N = ``n``: its row and the records it wrote."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
    d, hkv = args.head_dim, args.kv_heads
    lay = kf.dense_layout(args.format, d)
    g = lay.block_size
    torch.manual_seed(1234 + n)
    pool_blocks = max(n, 8)
    ek, ev, ks, vs = _pool(pool_blocks, g, hkv, d, dtypes[pool])
    shape = (pool_blocks, hkv, lay.record_bytes)
    packed = torch.full(shape, 0xA5, dtype=torch.uint8, device="cuda")
    src = torch.randperm(pool_blocks, device="cuda")[:n].to(torch.int32)
    dst = torch.randperm(pool_blocks, device="cuda")[:n].to(torch.int32)
    shipped = flush_mod.warps_for
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    used = parts or flush_mod.parts_for(n * hkv * 2, g, d, sms)
    if warps:
        flush_mod.warps_for = lambda head_dim, group, parts=1: warps
    flush_mod.FORCE_PARTS = parts or None
    config = replace(DEFAULT_CONFIG, iters=args.iters) if args.iters else DEFAULT_CONFIG
    rows = None
    if args.sink >= 0:  # the first args.sink of the blocks are marked (token 0), as first blocks
        rows = torch.where(torch.arange(n, device="cuda") < args.sink, 0, -1).to(torch.int32)
    try:
        flush_mod.flush(ek, ev, ks, vs, src, dst, packed, lay, config=config, sink_rows=rows)
        torch.cuda.synchronize()
        records = packed[dst.long()].clone()

        def call():
            flush_mod.flush(ek, ev, ks, vs, src, dst, packed, lay, config=config, sink_rows=rows)

        ms = graph_ms(call, args.launches, args.replays)
    finally:
        flush_mod.warps_for = shipped
        flush_mod.FORCE_PARTS = None
    row = dict(
        format=args.format,
        head_dim=d,
        kv_heads=hkv,
        blocks=n,
        pool=pool,
        warps=warps or shipped(d, g, used),
        parts=used,
        iters=config.iters,
        sink_rows_marked=None if rows is None else int((rows >= 0).sum()),
        shipped=not warps and not parts,
        us=ms * 1e3,
        tiles=n * hkv * 2,
    )
    if reference is not None:
        row["bytes_equal_to_shipped"] = (records == reference).float().mean().item()
    return row, records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", default="kvarn_k4v2_g64")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--blocks", default="1,4,16,64,256")
    ap.add_argument("--warps", default="0")
    ap.add_argument("--parts", default="0,1", help="programs per tile; 0 = the shipped choice")
    ap.add_argument("--pool", default="bf16")
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--iters", type=int, default=0, help="normalization iterations; 0 = DEFAULT_CONFIG's"
    )
    ap.add_argument(
        "--sink",
        type=int,
        default=-1,
        help="pass sink_rows with this many blocks marked (0: all -1, the plugin's usual step); "
        "negative (default): no sink_rows",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flush_latency.py needs a CUDA GPU")
    configs = [(int(w), int(pt)) for w in args.warps.split(",") for pt in args.parts.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    rows = []
    for pool, n in itertools.product(args.pool.split(","), blocks):
        ref = None
        for w, pt in configs:
            try:
                row, rec = run_case(args, n, pool, w, pt, ref)
            except Exception as exc:  # a configuration that does not compile or launch
                row = dict(blocks=n, pool=pool, warps=w, parts=pt, error=repr(exc)[:300])
                rec = None
            if ref is None and rec is not None and not w and not pt:
                ref = rec
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_results(args.out, rows, launches=args.launches, replays=args.replays)
    head = " ".join(f"{f'w{w}/p{pt}':>10}" for w, pt in configs)
    print(f"\n{'pool':5} {'N':>5} {'tiles':>6} {head}   (w0/p0: shipped)")
    for pool, n in itertools.product(args.pool.split(","), blocks):
        cells = [r for r in rows if r.get("blocks") == n and r.get("pool") == pool]
        line = " ".join(f"{r['us']:>8.1f}us" if "us" in r else f"{'err':>10}" for r in cells)
        print(f"{pool:5} {n:>5} {n * args.kv_heads * 2:>6} {line}")


if __name__ == "__main__":
    main()
