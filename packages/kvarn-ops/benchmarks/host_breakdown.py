"""Where the host time of one kvarn-ops call goes, without a profiler (CUDA GPU needed).

``host_overhead.py`` profiles with ``cProfile``, which inflates every Python call. Here each
op is called ``--calls`` times in five blocks (GPU synchronized after each block, the
median block's mean kept) and, in separate blocks, with chosen functions wrapped by a
``perf_counter_ns`` timer: the op's checks, its configuration helpers, Triton's
``JITFunction.run`` (binding, cache lookup, launch) and the compiled launcher's
``__call__`` (the C launch). Every op is measured with the recorded-launch fast path off
(``KVARN_FAST_LAUNCH=0``) and on. Wrapping adds about half a microsecond per wrapped call, so
the parts are approximate; the whole-call figure is taken unwrapped.

    python benchmarks/host_breakdown.py --out results/host_breakdown.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _calls_us(fn, calls: int) -> float:
    """Median over five blocks of the mean host microseconds per call."""
    blocks = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        blocks.append(1e6 * (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(blocks)


class Timers:
    """Wraps attributes of modules or classes with accumulating timers."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.n: dict[str, int] = defaultdict(int)
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        orig = getattr(owner, attr)
        ns, n = self.ns, self.n

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return orig(*args, **kwargs)
            finally:
                ns[label] += time.perf_counter_ns() - t0
                n[label] += 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, orig))

    def restore(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo.clear()

    def per_call(self, calls: int) -> dict:
        return {
            k: {"us_per_call": self.ns[k] / 1e3 / calls, "calls_per_call": self.n[k] / calls}
            for k in sorted(self.ns, key=lambda k: -self.ns[k])
        }


def _decode_fn(batch: int, context: int):
    import bench_decode

    from kvarn_ops import kernels

    args, _ = bench_decode.make_inputs(batch, context, 32, 8, 128, "kvarn_k4v2_g64")
    return lambda: kernels.decode(*args)


def _store_fn(tokens: int = 8):
    import bench_kernels

    from kvarn_ops import kernels

    k = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)  # one decode step
    v = torch.randn_like(k)
    ek, ev, ks, vs = bench_kernels._pool(64, 64, 8, 128, torch.bfloat16)
    slots = torch.randperm(64 * 64, device="cuda")[:tokens].to(torch.int64)
    return lambda: kernels.store(k, v, slots, ek, ev, ks, vs)


def _layer_fn(batch: int):
    """A decode step's attention of one layer as the vLLM backend makes it: the new tokens'
    store, then the decode over 32K tokens each (eager: host time and GPU time overlap, the
    larger one is the step's)."""
    store, decode = _store_fn(batch), _decode_fn(batch, 32768)

    def step():
        store()
        decode()

    return step


def _flush_fn(blocks: int = 1):
    """A decode step's flush: ``blocks`` full blocks (k4v2, D 128, 8 KV heads, bf16 pool),
    the first a request's first (its sink row marked)."""
    import bench_kernels

    import kvarn_formats as kf
    from kvarn_ops import kernels

    layout = kf.dense_layout("kvarn_k4v2_g64", 128)
    ek, ev, ks, vs = bench_kernels._pool(64, 64, 8, 128, torch.bfloat16)
    src = torch.arange(blocks, dtype=torch.int32, device="cuda")
    dst = torch.arange(blocks, dtype=torch.int32, device="cuda") + 3
    rows = torch.full((blocks,), -1, dtype=torch.int32, device="cuda")
    rows[0] = 0
    packed = torch.zeros(16, 8, layout.record_bytes, dtype=torch.uint8, device="cuda")
    return lambda: kernels.flush(ek, ev, ks, vs, src, dst, packed, layout, sink_rows=rows)


def _mla_decode_fn(batch: int, heads: int, context: int):
    import bench_mla

    mla_decode = importlib.import_module("kvarn_ops.kernels.mla_decode")
    per = -(-context // 64)
    layout, packed, pl, ps, pr = bench_mla.random_cache(4, batch * per, 8, torch.bfloat16)
    bt = torch.arange(batch * per, device="cuda", dtype=torch.int32).view(batch, -1)
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    bmap = torch.full((batch * per,), -1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    ws = mla_decode.mla_decode_workspace(batch, heads, device="cuda")
    return lambda: mla_decode.mla_decode(
        q, packed, bt, seq, bmap, pl, ps, pr, layout, 0.07, out, ws
    )


def _mla_scatter_fn(tokens: int = 8):
    scatter = importlib.import_module("kvarn_ops.kernels.mla_scatter")
    lat = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    rope = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    pl = torch.empty(64, 64, 512, device="cuda", dtype=torch.bfloat16)
    pr = torch.empty(64, 64, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 64, device="cuda")[:tokens]
    return lambda: scatter.mla_exact_scatter(lat, rope, slots, pl, pr)


def _mla_pack_fn(blocks: int = 1):
    """A decode step's MLA pack: ``blocks`` full latent blocks (k4, bf16 pool)."""
    import bench_mla

    pack = importlib.import_module("kvarn_ops.kernels.mla_pack")
    layout, packed, pl, ps, pr = bench_mla.random_cache(4, 16, 8, torch.bfloat16)
    src = torch.arange(blocks, dtype=torch.int32, device="cuda")
    dst = src + 3
    return lambda: pack.mla_pack(pl, ps, pr, src, dst, packed, layout)


def _mla_stage_fn(tokens: int = 2048):
    """A sparse-MLA decode step's gathers for one request: ``tokens`` selected latents staged
    as fp8 records, after the remap of their logical indices (k4, bf16 pool)."""
    import bench_mla

    gat = importlib.import_module("kvarn_ops.kernels.mla_gather")
    layout, packed, pl, ps, pr = bench_mla.random_cache(4, 256, 8, torch.bfloat16)
    bmap = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    table = torch.randperm(256, device="cuda").to(torch.int32).view(1, 256)
    idx = torch.randperm(256 * 64, device="cuda")[:tokens].to(torch.int32).view(1, tokens)
    req = torch.zeros(1, dtype=torch.int32, device="cuda")
    slots = torch.empty(1, tokens, dtype=torch.int64, device="cuda")
    out = torch.empty(tokens, 656, dtype=torch.uint8, device="cuda")

    def step():
        gat.mla_remap_indices(idx, req, table, slots)
        gat.mla_stage_fp8(packed, bmap, pl, ps, pr, slots.view(-1), layout, out)

    return step


def _materialize_fn(batch: int = 4, context: int = 2048):
    """A prefill chunk's dense materialize: ``batch`` requests of ``context`` cached tokens
    (k4v2 g64, D 128, 8 KV heads, bf16 pool)."""
    import bench_decode

    from kvarn_ops import kernels

    args, _ = bench_decode.make_inputs(batch, context, 32, 8, 128, "kvarn_k4v2_g64")
    cache = args[1:10]  # packed .. layout, as decode takes them after q
    k_out = torch.empty(batch * context, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_out = torch.empty_like(k_out)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * context
    return lambda: kernels.materialize(*cache, k_out, v_out, cu)


OPS = {
    "decode_b1_32k": lambda: _decode_fn(1, 32768),
    "decode_b8_32k": lambda: _decode_fn(8, 32768),
    "store_b8": _store_fn,
    "layer_b1_32k": lambda: _layer_fn(1),
    "layer_b8_32k": lambda: _layer_fn(8),
    "flush_1block": _flush_fn,
    "mla_decode_b8_16h_8k": lambda: _mla_decode_fn(8, 16, 8192),
    "mla_decode_b8_128h_8k": lambda: _mla_decode_fn(8, 128, 8192),
    "mla_scatter_8": _mla_scatter_fn,
    "mla_pack_1block": _mla_pack_fn,
    "mla_remap_stage_2048": _mla_stage_fn,
    "materialize_b4_2k": _materialize_fn,
}


def _wrap_all(tm: Timers) -> None:
    from triton.backends.nvidia import driver as nvdriver
    from triton.runtime import jit

    from kvarn_ops import _validate
    from kvarn_ops.kernels import _common, _fastlaunch

    decode = importlib.import_module("kvarn_ops.kernels.decode")
    store = importlib.import_module("kvarn_ops.kernels.store")
    tm.wrap(jit.JITFunction, "run", "triton JITFunction.run (incl. launch)")
    tm.wrap(nvdriver.CudaLauncher, "__call__", "triton launcher __call__ (C launch)")
    tm.wrap(_fastlaunch.PlanCache, "key", "PlanCache.key")
    tm.wrap(_fastlaunch.PlanCache, "replay", "PlanCache.replay (incl. launch)")
    for name in ("_check_decode_args", "kernel_config", "combine_config", "_use_mma_kernel",
                 "cuda_feature", "chunk_tokens", "launch_or_op", "_launch"):  # fmt: skip
        tm.wrap(decode, name, f"decode.{name}")
    for name in ("check_store_args", "check_device", "_launch"):
        tm.wrap(store, name, f"store.{name}")
    flush = importlib.import_module("kvarn_ops.kernels.flush")
    for name in ("check_config", "check_flush_args", "_launch"):
        tm.wrap(flush, name, f"flush.{name}")
    mla = importlib.import_module("kvarn_ops.kernels.mla_decode")
    for name in ("check_decode_args", "launch_or_op", "_use_wgmma_kernel", "live_splits"):
        tm.wrap(mla, name, f"mla_decode.{name}")
    tm.wrap(_validate, "check_tensor", "_validate.check_tensor (module attribute calls)")
    tm.wrap(_common, "device_capability", "_common.device_capability")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_breakdown: no CUDA device; this measurement needs a GPU", file=sys.stderr)
        return 2
    result = {}
    for name in args.ops.split(","):
        fn = OPS[name]()
        for fast in ("0", "1"):
            os.environ["KVARN_FAST_LAUNCH"] = fast
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            whole = [_calls_us(fn, args.calls) for _ in range(2)]
            tm = Timers()
            _wrap_all(tm)
            try:
                wrapped = _calls_us(fn, args.calls)
                tm.ns.clear()
                tm.n.clear()
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
            finally:
                tm.restore()
            result[f"{name} fast={fast}"] = {
                "host_us_per_call": whole,
                "wrapped_us_per_call": wrapped,
                "parts": tm.per_call(args.calls),
            }
    os.environ.pop("KVARN_FAST_LAUNCH", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, r in result.items():
        w = " / ".join(f"{x:.1f}" for x in r["host_us_per_call"])
        print(f"{name}: {w} us per call (wrapped {r['wrapped_us_per_call']:.1f})")
        for k, v in r["parts"].items():
            print(f"  {v['us_per_call']:7.1f} us {v['calls_per_call']:4.1f}x {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
