"""mla_decode: attention of absorbed MLA queries ``[B, H, 576]`` over packed latent tiles plus
exact-pool rows, split-K, three launches with no host sync and no allocation:

1. ``_mla_qrot_kernel``: ``q_rot = q[..., :512] @ H_512`` into the workspace;
2. ``_mla_decode_kernel``: one program per (request, split, 16 heads) walks its share of the
   request's tokens (all ``seq_lens[b]`` tokens, or the selected ``indices[b]``) in chunks of 16,
   gathering each token from its exact-pool block or its packed record
   (``mla_common.load_tokens``), with an online softmax; writes a partial output and its
   log-sum-exp;
3. ``_mla_combine_kernel``: merges the splits and rotates the output back by ``H_512``.

Memory traffic: every selected token is read once (``R/64`` record bytes for a packed token plus
its block's scales, ``512*E + s + 128`` for a pool token), ``q`` once, ``out`` written once, plus
``B*H*S*(512 + 1)*4`` partial bytes written and read once and the ``B*H*512*4`` rotated query.
Dots run in tf32 on the GPU (fp32 in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops.kernels._common import cast_rne, check_device, rotate_rows
from kvarn_ops.kernels.mla_common import field_offsets, load_tokens, pool_views
from kvarn_ops.reference.mla import (
    LATENT_DIM,
    MlaDecodeWorkspace,
    check_decode_args,
    mla_decode_workspace,
)

__all__ = ["mla_decode", "mla_decode_workspace"]

BLOCK_H = 16
"""Heads per program: the smallest tl.dot M."""
BLOCK_N = 16
"""Tokens per step (smallest tl.dot N); each token is gathered on its own (sparse-ready)."""


@triton.jit
def _mla_qrot_kernel(q_ptr, qrot_ptr, BH, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = row < BH
    row = tl.where(ok, row, 0)
    d = tl.arange(0, 512)
    x = tl.load(q_ptr + row[:, None] * 576 + d[None, :], mask=ok[:, None], other=0.0)
    y = rotate_rows(x.to(tl.float32), BLOCK_H, 512, False)
    tl.store(qrot_ptr + row[:, None] * 512 + d[None, :], y, mask=ok[:, None])


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    qrot_ptr,
    rec_ptr,
    rec16_ptr,
    map_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    bt_ptr,
    seq_ptr,
    idx_ptr,
    po_ptr,
    plse_ptr,
    H,
    S,
    bt_stride,
    idx_stride,
    max_blocks,
    sm_scale,
    SPARSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,
    CS_OFF: tl.constexpr,
    ZP_OFF: tl.constexpr,
    RS_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr,
    REC: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = h < H
    h = tl.where(hok, h, 0)
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    qrow = b * H + h
    q = tl.load(qrot_ptr + qrow[:, None] * 512 + d[None, :], mask=hok[:, None], other=0.0)
    qr = tl.load(q_ptr + qrow[:, None] * 576 + 512 + r[None, :], mask=hok[:, None], other=0.0)
    qr = qr.to(tl.float32)
    seq_len = tl.load(seq_ptr + b)
    if SPARSE:
        total = idx_stride
    else:
        total = seq_len
    per_split = tl.cdiv(tl.cdiv(total, S), BLOCK_N) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(start + per_split, total)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inb = n < stop
        if SPARSE:
            logical = tl.load(idx_ptr + b * idx_stride + tl.where(inb, n, 0), mask=inb, other=-1)
        else:
            logical = tl.where(inb, n, -1)
        ok = (logical >= 0) & (logical < seq_len)
        lg = tl.where(ok, logical, 0)
        lb = lg // 64
        ok = ok & (lb < max_blocks)
        pb = tl.load(bt_ptr + b * bt_stride + tl.where(ok, lb, 0), mask=ok, other=0)
        slot = pb.to(tl.int64) * 64 + lg % 64
        lat, rope = load_tokens(
            slot,
            ok,
            rec_ptr,
            rec16_ptr,
            map_ptr,
            pool_ptr,
            pscale_ptr,
            prope_ptr,
            BLOCK_N,
            BITS,
            CS_OFF,
            ZP_OFF,
            RS_OFF,
            ROPE_OFF,
            REC,
            FP8,
        )
        ropef = (rope.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        s = tl.dot(q, tl.trans(lat)) + tl.dot(qr, tl.trans(ropef))
        s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, lat)
        m = m_new
    lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    prow = qrow * S + split
    tl.store(po_ptr + prow[:, None] * 512 + d[None, :], out, mask=hok[:, None])
    tl.store(plse_ptr + prow, lse, mask=hok)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, out_ptr, BH, S, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = row < BH
    row = tl.where(ok, row, 0)
    d = tl.arange(0, 512)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(S):
        m = tl.maximum(m, tl.load(plse_ptr + row * S + s, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for s in range(S):
        w = tl.exp(tl.load(plse_ptr + row * S + s, mask=ok, other=float("-inf")) - m_safe)
        part = tl.load(
            po_ptr + (row * S + s)[:, None] * 512 + d[None, :], mask=ok[:, None], other=0.0
        )
        acc += w[:, None] * part
        den += w
    acc = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    y = rotate_rows(acc, BLOCK_H, 512, False)
    tl.store(
        out_ptr + row[:, None] * 512 + d[None, :],
        cast_rne(y, out_ptr.dtype.element_ty),
        mask=ok[:, None],
    )


@torch.library.custom_op(
    "kvarn::mla_decode", mutates_args=("out", "ws_q_rot", "ws_part_out", "ws_part_lse")
)
def _decode_op(
    q: torch.Tensor,
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_pool_map: torch.Tensor,
    pool_latent: torch.Tensor,
    pool_scale: torch.Tensor | None,
    pool_rope: torch.Tensor,
    format_name: str,
    softmax_scale: float,
    out: torch.Tensor,
    ws_q_rot: torch.Tensor,
    ws_part_out: torch.Tensor,
    ws_part_lse: torch.Tensor,
    indices: torch.Tensor | None,
) -> None:
    import kvarn_formats as kf

    bsz, heads = q.shape[:2]
    if bsz == 0 or heads == 0:
        return
    s = ws_part_lse.shape[2]
    offs = field_offsets(kf.mla_layout(format_name))
    pl, ps, pr, fp8 = pool_views(pool_latent, pool_scale, pool_rope)
    bh = bsz * heads
    _mla_qrot_kernel[(triton.cdiv(bh, BLOCK_H),)](q, ws_q_rot, bh, BLOCK_H=BLOCK_H, num_warps=4)
    sparse = indices is not None
    idx = indices if sparse else seq_lens
    _mla_decode_kernel[(bsz, s, triton.cdiv(heads, BLOCK_H))](
        q,
        ws_q_rot,
        packed,
        packed.view(torch.int16),
        block_pool_map,
        pl,
        ps,
        pr,
        block_table,
        seq_lens,
        idx,
        ws_part_out,
        ws_part_lse,
        heads,
        s,
        block_table.stride(0),
        indices.shape[1] if indices is not None else 0,
        block_table.shape[1],
        softmax_scale,
        SPARSE=sparse,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        FP8=fp8,
        num_warps=8,
        **offs,
    )
    _mla_combine_kernel[(triton.cdiv(bh, BLOCK_H),)](
        ws_part_out, ws_part_lse, out, bh, s, BLOCK_H=BLOCK_H, num_warps=4
    )


@_decode_op.register_fake
def _decode_fake(
    q,
    packed,
    block_table,
    seq_lens,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    format_name,
    softmax_scale,
    out,
    ws_q_rot,
    ws_part_out,
    ws_part_lse,
    indices,
) -> None:
    return None


def mla_decode(
    q,
    packed,
    block_table,
    seq_lens,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    layout,
    softmax_scale: float,
    out,
    workspace: MlaDecodeWorkspace | None = None,
    indices=None,
) -> None:
    """Triton ``mla_decode`` (contract of :func:`kvarn_ops.reference.mla.mla_decode`).

    ``workspace`` (from :func:`mla_decode_workspace`) is required: it is the only scratch and
    fixes the split count, so the call can be captured in a CUDA graph. ``q`` contiguous
    ``[B, H, 576]``; ``indices`` int32 ``[B, K]`` contiguous or None.
    """
    if workspace is None:
        raise ValueError(
            "workspace: required; create it once with mla_decode_workspace(B, H, "
            "num_splits, device)"
        )
    check_decode_args(
        q,
        packed,
        block_table,
        seq_lens,
        block_pool_map,
        pool_latent,
        pool_scale,
        pool_rope,
        layout,
        out,
        workspace,
        indices,
    )
    check_device(q)
    torch.ops.kvarn.mla_decode(
        q,
        packed,
        block_table,
        seq_lens,
        block_pool_map,
        pool_latent,
        pool_scale,
        pool_rope,
        layout.format_name,
        float(softmax_scale),
        out,
        workspace.q_rot,
        workspace.part_out,
        workspace.part_lse,
        indices,
    )


assert LATENT_DIM == 512
