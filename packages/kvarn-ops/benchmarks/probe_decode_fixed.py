"""Where a short decode step's fixed time goes: the main kernel and the combine, each alone.

Batch 1 at 32K misses its 50% target on the H200 by a fixed part of about 10 us (BENCHMARKS.md:
a fit of 32K and 128K against blocks per program). This probe times, by CUDA-graph replay on
the same inputs (``bench_decode.make_inputs``):

- ``full``: ``decode`` as shipped (main kernel, then the combine as its programmatic
  dependent on sm_90+);
- ``main``: the same call with the combine's launch skipped (outputs unwritten);
- ``combine``: the same call with the main kernel's launch skipped (the combine reads the
  workspace the warm-up call left; its ``griddepcontrol.wait`` has nothing to wait for);
- ``full_nopdl``: ``KVARN_DECODE_PDL=0``, the two launches in order.

``full - main`` is what the combine adds to a step; ``main`` against the blocks it reads is the
main kernel's own fixed part. Timing only: the skipped launches leave outputs unwritten.

``--sweep GEOM:SPLITS:MAXNREG:WARPS[:STAGES]`` (repeatable, comma lists) also times ``full`` of
one geometry for each split count and register cap of the main kernel (``0``: no cap), each
combine warp count and each pipeline depth of the main kernel's block loop (``NBUF``, default
``decode._MMA_STAGES``; ``DECODE_MAX_SPLITS`` raised for the run where a count exceeds it). The
one-warp programs are held to 8 per SM by their 187 registers (Nsight Compute's block limit:
two warps in each scheduler's quarter of the register file) and the default split count gives
about 8 per SM, so more splits only fit in one wave with fewer registers: 3 splits at batch 64
and a 168-register cap make 1,536 programs, 11.6 per SM, 12 resident (measured on an H100:
1.8% slower than 2 splits without the cap; BENCHMARKS.md "2026-12-07").

    python benchmarks/probe_decode_fixed.py --out results/probe_fixed.json [--geoms 0,4,1]
        [--sweep 0:128,256:0,128:8,4 --sweep 3:2,3:0,168:8 --sweep 0:128:0:8:2,3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402

kd = bd.kd


class _Skip:
    """Stands in for a jitted kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _Mods:
    """``decode._mma_module()``'s modules with every main kernel replaced by :class:`_Skip`."""

    def __init__(self, mods):
        self._mods = mods

    def __call__(self):
        out = []
        for m in self._mods:
            ns = type("M", (), {})()
            for name in dir(m):
                if not name.startswith("__"):
                    setattr(ns, name, getattr(m, name))
            for name in ("mma_decode_kernel", "mma_decode_t_kernel", "mma_decode_t256_kernel"):
                if hasattr(m, name):
                    setattr(ns, name, _Skip())
            out.append(ns)
        return tuple(out)


def time_variants(geom, tail: int = 0) -> dict:
    args, nbytes = bd.make_inputs(*geom, tail=tail)
    real_combine, real_mods = kd._decode_combine_kernel, kd._mma_module
    res = {}

    def run(name, env=None):
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            kd.decode(*args)  # compile (and, for "combine", leave a workspace to read)
            torch.cuda.synchronize()
            res[name] = bd.bench(lambda: kd.decode(*args), True)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    run("full")
    run("full_nopdl", {"KVARN_DECODE_PDL": "0"})
    kd._decode_combine_kernel = _Skip()
    try:
        run("main")
    finally:
        kd._decode_combine_kernel = real_combine
    kd.decode(*args)
    torch.cuda.synchronize()
    kd._mma_module = _Mods(real_mods())
    try:
        run("combine")
    finally:
        kd._mma_module = real_mods
    return {"ms": res, "bytes": nbytes}


def with_splits(args: tuple, splits: int) -> tuple:
    """``decode``'s arguments ``args`` (``bench_decode.make_inputs``) with a workspace sized
    for ``splits`` splits (``decode.DECODE_MAX_SPLITS`` must admit the count)."""
    q, layout, seq_lens = args[0], args[9], args[3]
    b, t, hq, d = q.shape
    hkv = args[1].shape[1]
    ws = kd.decode_workspace(
        b, t, hq, hkv, d, int(seq_lens.max()), layout.block_size, device="cuda",
        num_splits=splits,
    )  # fmt: skip
    return args[:12] + (ws,)


def sweep(
    geom,
    splits: list[int],
    maxnregs: list[int],
    warps: list[int],
    stages: list[int] | None = None,
    tail: int = 0,
) -> list[dict]:
    """``full`` of ``geom`` per (splits, maxnreg, combine warps, main-loop stages)."""
    args, nbytes = bd.make_inputs(*geom, tail=tail)
    real_max, real_cfg, real_stages = kd.DECODE_MAX_SPLITS, kd.combine_config, kd._MMA_STAGES
    out = []
    try:
        kd.DECODE_MAX_SPLITS = max(real_max, *splits)
        for s in splits:
            sargs = with_splits(args, s)
            for r, w, n in itertools.product(maxnregs, warps, stages or [real_stages]):

                def cfg(*xs, _w=w):
                    consts, opts = real_cfg(*xs)
                    return consts, dict(opts, num_warps=_w)

                kd._MMA_MAXNREG = r or None
                kd._MMA_STAGES = n
                kd.combine_config = cfg
                kd.decode(*sargs)
                torch.cuda.synchronize()
                ms = bd.bench(lambda a=sargs: kd.decode(*a), True)
                out.append(
                    dict(splits=s, maxnreg=r, combine_warps=w, stages=n, ms=ms, bytes=nbytes)
                )
                print("sweep", out[-1], flush=True)
    finally:
        kd.DECODE_MAX_SPLITS, kd.combine_config, kd._MMA_MAXNREG = real_max, real_cfg, None
        kd._MMA_STAGES = real_stages
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--geoms", default="0,4,1", help="bench_decode.py GEOMS indices")
    ap.add_argument(
        "--sweep", action="append", default=[], help="GEOM:SPLITS:MAXNREG:WARPS[:STAGES]"
    )
    ap.add_argument(
        "--tail",
        type=int,
        default=0,
        help="exact tokens past the last full record of every request (the combine folds "
        "them in); 0: contexts of whole records, as bench_decode.py",
    )
    a = ap.parse_args()
    if a.tail < 0:
        raise SystemExit(f"--tail must be >= 0, got {a.tail}")
    bw = bd.copy_bandwidth()
    rows: list[dict] = []
    swept: list[dict] = []
    geoms = [bd.GEOMS[int(i)] for i in a.geoms.split(",")]

    def save():
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        info = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw}
        Path(a.out).write_text(json.dumps({**info, "rows": rows, "sweep": swept}, indent=1))

    for geom in geoms:
        rows.append({"geom": list(geom), "tail": a.tail, **time_variants(geom, a.tail)})
        save()
    for spec in a.sweep:
        gi, *lists = spec.split(":")
        if len(lists) not in (3, 4):
            raise SystemExit(f"--sweep {spec!r}: want GEOM:SPLITS:MAXNREG:WARPS[:STAGES]")
        geom = bd.GEOMS[int(gi)]
        ints = [[int(x) for x in v.split(",")] for v in lists]
        got = sweep(geom, *ints, tail=a.tail)
        swept += [{"geom": list(geom), "tail": a.tail, **r} for r in got]
        save()
    names = ["full", "full_nopdl", "main", "combine"]
    print("geometry".ljust(34) + "".join(n.rjust(12) for n in names) + "  full %copy")
    for r in rows:
        b, ctx, hq, hkv, d, fmt = r["geom"]
        key = f"B={b} {ctx // 1024}K {hq}/{hkv}/{d} {fmt[6:]}"
        cells = "".join(f"{r['ms'][n] * 1e3:10.1f}us" for n in names)
        print(key.ljust(34) + cells + f"  {100 * r['bytes'] / (r['ms']['full'] * 1e-3) / bw:.1f}")
    for r in swept:
        pct = 100 * r["bytes"] / (r["ms"] * 1e-3) / bw
        b, ctx = r["geom"][:2]
        print(
            f"B={b} {ctx // 1024}K splits {r['splits']:>3} maxnreg {r['maxnreg'] or '-':>3} "
            f"combine warps {r['combine_warps']} stages {r['stages']}: "
            f"{r['ms'] * 1e3:6.1f} us {pct:5.1f}%"
        )


if __name__ == "__main__":
    main()
