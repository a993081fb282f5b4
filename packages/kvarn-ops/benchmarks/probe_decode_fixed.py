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

    python benchmarks/probe_decode_fixed.py --out results/probe_fixed.json [--geoms 0,4,1]
"""

from __future__ import annotations

import argparse
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


def time_variants(geom) -> dict:
    args, nbytes = bd.make_inputs(*geom)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--geoms", default="0,4,1", help="bench_decode.py GEOMS indices")
    a = ap.parse_args()
    bw = bd.copy_bandwidth()
    rows = []
    for i in a.geoms.split(","):
        geom = bd.GEOMS[int(i)]
        r = time_variants(geom)
        rows.append({"geom": list(geom), **r})
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, indent=1)
        )
    names = ["full", "full_nopdl", "main", "combine"]
    print("geometry".ljust(34) + "".join(n.rjust(12) for n in names) + "  full %copy")
    for r in rows:
        b, ctx, hq, hkv, d, fmt = r["geom"]
        key = f"B={b} {ctx // 1024}K {hq}/{hkv}/{d} {fmt[6:]}"
        cells = "".join(f"{r['ms'][n] * 1e3:10.1f}us" for n in names)
        print(key.ljust(34) + cells + f"  {100 * r['bytes'] / (r['ms']['full'] * 1e-3) / bw:.1f}")


if __name__ == "__main__":
    main()
