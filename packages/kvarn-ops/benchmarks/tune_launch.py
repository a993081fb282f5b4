"""Sweep the launch knobs of the gather/scatter kernels on a CUDA GPU (one run, one JSON).

Each knob is a module-level function or constant of a kernel module (``store.tokens_per_program``,
``store.warps_per_program``, ...); a configuration replaces some of them by constants for the
duration of one measurement, through the benchmark functions of ``bench_kernels.py`` and
``bench_mla.py``. The first configuration of every op is the shipped default. The fastest
configuration per op is printed last; change the module's function to it by hand.

    python benchmarks/tune_launch.py --out results/tune.json [--ops store,materialize]

Ops: store, store_fp8, materialize (dense), flush (dense), mla_stage_random, mla_stage_sorted
(the staging rows also give ``sector_fraction_of_copy``, see ``bench_kernels.bench_mla_gather``),
mla_materialize, mla_decode_b8, mla_decode_b64, mla_decode_h128.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels  # noqa: E402
import bench_mla  # noqa: E402


#: op -> (benchmark call, {knob: candidate values}); a knob is "module.attribute" under
#: kvarn_ops.kernels. The cartesian product is measured; None keeps the shipped value.
def _mla_decode(bits, batch, heads, context, splits):
    ms, nbytes = bench_mla.bench_decode(bits, batch, heads, context, splits)
    return dict(
        op="mla_decode", shape=f"k{bits} B={batch} H={heads} L={context}", ms=ms, bytes=nbytes
    )


SWEEPS = {
    "store": (
        lambda: bench_kernels.bench_store(128, 8, 32768, 64, torch.bfloat16),
        {
            "store.tiles_per_program": [None, 4, 16],
            "store.pipeline_stages": [None, 1, 2],
        },
    ),
    "store_fp8": (
        lambda: bench_kernels.bench_store(128, 8, 32768, 64, torch.float8_e4m3fn),
        {
            "store.tiles_per_program": [None, 2, 16],
            "store.pipeline_stages": [None, 1, 2],
        },
    ),
    # How the fp8 quotient is formed (store.FP8_QUOTIENT: 2 folded, 1 reciprocal + residual).
    "store_fp8_quotient": (
        lambda: bench_kernels.bench_store(128, 8, 32768, 64, torch.float8_e4m3fn),
        {"store.FP8_QUOTIENT": [None, 1, None, 1]},
    ),
    "materialize": (
        lambda: bench_kernels.bench_materialize("kvarn_k4v2_g64", 128, 8, 16, 8192, torch.bfloat16),
        {
            "materialize.materialize_maxnreg": [None, 0],
        },
    ),
    "materialize_mma": (
        lambda: bench_kernels.bench_materialize("kvarn_k4v2_g64", 128, 8, 16, 8192, torch.bfloat16),
        {"materialize.MMA_MAXNREG": [None, 184, 168]},
    ),
    **{
        f"materialize_mma_{fmt[6:]}": (
            lambda fmt=fmt: bench_kernels.bench_materialize(fmt, 128, 8, 16, 8192, torch.bfloat16),
            {"materialize.MMA_MAXNREG": [None, 184, 168]},
        )
        for fmt in ("kvarn_k4v4_g64", "kvarn_k4v2_g128", "kvarn_k4v4_g128")
    },
    "flush": (
        lambda: bench_kernels.bench_flush("kvarn_k4v2_g64", 128, 8, 4096, torch.bfloat16),
        {"flush.warps_for": [None, 8, 16]},
    ),
    # MLA staging and materialize for random slots and for the same slots sorted by block.
    **{
        f"mla_stage_{order}": (
            lambda order=order: bench_kernels.bench_mla_gather(4, 65536, 8192, True, order),
            {"mla_gather.STAGE_TOKENS": [None, 16, 32, 64], "mla_gather.STAGE_WARPS": [None, 2, 8]},
        )
        for order in ("random", "sorted")
    },
    "mla_materialize": (
        lambda: bench_kernels.bench_mla_gather(4, 65536, 8192, False, "random"),
        {"mla_gather.MATERIALIZE_TOKENS": [None, 32], "mla_gather.MATERIALIZE_WARPS": [None, 8]},
    ),
    "mla_decode_b8": (
        lambda: _mla_decode(4, 8, 16, 32768, 128),
        {"mla_decode.MAXNREG": [None, 128], "mla_decode.CTAS_PER_SM": [None, 4]},
    ),
    "mla_decode_b64": (
        lambda: _mla_decode(4, 64, 16, 16384, 128),
        {"mla_decode.MAXNREG": [None, 128]},
    ),
    "mla_decode_h128": (
        lambda: _mla_decode(4, 32, 128, 8192, 128),
        {"mla_decode.NUM_WARPS": [None]},
    ),
}


def _patch(knob: str, value):
    mod_name, attr = knob.rsplit(".", 1)
    mod = importlib.import_module(f"kvarn_ops.kernels.{mod_name}")
    old = getattr(mod, attr)
    new = (lambda *a, _v=value, **k: _v) if callable(old) else value
    setattr(mod, attr, new)
    return mod, attr, old


def run_op(name: str, bw: float) -> list[dict]:
    call, knobs = SWEEPS[name]
    names = list(knobs)
    rows = []
    # One untimed pass with the shipped configuration first: the first measurement of a sweep
    # read up to 25% slow on the H200 (store after the fp8 store's sweep: 0.111 ms, then
    # 0.086-0.087 ms for the same configuration, results/tune_h200_2026-11-30_store_fp8.json).
    call()
    for values in itertools.product(*(knobs[k] for k in names)):
        config = {k: v for k, v in zip(names, values, strict=True) if v is not None}
        patched = [_patch(k, v) for k, v in config.items()]
        try:
            r = call()
            r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
            r["fraction_of_copy"] = r["bytes"] / (r["ms"] * 1e-3) / bw
            if "sector_bytes" in r:
                r["sector_fraction_of_copy"] = r["sector_bytes"] / (r["ms"] * 1e-3) / bw
        except Exception as exc:  # a configuration that does not compile is a result too
            r = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            for mod, attr, old in reversed(patched):
                setattr(mod, attr, old)
        r["op_sweep"] = name
        r["config"] = {k: repr(v) for k, v in config.items()}
        rows.append(r)
        print(name, r["config"], r.get("ms"), r.get("error", ""), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ops", default=",".join(SWEEPS))
    ap.add_argument(
        "--timer",
        choices=sorted(bench_kernels.TIMERS),
        default="do_bench",
        help="bench_kernels' timers: do_bench (host cost included where it exceeds the cache "
        "clear) or gpu (the kernels alone); bench_mla's ops keep do_bench",
    )
    args = ap.parse_args(argv)
    bench_kernels.use_timer(args.timer)
    if not torch.cuda.is_available():
        print("tune_launch: no CUDA device; this sweep needs a GPU", file=sys.stderr)
        return 2
    bw = bench_kernels.copy_bandwidth()
    rows = []
    for name in args.ops.split(","):
        rows += run_op(name, bw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            dict(
                device=torch.cuda.get_device_name(),
                time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                timer=args.timer,
                copy_bandwidth_gbps=bw / 1e9,
                rows=rows,
            ),
            indent=2,
        )
    )
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    for name in args.ops.split(","):
        ok = [r for r in rows if r["op_sweep"] == name and "ms" in r]
        if not ok:
            print(f"{name}: no configuration ran")
            continue
        default, best = ok[0], min(ok, key=lambda r: r["ms"])
        print(
            f"{name}: default {default['ms']:.4f} ms ({100 * default['fraction_of_copy']:.1f}%)"
            f" best {best['ms']:.4f} ms ({100 * best['fraction_of_copy']:.1f}%) {best['config']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
