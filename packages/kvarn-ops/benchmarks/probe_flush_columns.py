"""Would the flush's clipping search run faster with its tile out of registers? (one JSON)

The flush holds each [R, C] tile in registers (64 fp32 values per thread at 4 warps), and the
compiler spreads every row over 8-16 threads, so the search's per-row sums go through
shuffles and its per-row work is repeated in each of them; Nsight Compute measured the bulk
flush at 255 registers, two programs per SM and 31% issue use (BENCHMARKS.md, "2026-12-05,
evening"). This probe times the search alone, on the same tiles, four ways:

- ``tile``: the flush's own ``flush_math.unbiased_clip_search`` on the tile in registers
  (offline, sm_90a, 4 warps, R 128 and C 64 or R 64 and C 128: 255 registers and 536 B of
  spills);
- ``columns``: the tile left in global memory column-major (L1/L2 resident while a program
  works on it), one row per thread, a loop over the columns for every sum: the candidate's
  codes and ``sum w c``, then the refit's covariance, then the error (the reference's
  formulas and the flush's expression order, three passes per candidate); offline 40
  registers at R 128 (4 warps) and 32 at R 64 (2 warps), no spills, so the register file no
  longer holds an SM to two programs;
- ``moments``: as ``columns``, one pass per candidate: ``sum w c``, ``sum w c^2`` and
  ``sum w c (b - mean)`` give the refit and the error in closed form (candidates within
  rounding of each other can then order differently from the reference); 40 registers;
- ``rows`` (``probe_flush_rows.py``, Gluon, GPU only): the tile in registers as in ``tile``
  but in a layout chosen by hand, one row per thread (two for 128 columns), so the per-row
  sums need no shuffles and no thread repeats another's row work; offline, sm_90a, 254
  registers and no spills at R 128 (96 B at R 64); its candidate loop is 912-953 SASS
  instructions for 64 elements a thread against ``tile``'s 2,219-2,345 here and 1,582-1,650
  inside the flush (counted the same way).

A flush built the ``columns`` way would also write its normalized tile to a scratch slot of
its own and read it back to pack the codes (8-32 KB per tile, L1/L2 resident); that traffic
is not in the probe's time. All four run the window's candidates (``clip_search="window"``),
so the work is the same; each is compared with the reference (``reference.rounding.round_rows``)
as the fraction of rows with the reference's codes (``columns``, ``moments`` and ``rows``
return the winning clipping range, whose codes are recomputed here). ``--check`` runs a few
tiles of each shape under the interpreter (no timing; a CPU test runs it; ``rows`` is Gluon,
which the interpreter cannot run: a CPU test compiles it instead).

    python benchmarks/probe_flush_columns.py --out results/probe_flush_columns.json
        [--tiles 32768] [--bits 2,4] [--variants tile,columns,moments,rows]
    TRITON_INTERPRET=1 python benchmarks/probe_flush_columns.py --check
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import CLIP_COUNT_BY_LEVELS, clip_ratio, round_half_even
from kvarn_ops.kernels.flush_math import unbiased_clip_search
from kvarn_ops.reference.rounding import round_rows

SHAPES = {"k": (128, 64), "v": (64, 128)}
"""[R, C] of a head_dim-128, G-64 tile: K (rows = channels), V (rows = tokens)."""


@triton.jit
def _tile_kernel(
    b_ptr,
    lc_ptr,
    out_ptr,
    codes_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    LEVELS: tl.constexpr,
    CODES: tl.constexpr,
):
    t = tl.program_id(0)
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    at = t * R * C + r[:, None] * C + c[None, :]
    b = tl.load(b_ptr + at)
    lc = tl.load(lc_ptr + t * C + c)
    codes, step, lo = unbiased_clip_search(b, lc, LEVELS, R, C, False)
    tl.store(out_ptr + t * 2 * R + r, step)
    tl.store(out_ptr + t * 2 * R + R + r, lo)
    if CODES:  # the agreement check only; the timed launches leave the codes
        tl.store(codes_ptr + at, codes.to(tl.uint8))


@triton.jit
def _codes(b, z, inv, LEVELS: tl.constexpr):
    return tl.minimum(tl.maximum(round_half_even((b - z) * inv), 0.0), LEVELS * 1.0)


@triton.jit
def _inverse(s, R: tl.constexpr):
    pos = s > 0.0
    return tl.where(pos, tl.div_rn(tl.full([R], 1.0, tl.float32), tl.where(pos, s, 1.0)), 0.0)


@triton.jit
def _columns_kernel(
    bt_ptr,
    w_ptr,
    out_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    LEVELS: tl.constexpr,
    MOMENTS: tl.constexpr,
):
    t = tl.program_id(0)
    base = bt_ptr + t * R * C + tl.arange(0, R)  # column c of the tile at base + c * R
    wb = w_ptr + t * C
    # Row statistics: range, weighted mean and variance (the flush's formulas).
    sw = tl.load(wb)
    lo0 = tl.load(base)
    hi0 = lo0
    swb = sw * lo0
    for c in tl.range(1, C, loop_unroll_factor=4):
        b = tl.load(base + c * R)
        w = tl.load(wb + c)
        lo0 = tl.minimum(lo0, b)
        hi0 = tl.maximum(hi0, b)
        swb += w * b
        sw += w
    mb = tl.div_rn(swb, sw)
    rsw = tl.div_rn(1.0, sw)
    acc = tl.zeros([R], tl.float32)
    for c in tl.range(0, C, loop_unroll_factor=4):
        d = tl.load(base + c * R) - mb
        acc += tl.load(wb + c) * (d * d)
    vb = tl.div_rn(acc, sw)
    rng = hi0 - lo0
    mid = 0.5 * (hi0 + lo0)
    half = 0.5 * rng
    step0 = tl.div_rn(rng, tl.full([R], LEVELS, tl.float32))
    # Min/max first; a zero-range row keeps it (no error is below -1).
    inv0 = _inverse(step0, R)
    acc = tl.zeros([R], tl.float32)
    for c in tl.range(0, C, loop_unroll_factor=4):
        b = tl.load(base + c * R)
        err = b - (_codes(b, lo0, inv0, LEVELS) * step0 + lo0)
        acc += (err * err) * tl.load(wb + c)
    best_e = tl.where(rng > 0.0, acc, -1.0)
    code_z = lo0
    code_s = -step0
    count: tl.constexpr = CLIP_COUNT_BY_LEVELS[LEVELS]
    for i in tl.range(0, count, loop_unroll_factor=1):
        ratio = clip_ratio(i, count)
        z = mid - ratio * half
        s = half * tl.div_rn(2.0 * ratio, LEVELS * 1.0)
        inv = _inverse(s, R)
        if MOMENTS:
            a1 = tl.zeros([R], tl.float32)
            a2 = tl.zeros([R], tl.float32)
            a3 = tl.zeros([R], tl.float32)
            for c in tl.range(0, C, loop_unroll_factor=4):
                b = tl.load(base + c * R)
                q = _codes(b, z, inv, LEVELS)
                wq = tl.load(wb + c) * q
                a1 += wq
                a2 += wq * q
                a3 += wq * (b - mb)
            mq = a1 * rsw
            cov = a3 * rsw  # the two-round form's mq * sum w (b - mb) is rounding noise
            ok = cov > 0.0
            s_u = tl.where(ok, tl.div_rn(vb, tl.where(ok, cov, 1.0)), s)
            z_u = tl.where(ok, mb - s_u * mq, z)
            # sum w (d - s q - z')^2 with d = b - mb, z' = z_u - mb, sum w d = 0
            zp = z_u - mb
            e = vb * sw - 2.0 * s_u * a3 + s_u * s_u * a2 + 2.0 * s_u * zp * a1 + zp * zp * sw
        else:
            acc = tl.zeros([R], tl.float32)
            for c in tl.range(0, C, loop_unroll_factor=4):
                b = tl.load(base + c * R)
                acc += tl.load(wb + c) * _codes(b, z, inv, LEVELS)
            mq = acc * rsw
            acc = tl.zeros([R], tl.float32)
            for c in tl.range(0, C, loop_unroll_factor=4):
                b = tl.load(base + c * R)
                acc += (tl.load(wb + c) * (_codes(b, z, inv, LEVELS) - mq)) * (b - mb)
            cov = acc * rsw
            ok = cov > 0.0
            s_u = tl.where(ok, tl.div_rn(vb, tl.where(ok, cov, 1.0)), s)
            z_u = tl.where(ok, mb - s_u * mq, z)
            acc = tl.zeros([R], tl.float32)
            for c in tl.range(0, C, loop_unroll_factor=4):
                b = tl.load(base + c * R)
                err = b - (_codes(b, z, inv, LEVELS) * s_u + z_u)
                acc += (err * err) * tl.load(wb + c)
            e = acc
        better = e < best_e
        best_e = tl.where(better, e, best_e)
        code_z = tl.where(better, z, code_z)
        code_s = tl.where(better, s, code_s)
    # The winner's range (a negative step: min/max); its codes are what the flush packs.
    r = tl.arange(0, R)
    tl.store(out_ptr + t * 2 * R + r, code_s)
    tl.store(out_ptr + t * 2 * R + R + r, code_z)


def make_tiles(n: int, shape: tuple[int, int], device, seed: int = 0):
    """Balanced-looking tiles (Gaussian rows, a few outlier columns) and log column scales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r, c = shape
    b = torch.randn(n, r, c, generator=g)
    b[:, :, :2] *= 4.0
    lc = 0.3 * torch.randn(n, c, generator=g)
    return b.to(device), lc.to(device)


def reference_codes(b, lc, bits):
    codes, _, _ = round_rows(b.cpu().float(), lc.cpu().float(), bits, "unbiased_clip", "window")
    return codes


def range_codes(b, out, bits):
    """Codes of each row from a kernel's winning range (``columns``/``moments`` output)."""
    r = b.shape[1]
    s = out[:, :r].cpu()
    z = out[:, r:].cpu()
    s = s.abs()
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    levels = float((1 << bits) - 1)
    q = torch.round((b.cpu() - z[..., None]) * inv[..., None]).clamp_(0, levels)
    return q.to(torch.uint8)


def prepare(name, b, lc, bits, codes=None):
    """A variant's launch on every tile, as a function of nothing (what is timed: the kernel
    alone; the column-major copy and the weights are made here, before). ``codes`` (uint8 like
    ``b``): the ``tile`` kernel also stores its codes there. Returns ``(launch, out)``."""
    n, r, c = b.shape
    levels = (1 << bits) - 1
    out = torch.full((n, 2 * r), float("nan"), device=b.device)
    if name == "tile":
        target = out if codes is None else codes

        def launch():
            _tile_kernel[(n,)](
                b, lc, out, target, R=r, C=c, LEVELS=levels, CODES=codes is not None, num_warps=4
            )

    elif name == "rows":
        from probe_flush_rows import launch_rows  # Gluon: GPU only

        def launch():
            launch_rows(b, lc, out, bits)

    else:
        bt = b.transpose(1, 2).contiguous()
        w = torch.exp(2.0 * (lc - lc.amax(-1, keepdim=True)))
        warps = max(1, min(4, r // 32))
        moments = name == "moments"

        def launch():
            _columns_kernel[(n,)](
                bt, w, out, R=r, C=c, LEVELS=levels, MOMENTS=moments, num_warps=warps
            )

    return launch, out


def run_variant(name, b, lc, bits, codes=None):
    launch, out = prepare(name, b, lc, bits, codes)
    launch()
    return out


def variant_codes(name, b, lc, bits):
    """The variant's codes (a fresh launch on ``b``) and the reference's, both [N, R, C] on the
    CPU."""
    ref = reference_codes(b, lc, bits)
    if name == "tile":
        codes = torch.empty(b.shape, dtype=torch.uint8, device=b.device)
        run_variant(name, b, lc, bits, codes)
        return codes.cpu(), ref
    return range_codes(b, run_variant(name, b, lc, bits), bits), ref


def agreement(name, b, lc, bits):
    """Fraction of rows whose codes equal the reference's (a fresh launch on ``b``)."""
    got, ref = variant_codes(name, b, lc, bits)
    return (got == ref).all(-1).float().mean().item()


def check(n: int = 3, seed: int = 0) -> dict:
    """Every variant on a few tiles of each shape and width against the reference; returns
    the agreement fractions (rows identical to the reference)."""
    res = {}
    for kind, shape in SHAPES.items():
        for bits in (2, 4):
            b, lc = make_tiles(n, shape, "cpu", seed=seed + bits)
            for name in ("tile", "columns", "moments"):
                res[f"{kind}{bits}_{name}"] = agreement(name, b, lc, bits)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="interpreter check, no timing")
    ap.add_argument("--seed", type=int, default=0, help="tiles of --check")
    ap.add_argument("--tiles", type=int, default=32768)
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--variants", default="tile,columns,moments,rows")
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
        for bits in [int(x) for x in args.bits.split(",")]:
            b, lc = make_tiles(args.tiles, shape, "cuda", seed=bits)
            for name in args.variants.split(","):
                launch, _ = prepare(name, b, lc, bits)
                ms = triton.testing.do_bench(launch)
                ok = agreement(name, b[:256], lc[:256], bits)
                rows.append(dict(kind=kind, bits=bits, variant=name, ms=ms, agree=ok))
                print(f"{kind} {bits}-bit {name:8s} {ms:8.3f} ms  rows as reference {ok:.4f}")
    if args.out:
        meta = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=triton.__version__,
            tiles=args.tiles,
            env=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
