"""The decode step's combine in Gluon (head_dim 128, 64-token blocks, at least 4 splits): the
same contract and arithmetic as ``decode._decode_combine_kernel``, with the data movement
spelled out.

After the main kernel, the combine's remaining work is a short chain (the exact tail, if any,
is computed before ``griddepcontrol.wait``): read the live splits' log-sum-exps and partial
rows, weight and sum them, rotate the sum back to the model frame, store. The Triton kernel
spent that chain on reductions across the whole program: a maximum and a sum over the splits
and a sum of the weighted rows, each a shuffle tree, a shared-memory round trip and two or
three barriers, the weights themselves broadcast through shared memory, and the inverse
Hadamard as seven layout conversions (17 barriers after the wait in its sm_90a build; on an
H100 the step at batch 1 and 32K spent 2.2 us on the combine after the main kernel, and
shuffles held 45% of the combine's stall samples after the wait, BENCHMARKS.md "2026-12-07,
later"). Here:

- each warp takes a quarter of the splits in its registers ([S / 4, 4 channels] a lane, 32
  lanes along the 128 channels; the log-sum-exps of its splits in every lane), so its maximum,
  weights, weight sum and weighted row are in-thread arithmetic;
- the four warps' (maximum, weight sum, row) go through shared memory once, behind one
  barrier, and every thread merges the four for its four channels (the exact tail's row,
  computed before the wait, joins there);
- the inverse Hadamard of the merged row: two register stages and five ``shfl.bfly`` stages
  (the row is held four channels a lane in every warp).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvarn_ops.kernels.decode_mma import _butterfly_lanes

__all__ = ["NUM_WARPS", "combine_kernel", "gluon_combine_supported"]

NUM_WARPS = 4

# the merged row [128]: channels 4 l + r (register r, lane l) in every warp
_ROW: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[4], order=[0]
)
# the four warps' rows [4, 128] as every thread reads them back: all four, its four channels
_ROWS4: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[4, 4], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0]
)
# the exact tail's pool rows [64 tokens, 128]: 16 tokens a warp in registers, four channels a lane
_TL: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[16, 4], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0]
)
_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
_SH1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])


def gluon_combine_supported(head_dim: int, block_size: int, splits_p2: int) -> bool:
    """Whether :func:`combine_kernel` serves a geometry: head_dim 128, 64-token blocks and a
    workspace of at least 4 splits (a quarter of them a warp)."""
    return head_dim == 128 and block_size == 64 and splits_p2 >= 4


@gluon.jit
def _fwht128(x):
    """``x @ H_128`` (unnormalized) of a [128] row in ``_ROW``: channel bits 0 and 1 in
    registers, bits 2-6 in lane bits 0-4 (the partner by ``shfl.bfly``)."""
    ch = gl.arange(0, 128, layout=_ROW)
    y = gl.reshape(x, [32, 2, 2])  # [lane, bit 1, bit 0]
    a, b = gl.split(y)
    y = gl.join(a + b, a - b)  # bit 0
    y = gl.permute(y, [0, 2, 1])
    a, b = gl.split(y)
    y = gl.permute(gl.join(a + b, a - b), [0, 2, 1])  # bit 1
    x = gl.convert_layout(gl.reshape(y, [128]), _ROW, assert_trivial=True)
    x = _butterfly_lanes(x, 1.0 - 2.0 * ((ch >> 2) & 1).to(gl.float32), 1)
    x = _butterfly_lanes(x, 1.0 - 2.0 * ((ch >> 3) & 1).to(gl.float32), 2)
    x = _butterfly_lanes(x, 1.0 - 2.0 * ((ch >> 4) & 1).to(gl.float32), 4)
    x = _butterfly_lanes(x, 1.0 - 2.0 * ((ch >> 5) & 1).to(gl.float32), 8)
    return _butterfly_lanes(x, 1.0 - 2.0 * ((ch >> 6) & 1).to(gl.float32), 16)


@gluon.jit
def _tail_attention(qv, pool_k, pool_v, k_scale, v_scale, sl, ok, POOL_FP8: gl.constexpr):
    """The exact tail's attention for one query row ``qv`` [128] (fp32, model frame, times
    ``qk_scale``; in ``_ROW``) over pool rows ``sl`` [64] (in ``_TL``'s rows) where ``ok``:
    the unnormalized output row (in ``_ROW``), the weights' sum and the base-2 log-sum-exp."""
    q_rot = gl.convert_layout(_fwht128(qv) * 0.08838834764831845, gl.SliceLayout(0, _TL))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, _TL))
    kx = gl.load(pool_k + sl[:, None] * 128 + d[None, :], mask=ok[:, None], other=0.0)
    kx = kx.to(gl.float32)
    if POOL_FP8:
        kx = kx * gl.load(k_scale + sl, mask=ok, other=0.0)[:, None]
    st = gl.where(ok, gl.sum(kx * q_rot[None, :], axis=1), float("-inf"))
    m_t = gl.max(st, axis=0)
    p_t = gl.where(ok, gl.exp2(st - m_t), 0.0)
    l_t = gl.sum(p_t, axis=0)
    if POOL_FP8:
        p_t = p_t * gl.load(v_scale + sl, mask=ok, other=0.0)
    vx = gl.load(pool_v + sl[:, None] * 128 + d[None, :], mask=ok[:, None], other=0.0)
    o_t = gl.convert_layout(gl.sum(p_t[:, None] * vx.to(gl.float32), axis=0), _ROW)
    lse_t = gl.where(l_t > 0.0, m_t + gl.log2(gl.where(l_t > 0.0, l_t, 1.0)), float("-inf"))
    return o_t, l_t, lse_t


@gluon.jit
def _gdc_wait():
    """``griddepcontrol.wait``: the main kernel's writes are visible after it."""
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def combine_kernel(
    ws_ptr,
    seq_ptr,
    out_ptr,
    lse_numel,
    rows_per_request,
    q_ptr,
    ek_ptr,
    ev_ptr,
    ks_ptr,
    vs_ptr,
    tail_ptr,
    qk_scale,
    num_kv_heads,
    num_q_heads,
    S: gl.constexpr,
    S_P2: gl.constexpr,
    MIN_UNITS: gl.constexpr,
    TAIL: gl.constexpr,
    T: gl.constexpr,
    GQA: gl.constexpr,
    POOL_FP8: gl.constexpr,
    PDL: gl.constexpr = False,
    LAG: gl.constexpr = 0,
):
    """One program (four warps) per query row; ``decode._decode_combine_kernel``'s arguments
    and results at head_dim 128 and 64-token blocks (``D`` and ``G``), every split in one tile
    (``S_P2 >= 4``)."""
    D: gl.constexpr = 128
    G: gl.constexpr = 64
    Q: gl.constexpr = S_P2 // 4  # splits a warp
    PL: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[Q, 4], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0]
    )
    row = gl.program_id(0).to(gl.int64)
    b = row // rows_per_request
    d = gl.arange(0, D, layout=_ROW)
    seq_len = gl.load(seq_ptr + b)
    n_full = seq_len // G
    tail = seq_len - n_full * G
    if TAIL:
        n_units = n_full
    else:
        n_units = n_full + (tail > 0).to(gl.int32)
    n_splits = gl.maximum(gl.minimum(S, (n_units + MIN_UNITS - 1) // MIN_UNITS), 1)
    per = gl.maximum((n_units + n_splits - 1) // n_splits, 1)
    n_live = (n_units + per - 1) // per
    if TAIL:
        qv = gl.load(q_ptr + row * D + d).to(gl.float32) * qk_scale
        pb = gl.load(tail_ptr + b).to(gl.int64)
        h = (row % num_q_heads) // GQA
        q_pos = seq_len - (T + LAG) + (row % rows_per_request) // num_q_heads
        tok = gl.arange(0, G, layout=gl.SliceLayout(1, _TL))
        t_ok = (tok < tail) & (n_full * G + tok <= q_pos)
        slot = (pb * G + tok) * num_kv_heads + h
        o_t, l_t, lse_t = _tail_attention(qv, ek_ptr, ev_ptr, ks_ptr, vs_ptr, slot, t_ok,
                                          POOL_FP8)  # fmt: skip
    red_m = gl.allocate_shared_memory(gl.float32, [4], _SH1)
    red_l = gl.allocate_shared_memory(gl.float32, [4], _SH1)
    red_o = gl.allocate_shared_memory(gl.float32, [4, D], _SH)
    if PDL:
        _gdc_wait()
    sp = gl.arange(0, S_P2, layout=gl.SliceLayout(1, PL))
    live = sp < n_live
    lse = gl.load(ws_ptr + row * S + sp, mask=live, other=float("-inf"))
    dp = gl.arange(0, D, layout=gl.SliceLayout(0, PL))
    part = gl.load(
        ws_ptr + lse_numel + (row * S + sp)[:, None] * D + dp[None, :],
        mask=live[:, None],
        other=0.0,
    )
    # each warp's quarter of the splits, in its registers
    lse3 = gl.reshape(lse, [4, Q])
    m_w = gl.max(lse3, axis=1)
    m_ws = gl.where(m_w > float("-inf"), m_w, 0.0)
    w3 = gl.where(lse3 > float("-inf"), gl.exp2(lse3 - m_ws[:, None]), 0.0)
    l_w = gl.sum(w3, axis=1)
    part3 = gl.reshape(part, [4, Q, D])
    w3b = gl.convert_layout(w3, gl.SliceLayout(2, part3.type.layout), assert_trivial=True)
    o_w = gl.sum(part3 * gl.expand_dims(w3b, 2), axis=1)
    red_m.store(m_w)
    red_l.store(l_w)
    red_o.store(o_w)
    gl.thread_barrier()
    m4 = red_m.load(gl.SliceLayout(1, _ROWS4))
    l4 = red_l.load(gl.SliceLayout(1, _ROWS4))
    o4 = red_o.load(_ROWS4)
    top = gl.max(m4, axis=0)
    if TAIL:
        top = gl.maximum(top, lse_t)
    tops = gl.where(top > float("-inf"), top, 0.0)
    f4 = gl.where(m4 > float("-inf"), gl.exp2(m4 - tops), 0.0)
    w_sum = gl.sum(f4 * l4, axis=0)
    o = gl.convert_layout(gl.sum(o4 * f4[:, None], axis=0), _ROW, assert_trivial=True)
    if TAIL:
        w_t = gl.where(l_t > 0.0, gl.exp2(lse_t - top), 0.0)
        o = o + o_t * gl.where(l_t > 0.0, w_t / gl.where(l_t > 0.0, l_t, 1.0), 0.0)
        w_sum = w_sum + w_t
    o = o * (1.0 / w_sum * 0.08838834764831845)  # 1 / sqrt(128)
    # back to the model frame: out[j] = sum_i o[i] * H[i, j]
    gl.store(out_ptr + row * D + d, _fwht128(o).to(out_ptr.dtype.element_ty))
