"""Would the flush's normalization run faster in layouts chosen by hand? (one JSON)

The companion of ``probe_flush_columns.py`` for the other half of a tile's instructions, the
dual-axis normalization (``flush_math.normalize_tile``, 2 iterations by default). Two ways on
the same prescaled tiles:

- ``tile``: the flush's own ``normalize_tile`` (Triton chooses the layout; every row and
  column statistic is a shuffle tree across the threads sharing the line);
- ``rows`` (``probe_flush_rows.py``, Gluon, GPU only): the tile held a row per thread and a
  column per thread (two threads per column at 128 rows), the second copy made once through
  shared memory; each iteration's statistics in one thread, only the R + C line scales
  exchanged. Offline, sm_90a: 255 registers, 88-96 B of spills, 1,215-1,222 SASS
  instructions an iteration against the k4v2 flush's 1,713-1,724 (counted the same way).

Each is compared with the reference ``reference.quantize.normalize_tiles`` (the default
configuration's iterations and floor) as the fraction of tiles whose log scales are within
1e-4 of the reference's (a tile where two iterates' imbalances tie within rounding can keep
the other one). ``--check`` runs ``tile`` on a few tiles under the interpreter (a CPU test).

    python benchmarks/probe_flush_norm.py --out results/probe_flush_norm.json [--tiles 32768]
    TRITON_INTERPRET=1 python benchmarks/probe_flush_norm.py --check
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels.flush_math import normalize_tile
from kvarn_ops.reference.quantize import DEFAULT_CONFIG, normalize_tiles

SHAPES = {"k": (128, 64), "v": (64, 128)}
TOL = 1e-4


@triton.jit
def _tile_kernel(
    x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, FLOOR: tl.constexpr
):
    t = tl.program_id(0)
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    xp = tl.load(x_ptr + t * R * C + r[:, None] * C + c[None, :])
    lr, lc = normalize_tile(xp, R, C, ITERS, FLOOR)
    tl.store(out_ptr + t * (R + C) + r, lr)
    tl.store(out_ptr + t * (R + C) + R + c, lc)


def make_tiles(n: int, shape: tuple[int, int], device, seed: int = 0) -> torch.Tensor:
    """Prescaled tiles (largest magnitude 1.5, in the flush's prescaled range [1, 2)) with
    log-normal row and column scales, a normalization's work."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r, c = shape
    x = torch.randn(n, r, c, generator=g)
    x = x * torch.exp(0.8 * torch.randn(n, r, 1, generator=g))
    x = x * torch.exp(0.5 * torch.randn(n, 1, c, generator=g))
    x = x * (1.5 / x.abs().amax(dim=(1, 2), keepdim=True))
    return x.to(device)


def launcher(name: str, x: torch.Tensor):
    """``(launch, out)``: the variant's launch on every tile, its ``[N, R + C]`` output."""
    n, r, c = x.shape
    out = torch.full((n, r + c), float("nan"), device=x.device)
    iters, floor = DEFAULT_CONFIG.iters, DEFAULT_CONFIG.std_floor
    if name == "tile":

        def launch():
            _tile_kernel[(n,)](x, out, R=r, C=c, ITERS=iters, FLOOR=floor, num_warps=4)

    elif name == "rows":
        from probe_flush_rows import launch_norm_rows  # Gluon: GPU only

        def launch():
            launch_norm_rows(x, out, iters, floor)

    else:
        raise ValueError(f"variant: unknown {name!r}")
    return launch, out


def agreement(name: str, x: torch.Tensor) -> dict:
    """Fraction of tiles within TOL of the reference's log scales, and the largest gap."""
    launch, out = launcher(name, x)
    launch()
    _, lr, lc, e = normalize_tiles(x.cpu(), DEFAULT_CONFIG)
    if int(e.abs().max()) != 0:  # make_tiles' tiles are prescaled: the reference keeps them
        raise ValueError("x: tiles not in the prescaled range [1, 2)")
    ref = torch.cat([lr, lc], dim=1)
    gap = (out.cpu() - ref).abs().amax(dim=1)
    return dict(within=(gap <= TOL).float().mean().item(), max_gap=gap.max().item())


def check(n: int = 3, seed: int = 0) -> dict:
    return {
        kind: agreement("tile", make_tiles(n, shape, "cpu", seed)) for kind, shape in SHAPES.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="interpreter check, no timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiles", type=int, default=32768)
    ap.add_argument("--variants", default="tile,rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.check:
        print(json.dumps(check(seed=args.seed), indent=1))
        return 0
    if not torch.cuda.is_available():
        print("a CUDA GPU is needed for timing (use --check on a CPU)", file=sys.stderr)
        return 2
    rows = []
    for kind, shape in SHAPES.items():
        x = make_tiles(args.tiles, shape, "cuda", seed=args.seed)
        for name in args.variants.split(","):
            launch, _ = launcher(name, x)
            ms = triton.testing.do_bench(launch)
            ok = agreement(name, x[:512].contiguous())
            rows.append(dict(kind=kind, variant=name, ms=ms, **ok))
            print(f"{kind} {name:5s} {ms:8.3f} ms  tiles as reference {ok['within']:.4f}")
    if args.out:
        meta = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=triton.__version__,
            tiles=args.tiles,
            iters=DEFAULT_CONFIG.iters,
        )
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
