"""The flush's clipping search and normalization in Gluon with layouts chosen by hand: the
``rows`` variants of ``probe_flush_columns.py`` and ``probe_flush_norm.py``.

The search: one tile row per thread (two threads per row for 128-column tiles), the tile in
registers.

Triton chooses the flush tile's register layout itself, and for a ``[128, 64]`` fp32 tile at
4 warps it spreads each row over 16 threads: every per-row sum of the search is then a
shuffle tree, and each row's scalar work (its candidate's step, the refit's quotient, the
comparison) is repeated in each of those threads. Gluon lets the layout be chosen: here a
thread holds a whole row (``size_per_thread = [1, C / TPR]``), so the search's sums are chains
of fused multiply-adds in one thread (``TPR = 2``: one shuffle), and each thread also holds
the weights of its columns. Same candidates, same formulas and order of operations as the
flush's window search (``flush_math.unbiased_clip_search``) but for the order of each sum's
terms; like ``columns`` it returns each row's winning clipping range (a negative step marks
min/max).

Gluon kernels do not run under the Triton interpreter; the probe checks this variant's rows
against the reference on the GPU (``rows as reference``) and a CPU test compiles it for
sm_90a and sm_120a.

The normalization (``_norm_rows_kernel``): the flush's ``flush_math.normalize_tile`` with the
tile held twice, once a row per thread (its row statistics in one thread) and once a column
per thread (two threads per column for 128-row tiles: its column statistics the same way),
the second copy made once through shared memory (``convert_layout``); only the line scales
(R and C values) cross between the two each iteration.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvarn_ops.kernels.flush_rows import normalize, search_plan


@gluon.jit
def _rows_kernel(
    b_ptr,
    lc_ptr,
    out_ptr,
    R: gl.constexpr,
    C: gl.constexpr,
    LEVELS: gl.constexpr,
    TPR: gl.constexpr,
    WARPS: gl.constexpr,
):
    """The window search (``flush_rows.search_plan``, the planned flush's own) of every
    balanced tile ``b [N, R, C]`` with log column scales ``lc [N, C]``: each row's winning
    ``(step, lo)`` into ``out [N, 2R]`` (a negative step marks min/max)."""
    L: gl.constexpr = gl.BlockedLayout([1, C // TPR], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    t = gl.program_id(0)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
    b = gl.load(b_ptr + t * R * C + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0))
    lc = gl.load(lc_ptr + t * C + c)
    code_z, code_s, _, _ = search_plan(b, lc, R, LEVELS, False)
    gl.store(out_ptr + t * 2 * R + r, code_s)
    gl.store(out_ptr + t * 2 * R + R + r, code_z)


@gluon.jit
def _norm_rows_kernel(
    x_ptr,
    out_ptr,
    R: gl.constexpr,
    C: gl.constexpr,
    ITERS: gl.constexpr,
    STD_FLOOR: gl.constexpr,
    TPR: gl.constexpr,
    TPC: gl.constexpr,
    WARPS: gl.constexpr,
):
    """Log scales ``(lr [R], lc [C])`` of the best-balanced iterate of each prescaled tile
    ``x [N, R, C]`` into ``out [N, R + C]`` (``flush_rows.normalize``, the planned flush's
    own)."""
    L: gl.constexpr = gl.BlockedLayout([1, C // TPR], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([R // TPC, 1], [TPC, 32 // TPC], [1, WARPS], [0, 1])
    t = gl.program_id(0)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
    xp = gl.load(x_ptr + t * R * C + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0))
    xt = gl.convert_layout(xp, LT)
    best_lr, best_lc = normalize(xp, xt, R, C, ITERS, STD_FLOOR * STD_FLOOR)
    gl.store(out_ptr + t * (R + C) + r, best_lr)
    ct = gl.arange(0, C, layout=gl.SliceLayout(0, LT))
    gl.store(out_ptr + t * (R + C) + R + ct, best_lc)


def geometry(r: int, c: int) -> tuple[int, int]:
    """``(threads per row, warps)`` of an ``[r, c]`` tile: a row per thread up to 64 columns."""
    tpr = max(1, c // 64)
    warps = r * tpr // 32
    if warps < 1 or r * tpr % 32:
        raise ValueError(f"tile: {r} x {c} does not fill whole warps at {tpr} threads a row")
    return tpr, warps


def search_consts(r: int, c: int, bits: int) -> dict:
    """Constexprs of ``_rows_kernel`` for ``[r, c]`` tiles of ``bits``-bit codes (``WARPS``
    is also the launch's ``num_warps``)."""
    tpr, warps = geometry(r, c)
    return dict(R=r, C=c, LEVELS=(1 << bits) - 1, TPR=tpr, WARPS=warps)


def norm_consts(r: int, c: int, iters: int, std_floor: float) -> dict:
    """Constexprs of ``_norm_rows_kernel`` for ``[r, c]`` tiles."""
    tpr, warps = geometry(r, c)
    tpc = max(1, r // 64)  # threads per column
    if (32 // tpc) * warps != c:
        raise ValueError(f"tile: {r} x {c} has no column layout at {warps} warps")
    return dict(R=r, C=c, ITERS=iters, STD_FLOOR=std_floor, TPR=tpr, TPC=tpc, WARPS=warps)


def compile_offline(kernel, consts: dict, arch: int):
    """Compile ``_rows_kernel`` or ``_norm_rows_kernel`` for ``sm_{arch}`` without a GPU (every
    pointer fp32); returns triton's compiled kernel (``.asm["cubin"]``, ``.asm["ptx"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else "*fp32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options=dict(num_warps=consts["WARPS"]))


def launch_norm_rows(x: torch.Tensor, out: torch.Tensor, iters: int, std_floor: float) -> None:
    """The normalization of every prescaled tile ``x [N, R, C]`` (fp32, contiguous): log
    scales into ``out [N, R + C]``."""
    n, r, c = x.shape
    k = norm_consts(r, c, iters, std_floor)
    _norm_rows_kernel[(n,)](x, out, **k, num_warps=k["WARPS"])


def launch_rows(b: torch.Tensor, lc: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """The search of every tile ``b [N, R, C]`` (fp32, contiguous) with log column scales
    ``lc [N, C]``; each row's winning ``(step, lo)`` into ``out [N, 2R]``."""
    n, r, c = b.shape
    k = search_consts(r, c, bits)
    _rows_kernel[(n,)](b, lc, out, **k, num_warps=k["WARPS"])
