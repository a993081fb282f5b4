"""What one exchange between the programs of a split flush tile costs (CUDA GPU, one JSON).

Measured for a flush whose normalization was split over a tile's programs (row statistics
local, column statistics exchanged once per iteration through global memory): tried on
2026-12-04 and not kept (BENCHMARKS.md, "2026-12-04: the flush of a decode step"). A launch
of ``--tiles`` tiles x ``--parts`` programs does nothing but ``NX`` exchanges of three ``[N]``
fp32 partials per program, each depending on the last, and checks that every program of a
tile ends with the same numbers. Timed as CUDA-graph replays (the counters' zeroing inside
the graph); the cost of one exchange is the slope over ``NX``. ``--variants``: ``acquire``
(stores, a barrier, one thread's release increment, acquire polling in every thread) and
``fenced`` (a ``fence.acq_rel.gpu`` in every thread before the increment and after volatile
polling, as the split flush's final count does).

    python benchmarks/probe_exchange.py --out results/probe_exchange.json
        [--tiles 16] [--parts 2,4,8] [--warps 1,4] [--nx 0,10,20]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flush_latency import graph_ms, write_results  # noqa: E402


@triton.jit
def _fence(x):
    return tl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _exchange(
    scr, cnt, slot, part, a, b, c, N: tl.constexpr, PARTS: tl.constexpr, FENCED: tl.constexpr
):
    """Publish ``a, b, c`` in slot ``slot``, wait for the tile's other parts, return every
    part's ``[PARTS, N]`` (the split normalization's exchange)."""
    p = tl.arange(0, PARTS)
    n = tl.arange(0, N)
    base = scr + slot * (PARTS * 4 * N)
    offs = p[:, None] * (4 * N) + n[None, :]
    mine = base + part * (4 * N) + n
    tl.store(mine, a)
    tl.store(mine + N, b)
    tl.store(mine + 2 * N, c)
    if FENCED:
        _fence(part)
    tl.debug_barrier()
    tl.atomic_add(cnt, 1, sem="release", scope="gpu")
    if FENCED:
        seen = tl.load(cnt, volatile=True)
        while seen < (slot + 1) * PARTS:
            seen = tl.load(cnt, volatile=True)
        _fence(part)
    else:
        seen = _load_acquire(cnt)
        while seen < (slot + 1) * PARTS:
            seen = _load_acquire(cnt)
    ga = tl.load(base + offs, cache_modifier=".cg")
    gb = tl.load(base + offs + N, cache_modifier=".cg")
    gc = tl.load(base + offs + 2 * N, cache_modifier=".cg")
    return ga, gb, gc


@triton.jit
def _probe_kernel(
    scr_ptr,
    cnt_ptr,
    out_ptr,
    N: tl.constexpr,
    PARTS: tl.constexpr,
    NX: tl.constexpr,
    FENCED: tl.constexpr,
):
    tile = tl.program_id(0)
    part = tl.program_id(1)
    scr = scr_ptr + tile * (NX * PARTS * 4 * N)
    cnt = cnt_ptr + tile
    n = tl.arange(0, N)
    a = (n * (part + 1) + tile).to(tl.float32)
    for k in range(NX):
        g1, g2, g3 = _exchange(scr, cnt, k, part, a, a * 0.5, a * 0.25, N, PARTS, FENCED)
        a = (tl.sum(g1, axis=0) + tl.sum(g2, axis=0) - tl.sum(g3, axis=0)) * (1.0 / PARTS)
    tl.store(out_ptr + (tile * PARTS + part) * N + n, a)


def run(tiles, parts, warps, nx, fenced, n=128, launches=10, replays=20):
    scr = torch.empty(max(tiles * nx * parts * 4 * n, 1), dtype=torch.float32, device="cuda")
    cnt = torch.zeros(tiles, dtype=torch.int32, device="cuda")
    out = torch.full((tiles, parts, n), float("nan"), device="cuda")

    def call():
        cnt.zero_()
        _probe_kernel[(tiles, parts)](
            scr, cnt, out, N=n, PARTS=parts, NX=nx, FENCED=fenced, num_warps=warps
        )

    ms = graph_ms(call, launches, replays)
    agree = bool((out == out[:, :1]).all()) and bool(out.isfinite().all())
    return ms * 1e3, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", type=int, default=16)
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--warps", default="1,4")
    ap.add_argument("--nx", default="0,10,20")
    ap.add_argument("--variants", default="acquire,fenced")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_exchange.py needs a CUDA GPU")
    rows = []
    for variant in args.variants.split(","):
        for parts in map(int, args.parts.split(",")):
            for warps in map(int, args.warps.split(",")):
                for nx in map(int, args.nx.split(",")):
                    us, agree = run(args.tiles, parts, warps, nx, variant == "fenced")
                    row = dict(variant=variant, tiles=args.tiles, parts=parts, warps=warps)
                    row.update(nx=nx, us=us, programs_agree=agree)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    write_results(args.out, rows)
    print(f"\n{'variant':8} {'parts':>5} {'warps':>5} {'us per exchange':>16} {'agree':>6}")
    nxs = sorted({r["nx"] for r in rows})
    for variant in args.variants.split(","):
        for parts in map(int, args.parts.split(",")):
            for warps in map(int, args.warps.split(",")):
                sel = {
                    r["nx"]: r
                    for r in rows
                    if (r["variant"], r["parts"], r["warps"]) == (variant, parts, warps)
                }
                slope = (sel[nxs[-1]]["us"] - sel[nxs[0]]["us"]) / max(nxs[-1] - nxs[0], 1)
                # without an exchange the parts keep their own numbers
                agree = all(r["programs_agree"] for r in sel.values() if r["nx"] > 0)
                print(f"{variant:8} {parts:>5} {warps:>5} {slope:>16.2f} {agree!s:>6}")


if __name__ == "__main__":
    main()
