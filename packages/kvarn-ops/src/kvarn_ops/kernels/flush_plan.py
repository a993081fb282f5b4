"""The planned flush: a bulk flush in two passes, the quantizer's search apart from the packing.

A tile's flush is compute bound (``flush.py``): its normalization and clipping search are
most of its arithmetic, and in one Triton kernel they share the tile's registers (255 per
thread) with the packing, at a layout Triton chooses. The planned flush splits them:

1. the **plan** (:func:`launch_plan`): per tile, load, prescale, normalize and search, and
   store the result, the log scales ``lr [R]``, ``lc [C]``, each row's winning clipping
   range ``(z, s)`` (``s`` negated where min/max won: no refit) and the step and zero point
   it leads to, ``plan_stride`` fp32 per tile. On a CUDA GPU it is the Gluon kernel of
   ``flush_rows.py`` (a row per thread, one launch per tile kind); under the interpreter (and
   for tests) :func:`_plan_kernel`, the same steps from the single-pass flush's own Triton
   functions (``flush_math``);
2. the **finish**: the flush kernel with ``PLANNED``, which reloads the tile, applies the
   planned scales, rounds it on the winner's range (``flush_math.finish_planned``), folds the
   planned step and zero point, rebalances and packs, as the single pass does after its
   search.

With the Triton plan the two passes give the single pass's records byte for byte (the same
functions in the same order; ``tests/test_flush_plan.py``); with the Gluon plan they differ
only where a sum's order flips a near tie, as the single pass on another GPU would. Only the
bulk launches take it (one program per tile, no sink steps in the launch): a decode step's
flush of a few blocks is latency bound and splits its tiles over programs instead
(``flush.parts_for``), and the marked launch of a flush with sink rows keeps the single pass.

On a CUDA GPU the default is one pass (engine ``"fused"``, ``flush_onepass.py``): the Gluon
program that planned a tile goes on to round, fold and pack it, so there is no plan buffer
and no second read of the tile; the records are the two passes' but where a near tie of the
search falls the other way in one of the two compiled kernels.
``KVARN_FLUSH_FUSED=0`` keeps the two passes (engine ``"gluon"``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import cuda_feature, frexp_exponent, gluon_modules, pow2
from kvarn_ops.kernels._fastlaunch import launch
from kvarn_ops.kernels.flush_math import clip_search_plan, normalize_tile

__all__ = [
    "FORCE_PLAN",
    "launch_onepass",
    "launch_plan",
    "load_prescaled",
    "onepass_supported",
    "plan_engine",
    "plan_stride",
    "plan_warps",
]

#: The plan's engine for the next bulk launch: None = :func:`plan_engine` decides; tests set
#: "triton", "gluon", "fused" or "off".
FORCE_PLAN: str | None = None


def plan_stride(group: int, head_dim: int) -> int:
    """fp32 values of one tile's plan: ``lr [R]``, ``lc [C]``, ``z [R]``, ``s [R]``, ``step
    [R]``, ``lo [R]`` of the larger of the K (``R = D``, ``C = G``) and V (``R = G``, ``C =
    D``) tiles."""
    return max(5 * head_dim + group, 5 * group + head_dim)


def plan_warps() -> int | None:
    """Warps per program of the Gluon plan from ``KVARN_FLUSH_PLAN_WARPS`` (a tuning knob:
    1, 2, 4, 8 or 16), or None for ``flush_rows.geometry``'s default (a row per thread)."""
    value = os.environ.get("KVARN_FLUSH_PLAN_WARPS", "")
    if not value:
        return None
    if value not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"KVARN_FLUSH_PLAN_WARPS: must be 1, 2, 4, 8 or 16, got {value!r}")
    return int(value)


def onepass_supported(consts: dict) -> bool:
    """Whether ``flush_onepass.flush_kernel`` can write the records of a format whose
    ``flush.record_constants`` are ``consts``: 2-, 4- or 8-bit codes on both sides (whole
    codes per 32-bit word) at 4-byte aligned code fields, and no padding between fields."""
    return (
        all(consts[f"{p}_BITS"] in (2, 4, 8) and consts[f"{p}C_OFF"] % 4 == 0 for p in "KV")
        and consts["RECORD_BYTES"] % 4 == 0
        and not any(v for k, v in consts.items() if k.endswith("_PAD"))
    )


def plan_engine(
    exact_k: torch.Tensor, group: int, head_dim: int, consts: dict | None = None
) -> str | None:
    """Which plan a bulk flush on ``exact_k``'s device takes. On a CUDA GPU of compute
    capability 8.0 or newer where this Triton has Gluon and both tile shapes have a layout at
    :func:`plan_warps` (``flush_rows.geometry``), unless ``KVARN_FLUSH_PLAN=0``: ``"fused"``
    (one pass, ``flush_onepass.py``) where the format's record constants ``consts`` are given,
    :func:`onepass_supported` and ``KVARN_FLUSH_FUSED`` is not ``0``; else ``"gluon"`` (the
    plan, then the Triton finish). None elsewhere (the single pass). :data:`FORCE_PLAN`
    overrides ("off": None)."""
    if FORCE_PLAN is not None:
        return None if FORCE_PLAN == "off" else FORCE_PLAN
    if not cuda_feature(exact_k, "KVARN_FLUSH_PLAN", (8, 0)):
        return None
    mods = gluon_modules("flush_rows")
    if mods is None:
        return None
    (rows,) = mods
    warps = plan_warps()
    if (
        rows.geometry(head_dim, group, warps) is None
        or rows.geometry(group, head_dim, warps) is None
    ):
        return None
    fused = os.environ.get("KVARN_FLUSH_FUSED", "1") != "0"
    if (
        fused
        and consts is not None
        and onepass_supported(consts)
        and gluon_modules("flush_onepass") is not None
    ):
        return "fused"
    return "gluon"


@triton.jit
def load_prescaled(
    pool_ptr,
    scale_ptr,
    src,
    head,
    R: tl.constexpr,
    C: tl.constexpr,
    TOKENS_ON_ROWS: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
):
    """Steps 1-2 of the quantizer for one tile of pool block ``src``, KV head ``head``: the
    tile ``[R, C]`` (fp32; an fp8 pool times its token scales) with its non-finite tokens
    zeroed, times ``2**-e``, and the prescale exponent ``e`` (0 for an all-zero tile)."""
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    if FP8 and not TOKENS_ON_ROWS:
        # K from an fp8 pool: 8 channels per thread, as for 16-bit pools. The compiler's
        # choice for one-byte elements (16 per thread) gives each thread 16 channel rows, and
        # every row's per-candidate arithmetic of the clipping search is repeated per thread
        # (offline, sm_90a: 2,570 -> 1,652 instructions per candidate). V keeps it: 16
        # channels per thread leave 4 token rows per thread (1,162 per candidate).
        r = tl.max_contiguous(r, 8)
    if TOKENS_ON_ROWS:
        tok = r[:, None]
        dim = c[None, :]
    else:
        tok = c[None, :]
        dim = r[:, None]
    row = (src * G + tok) * H + head
    x = tl.load(pool_ptr + row * D + dim).to(tl.float32)
    if FP8:
        x = x * tl.load(scale_ptr + row)
    # Step 1: a token holding any NaN/Inf becomes zeros.
    finite = ((x == x) & (tl.abs(x) < float("inf"))).to(tl.int32)
    if TOKENS_ON_ROWS:
        x = tl.where((tl.min(finite, axis=1) > 0)[:, None], x, 0.0)
    else:
        x = tl.where((tl.min(finite, axis=0) > 0)[None, :], x, 0.0)
    # Step 2: prescale by 2**-e, e = floor(log2(max|x|)) (0 for an all-zero tile).
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    e = tl.where(amax > 0.0, frexp_exponent(amax) - 1, 0)
    return x * pow2(-e), e


@triton.jit
def _plan_tile(
    pool_ptr,
    scale_ptr,
    src,
    head,
    base,
    R: tl.constexpr,
    C: tl.constexpr,
    TOKENS_ON_ROWS: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    LEVELS: tl.constexpr,
    SEARCH: tl.constexpr,
    PATTERN: tl.constexpr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
):
    xs, e = load_prescaled(pool_ptr, scale_ptr, src, head, R, C, TOKENS_ON_ROWS, G, H, D, FP8)
    lr, lc = normalize_tile(xs, R, C, ITERS, STD_FLOOR)
    r = tl.arange(0, R)
    tl.store(base + r, lr)
    tl.store(base + R + tl.arange(0, C), lc)
    if SEARCH:
        b = (xs * tl.exp(-lr)[:, None]) * tl.exp(-lc)[None, :]
        z, s, step, lo = clip_search_plan(b, lc, LEVELS, R, PATTERN)
        tl.store(base + R + C + r, z)
        tl.store(base + 2 * R + C + r, s)
        tl.store(base + 3 * R + C + r, step)
        tl.store(base + 4 * R + C + r, lo)


@triton.jit
def _plan_kernel(
    exact_k_ptr,
    exact_v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    src_ptr,
    sink_ptr,
    plan_ptr,
    num_pool_blocks,
    G: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    K_LEVELS: tl.constexpr,
    V_LEVELS: tl.constexpr,
    K_SEARCH: tl.constexpr,
    V_SEARCH: tl.constexpr,
    K_PATTERN: tl.constexpr,
    V_PATTERN: tl.constexpr,
    ITERS: tl.constexpr,
    STD_FLOOR: tl.constexpr,
    STRIDE: tl.constexpr,
    MARKED: tl.constexpr,
):
    """The plan of every tile, in Triton (the interpreter's engine): grid ``(N, Hkv, 2)``."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    which = tl.program_id(2)
    src = tl.load(src_ptr + i).to(tl.int64)
    ok = (src >= 0) & (src < num_pool_blocks)
    if MARKED == 1:
        ok = ok & (tl.load(sink_ptr + i) < 0)
    if ok:
        base = plan_ptr + ((i * H + head) * 2 + which).to(tl.int64) * STRIDE
        if which == 0:
            _plan_tile(
                exact_k_ptr,
                k_scale_ptr,
                src,
                head,
                base,
                D,
                G,
                False,
                G,
                H,
                D,
                FP8,
                K_LEVELS,
                K_SEARCH,
                K_PATTERN,
                ITERS,
                STD_FLOOR,
            )
        else:
            _plan_tile(
                exact_v_ptr,
                v_scale_ptr,
                src,
                head,
                base,
                G,
                D,
                True,
                G,
                H,
                D,
                FP8,
                V_LEVELS,
                V_SEARCH,
                V_PATTERN,
                ITERS,
                STD_FLOOR,
            )


def _tile_kinds(rows, exact_k, exact_v, ks, vs):
    """``(which, pool, scale, R, C, layout constants)`` of the K tiles (``[D, G]``) and the V
    tiles (``[G, D]``) for the Gluon kernels of ``flush_rows`` (``rows``)."""
    _, g, _, d = exact_k.shape
    for which, pool, scale, r, c in ((0, exact_k, ks, d, g), (1, exact_v, vs, g, d)):
        consts = rows.plan_consts(r, c, plan_warps())
        if consts is None:
            raise ValueError(f"exact_k: no row-per-thread layout for a {r} x {c} tile")
        yield which, pool, scale, r, c, consts


def launch_plan(
    engine: str,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    src_pool_blocks: torch.Tensor,
    sink: torch.Tensor,
    plan: torch.Tensor,
    *,
    k_bits: int,
    v_bits: int,
    k_round: int,
    v_round: int,
    pattern_id: int,
    iters: int,
    std_floor: float,
    marked: int,
) -> None:
    """The plans of every tile of a bulk flush into ``plan`` (fp32, ``N * Hkv * 2 *
    plan_stride``): ``engine`` "gluon" (two launches, K tiles then V tiles) or "triton"."""
    n = src_pool_blocks.shape[0]
    p, g, hkv, d = exact_k.shape
    fp8 = exact_k.dtype == torch.float8_e4m3fn
    stride = plan_stride(g, d)
    common = dict(ITERS=iters, STD_FLOOR=std_floor, STRIDE=stride, MARKED=marked)
    if engine == "triton":
        launch(
            _plan_kernel,
            (n, hkv, 2),
            exact_k,
            exact_v,
            ks,
            vs,
            src_pool_blocks,
            sink,
            plan,
            p,
            G=g,
            H=hkv,
            D=d,
            FP8=fp8,
            K_LEVELS=(1 << k_bits) - 1,
            V_LEVELS=(1 << v_bits) - 1,
            K_SEARCH=k_round != 0,
            V_SEARCH=v_round != 0,
            K_PATTERN=k_round == pattern_id,
            V_PATTERN=v_round == pattern_id,
            num_warps=max(4, min(16, d * g // 2048)),
            **common,
        )
        return
    if engine != "gluon":
        raise ValueError(f"engine: must be 'gluon' or 'triton', got {engine!r}")
    mods = gluon_modules("flush_rows")
    if mods is None:
        raise NotImplementedError("engine: this Triton has no Gluon (flush_rows)")
    (rows,) = mods
    kinds = _tile_kinds(rows, exact_k, exact_v, ks, vs)
    for (which, pool, scale, r, c, consts), bits, rnd in zip(
        kinds, (k_bits, v_bits), (k_round, v_round), strict=True
    ):
        launch(
            rows.plan_kernel,
            (n, hkv),
            pool,
            scale,
            src_pool_blocks,
            sink,
            plan,
            p,
            G=g,
            H=hkv,
            D=d,
            R=r,
            C=c,
            TOKENS_ON_ROWS=which == 1,
            WHICH=which,
            FP8=fp8,
            LEVELS=(1 << bits) - 1,
            SEARCH=rnd != 0,
            PATTERN=rnd == pattern_id,
            num_warps=consts["WARPS"],
            **consts,
            **common,
        )


def launch_onepass(
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    src_pool_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    sink: torch.Tensor,
    packed: torch.Tensor,
    consts: dict,
    *,
    k_round: int,
    v_round: int,
    pattern_id: int,
    iters: int,
    std_floor: float,
    marked: int,
) -> None:
    """A bulk flush in one pass (``flush_onepass.flush_kernel``): one launch per tile kind,
    one program per tile. ``consts``: ``flush.record_constants`` of the format."""
    mods = gluon_modules("flush_onepass", "flush_rows")
    if mods is None:
        raise NotImplementedError("engine: this Triton has no Gluon (flush_onepass)")
    one, rows = mods
    n = src_pool_blocks.shape[0]
    p, g, hkv, d = exact_k.shape
    fp8 = exact_k.dtype == torch.float8_e4m3fn
    # each kind's record fields: codes, row side (scale, zero point), column side (scale)
    fields = (("K", "KC", "KS", "KZ", "KR"), ("V", "VC", "VR", "VZ", "VS"))
    for (which, pool, scale, r, c, geo), names, rnd in zip(
        _tile_kinds(rows, exact_k, exact_v, ks, vs), fields, (k_round, v_round), strict=True
    ):
        side, codes, row_scale, row_zp, col_scale = names
        launch(
            one.flush_kernel,
            (n, hkv),
            pool,
            scale,
            src_pool_blocks,
            dst_blocks,
            sink,
            packed,
            p,
            packed.shape[0],
            G=g,
            H=hkv,
            D=d,
            R=r,
            C=c,
            TOKENS_ON_ROWS=which == 1,
            FP8=fp8,
            BITS=consts[f"{side}_BITS"],
            SEARCH=rnd != 0,
            PATTERN=rnd == pattern_id,
            ITERS=iters,
            STD_FLOOR=std_floor,
            MARKED=marked,
            RECORD_BYTES=consts["RECORD_BYTES"],
            CODES_OFF=consts[f"{codes}_OFF"],
            ROW_SCALE_OFF=consts[f"{row_scale}_OFF"],
            ROW_ZP_OFF=consts[f"{row_zp}_OFF"],
            COL_SCALE_OFF=consts[f"{col_scale}_OFF"],
            num_warps=geo["WARPS"],
            **geo,
        )
