"""Benchmark rotate, store, flush and materialize on a CUDA GPU against copy bandwidth.

Each kernel's bytes moved (the memory-traffic formulas of the op modules) over its mean time,
as GB/s and as a fraction of the device-to-device copy bandwidth (read + write) measured in
the same run. Times are GPU time by default (``--timer gpu``, :func:`do_bench_gpu`: L2 cleared
before each repetition, the host's cost of the call kept out, reported beside it);
``--timer do_bench`` gives triton's ``do_bench``, which counts host time where a call's host
work outlasts its cache clear (the tables of 2026-11-30 .. 2026-12-02 afternoon). Targets
(issue 4): flush >= 50% of copy bandwidth counted on its bf16 input bytes, store and
materialize >= 60%.

    python benchmarks/bench_kernels.py --out results/kernels.json [--head-dim 128]
        [--format kvarn_k4v2_g64] [--kv-heads 8] [--quick] [--timer gpu|do_bench]

The launch knobs of these kernels are swept by ``tune_launch.py``, through the benchmark
functions here (``bench_mla_gather`` times MLA staging and materialize for random or sorted
slots; it also reports ``sector_bytes``: the 512 codes of a staged token lie in 512 dimension
rows of ``8*b`` bytes (the record is dim-major), so one token touches ~512 32-byte sectors,
and each touched block's record read once, plus slots and outputs, is the traffic floor).

Writes JSON (and a PNG bar chart when matplotlib is installed); prints a short table last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import kvarn_formats as kf
import kvarn_ops
from kvarn_ops import kernels
from kvarn_ops.kernels import mla_gather, mla_pack
from kvarn_ops.reference import DEFAULT_CONFIG

TARGETS = {"rotate": None, "store": 0.60, "flush": 0.50, "materialize": 0.60}

#: Host milliseconds per call of the last function ``do_bench_gpu`` timed (argument checks,
#: dispatch and launches, measured while the GPU queue was not full).
LAST_HOST_MS: list[float] = []


def host_ms_per_call(fn, calls: int = 20) -> float:
    """Host time of one call of ``fn`` in ms: ``calls`` calls queued back to back, no sync
    between them (kernel launches return before the GPU runs them)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def do_bench_gpu(fn, warmup: int = 25, rep: int = 100, return_mode: str = "mean", **_):
    """GPU time of ``fn`` alone, with the L2 cleared before every repetition as
    ``triton.testing.do_bench`` does, but without the host's cost of the call.

    ``do_bench`` records a repetition's start event right after the cache clear (a 256 MB
    fill, about 80 us on an H200) and the end event after ``fn`` returns, so when the host
    needs longer than the fill to check arguments and launch ``fn``'s kernels, the GPU waits
    inside the timed interval and the time is the host's. Here a spin kernel
    (``torch.cuda._sleep``) is queued before each repetition's cache clear, long enough (at
    least 4x the host time of a call) that the whole repetition is queued before the GPU
    reaches it. The host time per call goes to ``LAST_HOST_MS``.
    """
    fn()
    torch.cuda.synchronize()
    host = host_ms_per_call(fn)
    LAST_HOST_MS[:] = [host]
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    # ~2e6 cycles per ms at the H200's 1.98 GHz; the spin only needs to outlast the host.
    spin = int(2e6 * max(0.25, 4 * host))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        cache.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    n_warmup = max(1, int(warmup / estimate))
    n_repeat = min(200, max(5, int(rep / estimate)))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for i in range(n_repeat):
        torch.cuda._sleep(spin)
        cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    if return_mode == "all":
        return times
    if return_mode == "median":
        return statistics.median(times)
    if return_mode == "min":
        return min(times)
    if return_mode == "max":
        return max(times)
    return statistics.mean(times)


TIMERS = {"do_bench": do_bench, "gpu": do_bench_gpu}


def use_timer(name: str) -> None:
    """Time the benchmark functions of this module with ``TIMERS[name]``: ``do_bench``
    (triton's, host cost included when it exceeds the cache clear) or ``gpu``
    (``do_bench_gpu``, the kernels' time alone)."""
    global do_bench
    do_bench = TIMERS[name]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * nbytes / (ms * 1e-3)


def bench_rotate(d: int, rows: int, dtype=torch.bfloat16) -> dict:
    x = torch.randn(rows, d, device="cuda", dtype=dtype)
    out = torch.empty_like(x)
    ms = do_bench(lambda: kernels.rotate(x, out))
    nbytes = 2 * x.numel() * x.element_size()
    return dict(
        op="rotate",
        shape=f"[{rows}, {d}] {str(dtype)[6:]}",
        ms=ms,
        bytes=nbytes,
        formula="read numel*itemsize(x) + write numel*itemsize(out)",
    )


def _pool(p, g, hkv, d, dtype):
    base = torch.randn(p, g, hkv, d, device="cuda")
    ek = base.to(dtype)
    ev = torch.randn_like(base).to(dtype)
    fp8 = dtype == torch.float8_e4m3fn
    ks = torch.rand(p, g, hkv, device="cuda") + 0.5 if fp8 else None
    vs = torch.rand(p, g, hkv, device="cuda") + 0.5 if fp8 else None
    return ek, ev, ks, vs


def bench_store(d: int, hkv: int, tokens: int, g: int, pool_dtype) -> dict:
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    p = -(-tokens // g) + 1
    ek, ev, ks, vs = _pool(p, g, hkv, d, pool_dtype)
    slots = torch.randperm(p * g, device="cuda")[:tokens].to(torch.int64)
    ms = do_bench(lambda: kernels.store(k, v, slots, ek, ev, ks, vs))
    e = ek.element_size()
    s = 4 if ks is not None else 0
    nbytes = tokens * hkv * d * 2 * 2 + 8 * tokens + 2 * tokens * hkv * (d * e + s)
    return dict(
        op="store",
        shape=f"T={tokens} Hkv={hkv} D={d} pool {str(pool_dtype)[6:]}",
        ms=ms,
        bytes=nbytes,
        formula="read T*Hkv*D*(2+2) + 8T; write 2*T*Hkv*(D*E + s)",
    )


def bench_flush(
    fmt: str, d: int, hkv: int, blocks: int, pool_dtype, iters: int = 0, sink: float = -1.0
) -> dict:
    """The flush of ``blocks`` full blocks; ``iters`` > 0 replaces ``DEFAULT_CONFIG``'s
    normalization iterations; ``sink`` >= 0 passes ``sink_rows`` with that fraction of the
    blocks marked (token 0; the rest -1), as the vLLM plugin does on every step."""
    config = replace(DEFAULT_CONFIG, iters=iters) if iters else DEFAULT_CONFIG
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    ek, ev, ks, vs = _pool(blocks, g, hkv, d, pool_dtype)
    packed = torch.empty(blocks, hkv, lay.record_bytes, dtype=torch.uint8, device="cuda")
    src = torch.arange(blocks, dtype=torch.int32, device="cuda")
    dst = torch.randperm(blocks, device="cuda").to(torch.int32)
    rows = None
    if sink >= 0:
        marked = torch.rand(blocks, device="cuda") < sink
        rows = torch.where(marked, 0, -1).to(torch.int32)
    ms = do_bench(
        lambda: kernels.flush(ek, ev, ks, vs, src, dst, packed, lay, config=config, sink_rows=rows)
    )
    e = ek.element_size()
    s = 4 if ks is not None else 0
    moved = 2 * blocks * g * hkv * (d * e + s) + 8 * blocks + blocks * hkv * lay.record_bytes
    bf16_in = 2 * blocks * g * hkv * d * 2
    plan = importlib.import_module("kvarn_ops.kernels.flush_plan")
    consts = importlib.import_module("kvarn_ops.kernels.flush").record_constants(lay)
    return dict(
        op="flush",
        # the unmarked blocks' launch (a launch of few blocks splits its tiles instead)
        plan_engine=plan.plan_engine(ek, g, d, consts) or "single pass",
        shape=f"{fmt} N={blocks} Hkv={hkv} D={d} pool {str(pool_dtype)[6:]} iters={config.iters}"
        + (f" sink_rows={sink:g}" if sink >= 0 else ""),
        ms=ms,
        bytes=moved,
        target_bytes=bf16_in,
        formula="target on bf16 input bytes 2*N*G*Hkv*D*2; moved: read "
        "2*N*G*Hkv*(D*E + s) + 8N, write N*Hkv*R",
    )


def bench_materialize(fmt: str, d: int, hkv: int, batch: int, context: int, pool_dtype) -> dict:
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    seq = [context + (i * 7) % g for i in range(batch)]  # most requests end in a partial block
    n_full = [n // g for n in seq]
    nb = sum(n_full) + 1
    ek, ev, ks, vs = _pool(nb, g, hkv, d, pool_dtype)
    packed = torch.empty(nb, hkv, lay.record_bytes, dtype=torch.uint8, device="cuda")
    blocks = torch.arange(nb, dtype=torch.int32, device="cuda")
    kernels.flush(ek, ev, ks, vs, blocks, blocks, packed, lay)
    max_blocks = max(n_full) + 1
    table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    perm = torch.randperm(nb - 1)
    at = 0
    for b, n in enumerate(n_full):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    table = table.cuda()
    tail = torch.full((batch,), nb - 1, dtype=torch.int32, device="cuda")
    seq_t = torch.tensor(seq, dtype=torch.int32, device="cuda")
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq), 0)
    cu = cu.cuda()
    total = sum(seq)
    k_out = torch.empty(total, hkv, d, dtype=torch.bfloat16, device="cuda")
    v_out = torch.empty_like(k_out)
    ms = do_bench(
        lambda: kernels.materialize(
            packed, table, seq_t, ek, ev, ks, vs, tail, lay, k_out, v_out, cu
        )
    )
    e = ek.element_size()
    s = 4 if ks is not None else 0
    tails = sum(n % g for n in seq)
    nbytes = (
        sum(n_full) * hkv * lay.record_bytes
        + tails * 2 * hkv * (d * e + s)
        + 4 * sum(n_full)
        + 2 * total * hkv * d * 2
    )
    mat = importlib.import_module("kvarn_ops.kernels.materialize")
    return dict(
        op="materialize",
        kernel="mma" if mat._use_mma_kernel(lay, packed) else "triton",
        shape=f"{fmt} B={batch} L~{context} Hkv={hkv} D={d} pool {str(pool_dtype)[6:]}",
        ms=ms,
        bytes=nbytes,
        formula="read full*Hkv*R + tail*2*Hkv*(D*E + s) + table; write 2*L*Hkv*D*2",
    )


def _mla_cache(bits: int, num_blocks: int, pool_blocks: int = 8):
    """Records packed from random pool blocks (valid scales), round-robin; bf16 pool."""
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pl = (torch.randn(pool_blocks, 64, 512, device="cuda") * 0.5).to(torch.bfloat16)
    pr = torch.randn(pool_blocks, 64, 64, device="cuda").to(torch.bfloat16)
    packed = torch.zeros(num_blocks, layout.record_bytes, dtype=torch.uint8, device="cuda")
    for s0 in range(0, num_blocks, 4096):
        n = min(4096, num_blocks - s0)
        src = (torch.arange(n, device="cuda") % pool_blocks).int()
        dst = torch.arange(s0, s0 + n, device="cuda").int()
        mla_pack.mla_pack(pl, None, pr, src, dst, packed, layout)
    return layout, packed, pl, pr


def bench_mla_gather(bits: int, tokens: int, num_blocks: int, stage: bool, order: str) -> dict:
    layout, packed, pl, pr = _mla_cache(bits, num_blocks)
    bmap = torch.full((num_blocks,), -1, dtype=torch.int32, device="cuda")
    slots = torch.randint(0, num_blocks * 64, (tokens,), device="cuda")
    if order == "sorted":
        slots = slots.sort().values
    width = 656 if stage else 1152
    if stage:
        out = torch.empty(tokens, 656, dtype=torch.uint8, device="cuda")
        fn = mla_gather.mla_stage_fp8
    else:
        out = torch.empty(tokens, 576, dtype=torch.bfloat16, device="cuda")
        fn = mla_gather.mla_materialize
    ms = do_bench(lambda: fn(packed, bmap, pl, None, pr, slots, layout, out))
    nbytes = tokens * (64 * bits + 128 + 2 * 1024 // 64 + 8 + width)
    touched = int(torch.unique(slots // 64).numel())
    return dict(
        op="mla_stage" if stage else "mla_materialize",
        shape=f"k{bits} T={tokens} blocks={num_blocks} {order}",
        ms=ms,
        bytes=nbytes,
        sector_bytes=touched * layout.record_bytes + tokens * (8 + width),
        formula=f"per token 64*b + 128 + 32 + 8 read, {width} written",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--format", default="kvarn_k4v2_g64")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, one pool dtype")
    ap.add_argument(
        "--ops",
        default="rotate,store,flush,materialize",
        help="comma-separated subset of rotate, store, flush, materialize",
    )
    ap.add_argument(
        "--timer",
        choices=sorted(TIMERS),
        default="gpu",
        help="do_bench (host cost included where it exceeds the cache clear), gpu (kernels alone)",
    )
    ap.add_argument(
        "--flush-iters",
        type=int,
        default=0,
        help="the flush's normalization iterations; 0 = DEFAULT_CONFIG's",
    )
    ap.add_argument(
        "--flush-sink",
        type=float,
        default=-1.0,
        help="pass sink_rows to the flush with this fraction of blocks marked (0: all -1); "
        "negative (default): no sink_rows",
    )
    args = ap.parse_args(argv)
    use_timer(args.timer)
    ops = set(args.ops.split(","))
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    d, hkv, fmt = args.head_dim, args.kv_heads, args.format
    g = kf.dense_layout(fmt, d).block_size
    scale = 1 if args.quick else 4
    pools = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float8_e4m3fn]
    bw = copy_bandwidth()
    rows = []

    def add(row):
        if args.timer == "gpu":
            row["host_ms_per_call"] = LAST_HOST_MS[0]
        rows.append(row)

    if "rotate" in ops:
        add(bench_rotate(d, 65536 * scale))
    for pdt in pools:
        if "store" in ops:
            add(bench_store(d, hkv, 8192 * scale, g, pdt))
        if "flush" in ops:
            add(bench_flush(fmt, d, hkv, 1024 * scale, pdt, args.flush_iters, args.flush_sink))
        if "materialize" in ops:
            add(bench_materialize(fmt, d, hkv, 16, 2048 * scale, pdt))
    for r in rows:
        r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["fraction_of_copy"] = r["bytes"] / (r["ms"] * 1e-3) / bw
        basis = r.get("target_bytes", r["bytes"])
        r["target_fraction"] = basis / (r["ms"] * 1e-3) / bw
        r["target"] = TARGETS[r["op"]]
        r["meets_target"] = None if r["target"] is None else r["target_fraction"] >= r["target"]
    result = dict(
        device=torch.cuda.get_device_name(),
        capability=list(torch.cuda.get_device_capability()),
        torch=torch.__version__,
        triton=triton.__version__,
        kvarn_ops=kvarn_ops.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        timer=args.timer,
        copy_bandwidth_gbps=bw / 1e9,
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        labels = [f"{r['op']}\n{r['shape'].split(' pool ')[-1]}" for r in rows]
        ax.bar(range(len(rows)), [100 * r["target_fraction"] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"{result['device']}, copy {bw / 1e12:.2f} TB/s")
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG written")
    print(f"device {result['device']}, copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'op':<12} {'shape':<58} {'ms':>8} {'GB/s':>7} {'% copy':>7} {'target':>7}")
    for r in rows:
        tgt = "-" if r["target"] is None else f"{100 * r['target']:.0f}%"
        print(
            f"{r['op']:<12} {r['shape']:<58} {r['ms']:8.3f} {r['gbps']:7.0f} "
            f"{100 * r['target_fraction']:6.1f}% {tgt:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
