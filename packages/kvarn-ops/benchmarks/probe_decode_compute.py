"""The decode's compute ceiling: the same launches with every record read from L2.

On an H100 the dense decode at batch 64 and 32K runs at about 96% of the device's copy
bandwidth (3.0 TB/s), so a change to the block loop's arithmetic cannot show there; on the
H200 (4.3 TB/s) the same kernel reaches about 72%: it is bound by its own work, not by memory.
This probe measures that work on any GPU. It times ``decode`` by CUDA-graph replay twice on
the same inputs (``bench_decode.make_inputs``): ``hbm``, as built, and ``l2``, with the block
table folded onto the first ``--resident`` physical blocks (``bt % resident``: every program
reads the same records in the same order as before, but the records total a few MB and stay in
L2). The launches, grid, splits and instructions are identical; only where the bytes come
from differs. ``l2`` over the step's bytes is the rate the kernel's work allows (the
"compute ceiling"); a change that makes the block loop cheaper shows in it whether or not
the GPU's memory hides it.

Switches read at import (``KVARN_DECODE_*``) are compared by running this script once per
setting, in the same call on the same GPU.

    python benchmarks/probe_decode_compute.py --out results/compute.json [--geoms 0,1,3]
        [--resident 256] [--sweep 3:2,3:0,168:2,3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402
import probe_decode_fixed as pf  # noqa: E402

kd = bd.kd


def fold_block_table(args: tuple, resident: int, share: float = 1.0) -> tuple:
    """``args`` with a share of the block table's entries taken modulo ``resident`` (a new
    tensor): every entry at ``share = 1``, else those whose position ``i`` (row-major) has
    ``i % 100 < 100 share``, spread evenly over every request and split."""
    if resident < 1:
        raise ValueError(f"resident must be at least 1, got {resident}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    bt = args[2]
    pos = torch.arange(bt.numel(), device=bt.device).view(bt.shape)
    fold = (pos % 100) < round(100 * share)
    return args[:2] + (torch.where(fold, torch.remainder(bt, resident), bt),) + args[3:]


def _timed(args, nbytes: int) -> dict:
    """CUDA-graph replay median of ``decode(*args)`` (compiled first, outside the capture),
    with the step's bytes over it."""
    kd.decode(*args)
    torch.cuda.synchronize()
    ms = bd.bench(lambda: kd.decode(*args), True)
    return {"ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12}


def _arms(args, resident: int, shares: list[float]):
    yield "hbm", args
    for sh in shares:
        yield ("l2" if sh == 1.0 else f"l2_{sh:g}"), fold_block_table(args, resident, sh)


def time_geom(geom, resident: int, shares: list[float], main_only: bool = False) -> dict:
    """Each arm of ``geom`` by CUDA-graph replay; with ``main_only`` also each arm with the
    combine's launch skipped (``probe_decode_fixed``'s ``main``: outputs unwritten)."""
    args, nbytes = bd.make_inputs(*geom)
    out = {"bytes": nbytes}
    for name, a in _arms(args, resident, shares):
        out[name] = _timed(a, nbytes)
        if main_only:
            real = kd._decode_combine_kernel
            kd._decode_combine_kernel = pf._Skip()
            try:
                out[name + "_main"] = _timed(a, nbytes)
            finally:
                kd._decode_combine_kernel = real
    lay = args[9]
    out["resident_mb"] = resident * args[1].shape[1] * lay.record_bytes / 2**20
    return out


def sweep(
    geom, resident: int, shares: list[float], splits: list[int], maxnregs: list[int],
    stages: list[int],
):  # fmt: skip
    """``hbm`` and ``l2`` of ``geom`` per (splits, register cap of the main kernel (0: none),
    pipeline stages of its block loop)."""
    args, nbytes = bd.make_inputs(*geom)
    real_max, real_stages = kd.DECODE_MAX_SPLITS, kd._MMA_STAGES
    out = []
    try:
        kd.DECODE_MAX_SPLITS = max(real_max, *splits)
        for s in splits:
            sargs = pf.with_splits(args, s)
            for r, n in itertools.product(maxnregs, stages):
                kd._MMA_MAXNREG = r or None
                kd._MMA_STAGES = n
                row = dict(geom=list(geom), splits=s, maxnreg=r, stages=n, bytes=nbytes)
                for name, a in _arms(sargs, resident, shares):
                    row[name] = _timed(a, nbytes)
                out.append(row)
                print("sweep", json.dumps(row), flush=True)
    finally:
        kd.DECODE_MAX_SPLITS, kd._MMA_MAXNREG, kd._MMA_STAGES = real_max, None, real_stages
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--geoms", default="0,1,3", help="comma list of indices into GEOMS")
    ap.add_argument("--resident", type=int, default=256, help="physical blocks kept in L2")
    ap.add_argument(
        "--shares",
        default="1",
        help="comma list of block-table shares read from L2 (1: all; 0.3: a GPU with 1/0.7 "
        "times this one's memory bandwidth, roughly)",
    )
    ap.add_argument(
        "--main-only",
        action="store_true",
        help="also time each arm with the combine's launch skipped (the main kernel alone)",
    )
    ap.add_argument(
        "--sweep", action="append", default=[], help="GEOM:SPLITS:MAXNREG:STAGES (comma lists)"
    )
    a = ap.parse_args()
    shares = [float(x) for x in a.shares.split(",")]
    bw = bd.copy_bandwidth()
    rows = []
    for i in (int(x) for x in a.geoms.split(",")):
        geom = bd.GEOMS[i]
        r = time_geom(geom, a.resident, shares, a.main_only)
        r.update(geom=list(geom), frac_copy_hbm=r["bytes"] / (r["hbm"]["ms"] * 1e-3) / bw)
        rows.append(r)
        print("row", json.dumps(r), flush=True)
    swept: list[dict] = []
    for spec in a.sweep:
        gi, *lists = spec.split(":")
        if len(lists) != 3:
            raise SystemExit(f"--sweep {spec!r}: want GEOM:SPLITS:MAXNREG:STAGES")
        ints = [[int(x) for x in v.split(",")] for v in lists]
        swept += sweep(bd.GEOMS[int(gi)], a.resident, shares, *ints)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw": bw}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"info": info, "rows": rows, "sweep": swept}, indent=1))
    print(f"{info['gpu']}  copy {bw / 1e12:.2f} TB/s; per arm: us, TB/s of the step's bytes")
    for r in rows + swept:
        b, ctx, _, _, d, fmt = r["geom"]
        key = f"B={b} {ctx // 1024}K d{d} {fmt[6:]}"
        if "splits" in r:
            key += f" splits {r['splits']} maxnreg {r['maxnreg'] or '-'} stages {r['stages']}"
        arms = [k for k in r if k.startswith(("hbm", "l2"))]
        cells = "  ".join(f"{k} {r[k]['ms'] * 1e3:7.1f} {r[k]['tbps']:5.2f}" for k in arms)
        print(f"{key:<52} {cells}")


if __name__ == "__main__":
    main()
