"""mla_exact_scatter: rotate new tokens' latents by H_512 and scatter them, with their RoPE,
into the MLA exact pool by slot (docs/contracts.md, "kvarn-ops: the MLA cache").

Memory traffic: read ``T*(512*itemsize(latent) + 64*itemsize(rope)) + 8T``; write
``T'*(512*E + s + 128)`` for the T' tokens with a slot (E = 1 and s = 4 for an fp8 pool, E = 2
and s = 0 for bf16), as ``kvarn_ops.reference.mla.mla_exact_scatter``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import check_device, launch_or_op, rotate_rows, round_to_bf16
from kvarn_ops.kernels._fastlaunch import PlanCache, launch
from kvarn_ops.kernels.mla_common import pool_cast, pool_round, pool_views
from kvarn_ops.reference.mla import GROUP, check_scatter_args

__all__ = ["mla_exact_scatter"]

BLOCK_T = 16
"""Tokens per program: the smallest tl.dot M (the rotation is two small products)."""


@triton.jit
def _mla_scatter_kernel(
    lat_ptr,
    rope_ptr,
    slots_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    T,
    num_slots,
    BLOCK_T: tl.constexpr,
    EXACT_TF32: tl.constexpr,
    FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < T
    slot = tl.load(slots_ptr + tl.where(in_range, tok, 0), mask=in_range, other=-1)
    ok = in_range & (slot >= 0) & (slot < num_slots)
    tok = tl.where(in_range, tok, 0)
    slot = tl.where(ok, slot, 0)
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    x = tl.load(lat_ptr + tok[:, None] * 512 + d[None, :], mask=ok[:, None], other=0.0)
    y = rotate_rows(x.to(tl.float32), BLOCK_T, 512, EXACT_TF32)
    vals, scale = pool_round(y, FP8)
    tl.store(
        pool_ptr + slot[:, None] * 512 + d[None, :],
        pool_cast(vals, FP8, pool_ptr.dtype.element_ty),
        mask=ok[:, None],
    )
    if FP8:
        tl.store(pscale_ptr + slot, scale, mask=ok)
    rp = tl.load(rope_ptr + tok[:, None] * 64 + r[None, :], mask=ok[:, None], other=0.0)
    rb = round_to_bf16(rp.to(tl.float32)).to(tl.uint32, bitcast=True) >> 16
    tl.store(
        prope_ptr + slot[:, None] * 64 + r[None, :],
        rb.to(tl.uint16).to(tl.int16, bitcast=True),
        mask=ok[:, None],
    )


def _launch(latent, rope, slots, pool_latent, pool_rope, pool_scale) -> None:
    t = latent.shape[0]
    if t == 0:
        return
    pl, ps, pr, fp8 = pool_views(pool_latent, pool_scale, pool_rope)
    grid = (triton.cdiv(t, BLOCK_T),)
    launch(
        _mla_scatter_kernel,
        grid,
        latent,
        rope,
        slots,
        pl,
        ps,
        pr,
        t,
        pool_latent.shape[0] * GROUP,
        BLOCK_T=BLOCK_T,
        EXACT_TF32=latent.dtype != torch.float32,
        FP8=fp8,
        num_warps=4,
    )


@torch.library.custom_op(
    "kvarn::mla_exact_scatter", mutates_args=("pool_latent", "pool_rope", "pool_scale")
)
def _scatter_op(
    latent: torch.Tensor,
    rope: torch.Tensor,
    slots: torch.Tensor,
    pool_latent: torch.Tensor,
    pool_rope: torch.Tensor,
    pool_scale: torch.Tensor | None,
) -> None:
    _launch(latent, rope, slots, pool_latent, pool_rope, pool_scale)


@_scatter_op.register_fake
def _scatter_fake(latent, rope, slots, pool_latent, pool_rope, pool_scale) -> None:
    return None


def _scatter_switches() -> tuple:
    """The module settings :func:`mla_exact_scatter`'s launch reads (part of every plan's
    signature, :mod:`._fastlaunch`)."""
    return (BLOCK_T, _mla_scatter_kernel)


_PLANS = PlanCache(_scatter_switches)
"""Recorded launches of :func:`mla_exact_scatter` calls."""


def mla_exact_scatter(latent, rope, slots, pool_latent, pool_rope, pool_scale=None) -> None:
    """Triton ``mla_exact_scatter``; same contract as
    :func:`kvarn_ops.reference.mla.mla_exact_scatter`.

    Parameters
    ----------
    latent : [T, 512] float16/bfloat16/float32, model frame, contiguous.
    rope : [T, 64] float16/bfloat16/float32 (stored rounded to bf16).
    slots : int64 [T]; -1 skips a token (on a GPU, out-of-range slots are skipped too; on the
        CPU they raise).
    pool_latent : [P, 64, 512] bfloat16 or float8_e4m3fn; pool_rope : bfloat16 [P, 64, 64];
    pool_scale : float32 [P, 64] for an fp8 pool, else None.

    A repeated call of one signature (shapes, strides, dtypes, alignment) replays the launch
    of the first without its checks (:mod:`._fastlaunch`).
    """
    tensors = (latent, rope, slots, pool_latent, pool_rope, pool_scale)
    key = _PLANS.key(tensors, ())
    if _PLANS.replay(key, tensors):
        return
    with _PLANS.recording(key, tensors):
        check_scatter_args(latent, rope, slots, pool_latent, pool_rope, pool_scale)
        check_device(pool_latent)
        launch_or_op(_scatter_op, _launch, latent, rope, slots, pool_latent, pool_rope, pool_scale)
