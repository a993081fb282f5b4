"""Profile the kvarn-ops kernels with Nsight Compute (``ncu``) on a CUDA GPU.

Each op is driven by its benchmark function (``bench_decode``, ``bench_kernels``,
``bench_mla``) with the timing loop replaced by three plain calls; ``ncu`` profiles one launch
of the op's main kernel (the first is skipped: it may carry the JIT compile's first-touch
effects). Clocks are left as they are (``--clock-control none``).

    python benchmarks/profile_ncu.py profile --out DIR [--ops decode_b32,store,...] [--deep]
    python benchmarks/profile_ncu.py run OP        # what ncu runs: the op's three calls

Writes ``DIR/ncu_csv.tar.gz`` (for every op the ``details`` and ``raw`` pages of
``ncu --import``, as CSV) and one summary ``DIR/ncu_summary.json``: duration, DRAM bandwidth,
L1/shared-memory pipe use, issue-slot and tensor-pipe use, occupancy, registers, shared memory,
spills, warp cycles per issued instruction and the stall reasons in cycles per issued
instruction, largest first. A short table is printed last.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: op -> (kernel-name regex for ncu, what it runs)
OPS = {
    "decode_b32": ("_decode_split_kernel", "k4v2 g64, B=32, 16K, 32/8/128"),
    "decode_b1": ("_decode_split_kernel", "k4v2 g64, B=1, 32K, 32/8/128"),
    # The MMA decode kernel (up to 8 query rows per KV head) and its combine, GQA 4.
    "mma_t_b1": ("mma_decode_t_kernel", "k4v2 g64, B=1, 32K, 32/8/128"),
    "combine_b1": ("_decode_combine_kernel", "k4v2 g64, B=1, 32K, 32/8/128"),
    "mma_t_b64": ("mma_decode_t_kernel", "k4v2 g64, B=64, 32K, 32/8/128"),
    "combine_b64": ("_decode_combine_kernel", "k4v2 g64, B=64, 32K, 32/8/128"),
    # the same main kernel with its records from L2 (probe_decode_compute: the block table
    # folded onto 256 physical blocks): what its own work allows
    "mma_t_b64_l2": ("mma_decode_t_kernel", "k4v2 g64, B=64, 32K, 32/8/128, records in L2"),
    # head_dim 64 on head pairs (decode_mma_pair.py) and 256 as two halves (decode_mma_d256.py)
    "mma_pair_b64": ("mma_decode_t_kernel", "k4v2 g64, B=64, 32K, 32/8/64"),
    "mma_d256_b64": ("mma_decode_t256_kernel", "k4v2 g64, B=64, 16K, 16/8/256"),
    "store": ("_store_kernel", "T=32768, Hkv 8, D 128, bf16 pool"),
    "materialize": ("_materialize_kernel", "k4v2 g64, B=16, ~8K, Hkv 8, D 128"),
    # the Gluon full-block kernel (materialize_mma.py)
    "materialize_mma": ("mma_materialize_kernel", "k4v2 g64, B=16, ~8K, Hkv 8, D 128"),
    # the Triton kernel's launch for the exact tails beside it
    "materialize_tails": ("_materialize_kernel", "k4v2 g64, B=16, ~8K, Hkv 8, D 128: tails"),
    "flush": ("_flush_kernel", "k4v2 g64, N=512, Hkv 8, D 128, bf16 pool, single pass"),
    # the bulk flush's one-pass Gluon kernel (flush_onepass.py): its K launch, then its V one
    "flush_onepass_k": ("flush_kernel", "k4v2 g64, N=512, Hkv 8, D 128, bf16 pool: K tiles"),
    "flush_onepass_v": ("flush_kernel", "k4v2 g64, N=512, Hkv 8, D 128, bf16 pool: V tiles"),
    # a decode step's flush: one block, its tiles split over programs (flush.parts_for), and
    # the same with one program per tile
    "flush_step": ("_flush_kernel", "k4v2 g64, N=1, Hkv 8, D 128, bf16 pool, split tiles"),
    "flush_step_p1": ("_flush_kernel", "k4v2 g64, N=1, Hkv 8, D 128, bf16 pool, 1 per tile"),
    "mla_decode_b64": ("_mla_decode_kernel", "k4, B=64, 16 heads, 16K"),
    # the Gluon mma.sync MLA decode kernel (mla_decode_mma.py)
    "mla_mma_b64": ("mla_mma_kernel", "k4, B=64, 16 heads, 16K, 128 splits"),
    "mla_mma_b1": ("mla_mma_kernel", "k4, B=1, 16 heads, 32K, 128 splits"),
    # the Gluon wgmma MLA decode kernel (mla_decode_wgmma.py, sm_90)
    "mla_wgmma_b64": ("mla_wgmma_kernel", "k4, B=64, 16 heads, 16K, default splits"),
    "mla_wgmma_b8": ("mla_wgmma_kernel", "k4, B=8, 16 heads, 32K, default splits"),
    "mla_wgmma_k5b64": ("mla_wgmma_kernel", "k5, B=64, 16 heads, 16K, default splits"),
    # the 64-head wgmma kernel (mla_decode_wgmma64.py, sm_90)
    "mla_wgmma64_b32": ("mla_wgmma64_kernel", "k4, B=32, 128 heads, 8K, default splits"),
    "mla_stage": ("_mla_gather_kernel", "k4, 65,536 random tokens"),
}

#: launches of the op's kernel skipped before the one profiled (default 1: the first may carry
#: the JIT compile's first-touch effects); the one-pass flush launches K, then V tiles
SKIP = {"flush_onepass_k": 2, "flush_onepass_v": 1}

SECTIONS = [
    "SpeedOfLight",
    "LaunchStats",
    "Occupancy",
    "SchedulerStats",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
    "InstructionStats",
]

#: raw metric -> summary key
RAW = {
    "gpu__time_duration.sum": "duration_us",
    "dram__bytes.sum.per_second": "dram_gbps",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1tex_pct",
    "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed": "lsu_wavefronts_pct",
    "sm__inst_issued.avg.pct_of_peak_sustained_elapsed": "issue_pct",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block": "smem_kb",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__waves_per_multiprocessor": "waves",
    "derived__local_spilling_requests": "spill_requests",
    "smsp__average_warp_latency_per_inst_issued.ratio": "warp_cycles_per_issue",
    "smsp__inst_issued.sum": "instructions",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def _fake_do_bench(fn, *args, **kwargs):
    for _ in range(3):
        fn()
    import torch

    torch.cuda.synchronize()
    return 1.0


def run(op: str) -> None:
    import torch
    import triton

    triton.testing.do_bench = _fake_do_bench
    triton.testing.do_bench_cudagraph = _fake_do_bench
    import bench_decode
    import bench_kernels
    import bench_mla

    bench_kernels.do_bench = _fake_do_bench
    if op.startswith(("decode_", "mma_t_", "combine_")):
        size = op.removesuffix("_l2").rsplit("_", 1)[1]
        b, ctx = {"b32": (32, 16384), "b1": (1, 32768), "b64": (64, 32768)}[size]
        if op.startswith("decode_"):  # the Triton split kernel
            bench_decode.kd._use_mma_kernel = lambda *a, **k: False
        args, _ = bench_decode.make_inputs(b, ctx, 32, 8, 128, "kvarn_k4v2_g64")
        if op.endswith("_l2"):
            import probe_decode_compute

            args = probe_decode_compute.fold_block_table(args, 256)
        _fake_do_bench(lambda: bench_decode.kd.decode(*args))
    elif op == "mma_pair_b64":
        args, _ = bench_decode.make_inputs(64, 32768, 32, 8, 64, "kvarn_k4v2_g64")
        _fake_do_bench(lambda: bench_decode.kd.decode(*args))
    elif op == "mma_d256_b64":
        args, _ = bench_decode.make_inputs(64, 16384, 16, 8, 256, "kvarn_k4v2_g64")
        _fake_do_bench(lambda: bench_decode.kd.decode(*args))
    elif op == "store":
        bench_kernels.bench_store(128, 8, 32768, 64, torch.bfloat16)
    elif op in ("materialize", "materialize_mma", "materialize_tails"):
        if op == "materialize":  # the Triton kernel for every block
            os.environ["KVARN_MATERIALIZE_MMA"] = "0"
        bench_kernels.bench_materialize("kvarn_k4v2_g64", 128, 8, 16, 8192, torch.bfloat16)
    elif op == "flush":
        importlib.import_module("kvarn_ops.kernels.flush_plan").FORCE_PLAN = "off"
        bench_kernels.bench_flush("kvarn_k4v2_g64", 128, 8, 512, torch.bfloat16)
    elif op.startswith("flush_onepass"):
        importlib.import_module("kvarn_ops.kernels.flush_plan").FORCE_PLAN = "fused"
        bench_kernels.bench_flush("kvarn_k4v2_g64", 128, 8, 512, torch.bfloat16)
    elif op in ("flush_step", "flush_step_p1"):
        if op == "flush_step_p1":
            importlib.import_module("kvarn_ops.kernels.flush").FORCE_PARTS = 1
        bench_kernels.bench_flush("kvarn_k4v2_g64", 128, 8, 1, torch.bfloat16)
    elif op == "mla_decode_b64":
        bench_mla.mla_decode.MMA_KERNEL = False  # the Triton kernel
        bench_mla.bench_decode(4, 64, 16, 16384, 128)
    elif op.startswith("mla_mma_"):
        os.environ["KVARN_MLA_WGMMA"] = "0"  # the mma.sync kernel on sm_90 too
        b, ctx = {"b64": (64, 16384), "b1": (1, 32768)}[op.rsplit("_", 1)[1]]
        bench_mla.bench_decode(4, b, 16, ctx, 128)
    elif op.startswith("mla_wgmma_"):
        cases = {"b64": (4, 64, 16384), "b8": (4, 8, 32768), "k5b64": (5, 64, 16384)}
        bits, b, ctx = cases[op.rsplit("_", 1)[1]]
        bench_mla.bench_decode(bits, b, 16, ctx, None)  # the workspace's own split count
    elif op == "mla_wgmma64_b32":
        bench_mla.bench_decode(4, 32, 128, 8192, None)
    elif op == "mla_stage":
        bench_kernels.bench_mla_gather(4, 65536, 8192, True, "random")
    else:
        raise ValueError(f"op: unknown {op!r} (one of {', '.join(OPS)})")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return math.nan


def _raw_metrics(raw_csv: str) -> dict[str, float]:
    rows = list(csv.reader(io.StringIO(raw_csv)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    names, units, values = rows[header], rows[header + 1], rows[header + 2]
    out = {}
    to_us = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
    to_gbps = {"Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}
    for name, unit, value in zip(names, units, values, strict=False):
        v = _number(value)
        if name == "gpu__time_duration.sum":
            v *= to_us.get(unit, math.nan)
        elif name == "dram__bytes.sum.per_second":
            v *= to_gbps.get(unit, math.nan)
        out[name] = v
    return out


def summarize(raw: dict[str, float]) -> dict:
    s = {key: raw.get(name, math.nan) for name, key in RAW.items()}
    stalls = {
        name[len(STALL_PREFIX) : -len(STALL_SUFFIX)]: v
        for name, v in raw.items()
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and v == v
    }
    s["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return s


#: ``--deep``: per-access-type shared/global wavefronts and bank conflicts, and per-SASS-line
#: counters (exported as the ``source`` page)
DEEP_SECTIONS = ["MemoryWorkloadAnalysis_Tables", "SourceCounters"]


def sass_mix(source_csv: str, top: int = 16) -> dict[str, dict[str, float]]:
    """Per SASS opcode (with its modifiers) of a ``source`` page: instructions executed, warp
    stall samples (share of all), shared-memory wavefronts and the excessive ones (bank
    conflicts); the ``top`` opcodes by stall samples."""
    rows = list(csv.reader(io.StringIO(source_csv)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {name: i for i, name in enumerate(rows[header])}
    keys = {
        "instructions": "Instructions Executed",
        "stall_samples": "Warp Stall Sampling (All Samples)",
        "shared_wavefronts": "L1 Wavefronts Shared",
        "shared_wavefronts_excessive": "L1 Wavefronts Shared Excessive",
    }
    mix: dict[str, dict[str, float]] = {}
    for r in rows[header + 1 :]:
        if len(r) < len(col) or not r[col["Source"]].split():
            continue
        words = r[col["Source"]].split()
        opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        entry = mix.setdefault(opcode, dict.fromkeys(keys, 0.0))
        for key, name in keys.items():
            v = _number(r[col[name]])
            entry[key] += 0.0 if math.isnan(v) else v
    total = sum(e["stall_samples"] for e in mix.values()) or 1.0
    for e in mix.values():
        e["stall_share"] = e["stall_samples"] / total
    ranked = sorted(mix.items(), key=lambda kv: -kv[1]["stall_samples"])
    return dict(ranked[:top])


def profile(out: Path, ops: list[str], deep: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict] = {}
    csvs: list[Path] = []
    for op in ops:
        kernel, what = OPS[op]
        rep = out / f"ncu_{op}"
        cmd = ["ncu", "--clock-control", "none", "-f", "-o", str(rep), "-k", f"regex:{kernel}"]
        cmd += ["--launch-skip", str(SKIP.get(op, 1)), "--launch-count", "1"]
        for sec in SECTIONS + (DEEP_SECTIONS if deep else []):
            cmd += ["--section", sec]
        cmd += [sys.executable, str(Path(__file__).resolve()), "run", op]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not rep.with_suffix(".ncu-rep").exists():
            summary[op] = {"what": what, "error": (res.stdout + res.stderr)[-3000:]}
            print(f"{op}: ncu failed (status {res.returncode})", flush=True)
            continue
        pages = {}
        for page in ("details", "raw") + (("source",) if deep else ()):
            extra = ["--print-source", "sass"] if page == "source" else []
            r = subprocess.run(
                ["ncu", "--import", str(rep.with_suffix(".ncu-rep")), "--page", page, "--csv"]
                + extra,
                capture_output=True,
                text=True,
                check=page != "source",
            )
            pages[page] = r.stdout if r.returncode == 0 else r.stderr
            path = out / f"ncu_{op}_{page}.csv"
            path.write_text(pages[page])
            csvs.append(path)
        rep.with_suffix(".ncu-rep").unlink()
        summary[op] = {"what": what, "kernel": kernel, **summarize(_raw_metrics(pages["raw"]))}
        if deep and pages["source"].lstrip().startswith('"Kernel Name"'):
            summary[op]["sass_mix"] = sass_mix(pages["source"])
        print(f"{op}: done", flush=True)
    (out / "ncu_summary.json").write_text(json.dumps(summary, indent=1))
    with tarfile.open(out / "ncu_csv.tar.gz", "w:gz") as tar:
        for path in csvs:
            tar.add(path, arcname=path.name)
            path.unlink()
    print(
        f"{'op':16} {'us':>8} {'GB/s':>6} {'l1%':>5} {'issue%':>6} {'tc%':>5} {'occ%':>5} "
        f"{'regs':>4} {'spill':>7} {'cyc/is':>6}  top stalls (cycles per issued instruction)"
    )
    for op, s in summary.items():
        if "error" in s:
            print(f"{op:16} ncu failed")
            continue
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(s["stalls_per_issue"].items())[:4])
        print(
            f"{op:16} {s['duration_us']:8.1f} {s['dram_gbps']:6.0f} {s['l1tex_pct']:5.1f} "
            f"{s['issue_pct']:6.1f} {s['tensor_pct']:5.1f} {s['achieved_occupancy_pct']:5.1f} "
            f"{s['registers']:4.0f} {s['spill_requests']:7.0f} "
            f"{s['warp_cycles_per_issue']:6.1f}  {top}"
        )
    return 0 if all("error" not in s for s in summary.values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument(
        "--deep",
        action="store_true",
        help="also shared-memory tables and per-SASS-line counters (the source page)",
    )
    r = sub.add_parser("run")
    r.add_argument("op", choices=list(OPS))
    a = ap.parse_args(argv)
    if a.cmd == "run":
        run(a.op)
        return 0
    ops = [o for o in a.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"--ops: unknown {bad} (known: {', '.join(OPS)})")
    return profile(a.out, ops, a.deep)


if __name__ == "__main__":
    sys.exit(main())
