"""MLA decode main kernel for sm_90 (Gluon, ``wgmma``) at 64 heads per program: for models with
many query heads per GPU (DeepSeek-V3 at 128, or 64 at tensor parallel 2), full-context decode
(no ``indices``) of ``kvarn_mla_k{2,4,5}_g64``.

``mla_decode_wgmma.py`` gives each 16 heads their own program: at 128 heads every latent tile
is read, unpacked and multiplied eight times, and each value product is a row of 16-wide
``wgmma`` instructions whose A operand (the whole tile) is read from shared memory again for
every 16 heads. Here one program of two warpgroups (eight warps) serves 64 heads:

- the tile ``T[c, t] = fp16(2^-e (cs[c] code[c, t] + zp[c]))`` [512, 64] is unpacked once by
  all eight warps (two chunks of 256 channels, one channel's code words per thread; the unpack
  and token order of ``mla_decode_wgmma.py``) into two shared-memory buffers of 256 channels;
- scores ``S^T[64 tokens, 64 heads] = T^T @ q^T`` (``wgmma`` m64n32k16: warpgroup ``g``
  computes heads ``32 g .. 32 g + 31``), times ``2^e rs[t]``, plus the RoPE part; the softmax
  over the tokens (the M axis, within each warpgroup) with one exchange between warps, as in
  the 16-head kernel;
- values ``O[64 heads, 512] += P @ T^T`` with the heads on the M axis: ``P`` [64 heads, 64
  tokens] (``fp16(p rs / rmax)``) goes through shared memory, and each warpgroup computes
  128 channels of each tile buffer (``wgmma`` m64n128k16, eight per block): the tile is read
  once for 64 heads, with eight value instructions per block instead of 32 per 16 heads.
  The accumulators are [64, 256] fp32 per warpgroup (128 registers a thread); each head's
  rescale (the softmax's ``alpha`` times the change of ``rmax 2^e``) crosses from the score
  layout to the value layout through 256 bytes of shared memory.

Numerics are the 16-head kernel's: the latent rounded once to fp16, the query latent one fp16
operand, the RoPE part two bf16 terms, fp32 accumulation. Programs: one request, one split of
its blocks, 64 heads; about 170 KB of shared memory, one program per SM. Heads past ``H`` are
computed on zero queries and not stored. H200 (BENCHMARKS.md), 32 requests x 128 heads at
8K, CUDA-graph replay: 0.306 ms at 4 bits, 0.316 ms at 5 bits (the 16-head kernel 0.565 /
0.626 ms); at 32 heads it is slower than the 16-head kernel (0.175 against 0.166 ms), hence
``mla_decode.WGMMA64_MIN_HEADS = 64``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from kvarn_ops.kernels.mla_decode_wgmma import (
    MLA_WGMMA_BITS,
    _block_softmax,
    _chan_mag,
    _load_chan,
    _load_rope,
    _load_words,
    _pool_inv,
    _pool_store,
    _pow2_scale,
    _scaled_tile,
    _split_blocks,
    _tile_token,
    _warp_max,
)

__all__ = ["HEADS", "NUM_WARPS", "mla_wgmma64_kernel", "mla_wgmma64_supported"]

HEADS = 64
"""Query heads per program."""
NUM_WARPS = 8

# scores S^T [64 tokens, 64 heads]: warpgroup g holds heads 32 g .. 32 g + 31
_ACC_S: gl.constexpr = gl.NVMMADistributedLayout(
    version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
)
# values O [64 heads, 512 channels]: warpgroup g holds channels 256 g .. 256 g + 255
_ACC_O: gl.constexpr = gl.NVMMADistributedLayout(
    version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16]
)
_TOK: gl.constexpr = gl.SliceLayout(1, _ACC_S)  # [64] tokens
_HEAD: gl.constexpr = gl.SliceLayout(0, _ACC_S)  # [64] heads of the scores
_HEAD_O: gl.constexpr = gl.SliceLayout(1, _ACC_O)  # [64] heads of the values
_CHAN_O: gl.constexpr = gl.SliceLayout(0, _ACC_O)  # [256] channels of a value accumulator
_SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
_S1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
# code words of a 256-channel chunk: one channel's words per thread ([256, 8]; 5-bit words
# 8-9 [256, 2]; 2-bit [256, 4])
_LW: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[32, 1], warps_per_cta=[8, 1], order=[1, 0]
)
_LW2: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 2], threads_per_warp=[32, 1], warps_per_cta=[8, 1], order=[1, 0]
)
_LW4: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[8, 1], order=[1, 0]
)
_CH: gl.constexpr = gl.SliceLayout(1, _LW)
# [64, 64] RoPE rows and [64, 128] pool latents (16-byte runs), [64, 512] / [64, 64] queries
_LR: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0]
)
_LQ: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[8, 1], order=[1, 0]
)
# every thread: the four warps' partial maxima (or sums) of its columns of S^T [64, 64] (its
# warpgroup's 32 heads)
_REP: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [1, 0], [2, 0]],
    lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
    warp_bases=[[0, 0], [0, 0], [0, 32]],
    block_bases=[],
    shape=[4, 64],
)
_S2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
# every thread: the eight warps' partial maxima of the tile's channel magnitudes
_REP8: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2], [4]], lane_bases=[[0], [0], [0], [0], [0]],
    warp_bases=[[0], [0], [0]], block_bases=[], shape=[8],
)  # fmt: skip
# a block's 64 row scales [1, 64] in every warp (their maximum without a cross-warp step)
_RW: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 2], threads_per_warp=[1, 32], warps_per_cta=[8, 1], order=[1, 0]
)


def mla_wgmma64_supported(bits: int) -> bool:
    """Whether a latent code width takes this kernel (full-context decode, sm_90 only)."""
    return bits in MLA_WGMMA_BITS


@gluon.jit
def _load_record64(rec16_ptr, rec32_ptr, recbf_ptr, map_ptr, blk, t64, REC: gl.constexpr,
                   CS_OFF: gl.constexpr, ZP_OFF: gl.constexpr, RS_OFF: gl.constexpr,
                   ROPE_OFF: gl.constexpr, BITS: gl.constexpr):  # fmt: skip
    """Block ``blk``'s record in registers: code words of the two 256-channel chunks, their
    channel scales and zero points, RoPE rows, row scales (also as [1, 64] in every warp), and
    its pool-map entry."""
    tw = gl.arange(0, 64, layout=gl.SliceLayout(0, _RW))[None, :]
    w0, v0 = _load_words(rec32_ptr, blk, 0, REC, BITS, 256, gl.constexpr(_LW),
                         gl.constexpr(_LW2), gl.constexpr(_LW4))  # fmt: skip
    w1, v1 = _load_words(rec32_ptr, blk, 1, REC, BITS, 256, gl.constexpr(_LW),
                         gl.constexpr(_LW2), gl.constexpr(_LW4))  # fmt: skip
    return (
        w0,
        w1,
        v0,
        v1,
        _load_chan(rec16_ptr, blk, CS_OFF, 0, REC, 256, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, CS_OFF, 1, REC, 256, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, ZP_OFF, 0, REC, 256, gl.constexpr(_CH)),
        _load_chan(rec16_ptr, blk, ZP_OFF, 1, REC, 256, gl.constexpr(_CH)),
        _load_rope(recbf_ptr + blk * (REC // 2) + ROPE_OFF // 2, 64, gl.constexpr(_LR), BITS),
        gl.load(rec16_ptr + blk * (REC // 2) + RS_OFF // 2 + t64).to(gl.float32),
        gl.load(rec16_ptr + blk * (REC // 2) + RS_OFF // 2 + tw).to(gl.float32),
        gl.load(map_ptr + blk),
    )


@gluon.jit
def _pool_tile(t0, t1, pool_ptr, row0, valid, BITS: gl.constexpr):
    """The tile (channel halves ``t0``, ``t1``) of a block in the exact pool (rows ``row0
    ..``, ``valid`` tokens): its latents times the block's power-of-two factor, which it
    returns."""
    inv = _pool_inv(pool_ptr, row0, valid, gl.constexpr(_LR))
    _pool_store(t0.slice(0, 128, dim=0), pool_ptr, row0, valid, 0, inv, gl.constexpr(_LR), BITS)
    _pool_store(t0.slice(128, 128, dim=0), pool_ptr, row0, valid, 1, inv, gl.constexpr(_LR), BITS)
    _pool_store(t1.slice(0, 128, dim=0), pool_ptr, row0, valid, 2, inv, gl.constexpr(_LR), BITS)
    _pool_store(t1.slice(128, 128, dim=0), pool_ptr, row0, valid, 3, inv, gl.constexpr(_LR), BITS)
    return inv


@gluon.jit
def mla_wgmma64_kernel(
    q_ptr,
    qrot_ptr,
    rec16_ptr,
    rec32_ptr,
    recbf_ptr,
    map_ptr,
    pool_ptr,
    pscale_ptr,
    prope_ptr,
    bt_ptr,
    seq_ptr,
    po_ptr,
    plse_ptr,
    H,
    S,
    bt_stride,
    max_blocks,
    qk_scale,
    REC: gl.constexpr,
    CS_OFF: gl.constexpr,
    ZP_OFF: gl.constexpr,
    RS_OFF: gl.constexpr,
    ROPE_OFF: gl.constexpr,
    FP8: gl.constexpr,
    MIN_BLOCKS: gl.constexpr,
    BITS: gl.constexpr,
):
    """Grid ``(B, splits, ceil(H / 64))``, eight warps (two warpgroups): split
    ``program_id(1)`` of request ``program_id(0)``'s blocks for 64 heads; writes normalized
    partial rows and natural-log log-sum-exps to the workspace of ``mla_decode``.
    ``qk_scale`` is the softmax scale times log2(e)."""
    b = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    h0 = gl.program_id(2) * 64
    seq_len, lo, hi = _split_blocks(seq_ptr, b, max_blocks, MIN_BLOCKS)
    hh = h0 + gl.arange(0, 64, layout=_HEAD)
    hok = hh < H
    qrow = b * H + gl.where(hok, hh, 0)
    if lo >= hi:
        # nothing to read: the combine skips this split's (unwritten) partial row
        gl.store(plse_ptr + qrow * S + split, gl.full([64], float("-inf"), gl.float32, _HEAD),
                 mask=hok)  # fmt: skip
        return
    bt_row = bt_ptr + b * bt_stride

    # the tile as two 256-channel buffers (stores to one buffer's slices are ordered by a
    # barrier each, stores to different buffers are not); each buffer [1, ...]: see the
    # loop's index ``z``
    tiles0 = gl.allocate_shared_memory(gl.float16, [1, 256, 64], _SW)
    tiles1 = gl.allocate_shared_memory(gl.float16, [1, 256, 64], _SW)
    amax_s = gl.allocate_shared_memory(gl.float32, [8], _S1)
    red_m = gl.allocate_shared_memory(gl.float32, [4, 64], _S2)
    red_l = gl.allocate_shared_memory(gl.float32, [4, 64], _S2)
    rope_ss = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], _SW)
    pss = gl.allocate_shared_memory(gl.float16, [1, 64, 64], _SW)
    qss = gl.allocate_shared_memory(gl.float16, [1, 64, 512], _SW)
    qr_his = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], _SW)
    qr_los = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], _SW)
    alpha_s = gl.allocate_shared_memory(gl.float32, [64], _S1)
    # queries -> shared memory: the latent part as fp16 (times the softmax scale), the RoPE
    # part as two bf16 terms
    qh = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, _LQ))
    qd = gl.arange(0, 512, layout=gl.SliceLayout(0, _LQ))
    qok = (qh < H)[:, None]
    qr = (b * H + qh).to(gl.int64)
    x = gl.load(qrot_ptr + qr[:, None] * 512 + qd[None, :], mask=qok, other=0.0) * qk_scale
    qss.index(0).store(x.to(gl.float16))
    qd64 = gl.arange(0, 64, layout=gl.SliceLayout(0, _LQ))
    x = gl.load(q_ptr + qr[:, None] * 576 + 512 + qd64[None, :], mask=qok, other=0.0)
    x = x.to(gl.float32) * qk_scale
    xh = x.to(gl.bfloat16)
    qr_his.index(0).store(xh)
    qr_los.index(0).store((x - xh.to(gl.float32)).to(gl.bfloat16))

    # the token at each tile position (row of S^T)
    t64 = _tile_token(gl.arange(0, 64, layout=_TOK), BITS)
    tw = gl.arange(0, 64, layout=gl.SliceLayout(0, _RW))[None, :]
    m = gl.full([64], -1.0e30, gl.float32, _HEAD)
    l = gl.full([64], 0.0, gl.float32, _HEAD)
    f_run = qk_scale * 0.0 + 1.0
    # O [64 heads, 512] as two [64, 256] channel halves (one per tile buffer)
    o0 = warpgroup_mma_init(gl.full([64, 256], 0.0, gl.float32, _ACC_O))
    o1 = warpgroup_mma_init(gl.full([64, 256], 0.0, gl.float32, _ACC_O))
    zs = gl.full([64, 64], 0.0, gl.float32, _ACC_S)

    # block lo's record in registers
    w0, w1, v0, v1, c0, c1, z0, z1, rope, rs, rsw, pb = _load_record64(
        rec16_ptr, rec32_ptr, recbf_ptr, map_ptr, gl.load(bt_row + lo).to(gl.int64), t64,
        REC, CS_OFF, ZP_OFF, RS_OFF, ROPE_OFF, BITS,
    )  # fmt: skip
    for u in range(lo, hi):
        valid = gl.minimum(seq_len - u * 64, 64)
        # shared-memory views through a loop-dependent zero index, so that the compiler
        # builds the wgmma descriptors in the loop instead of hoisting (and spilling) them
        z = u >> 30
        t0 = tiles0.index(z)
        t1 = tiles1.index(z)
        rope_s = rope_ss.index(z)
        ps = pss.index(z)
        qs = qss.index(z)
        qr_hi = qr_his.index(z)
        qr_lo = qr_los.index(z)
        # each warp's largest channel magnitude of the record, exchanged through the barrier
        # that also waits for the previous block's value product to have read the tile
        amax_s.store(
            gl.maximum(_warp_max(_chan_mag(c0, z0, BITS), 8), _warp_max(_chan_mag(c1, z1, BITS), 8))
        )
        o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1))
        gl.thread_barrier()
        if pb < 0:
            inv = _pow2_scale(gl.max(amax_s.load(_REP8), axis=0))
            t0.store(_scaled_tile(w0, v0, c0, z0, inv, BITS, gl.constexpr(_CH)))
            t1.store(_scaled_tile(w1, v1, c1, z1, inv, BITS, gl.constexpr(_CH)))
            rope_s.store(rope)
            rw = rs
            rwm = rsw
        else:
            # a block in the exact pool: the tile from its rows
            row0 = pb.to(gl.int64) * 64
            inv = _pool_tile(t0, t1, pool_ptr, row0, valid, BITS)
            rope_s.store(_load_rope(prope_ptr + row0 * 64, valid, gl.constexpr(_LR), BITS))
            if FP8:
                rw = gl.load(pscale_ptr + row0 + t64, mask=t64 < valid, other=0.0)
                rwm = gl.load(pscale_ptr + row0 + tw, mask=tw < valid, other=0.0)
            else:
                rw = gl.full([64], 1.0, gl.float32, _TOK)
                rwm = gl.full([1, 64], 1.0, gl.float32, _RW)
        # the next block's record (this one's registers are free now), read during the products
        nb = gl.load(bt_row + gl.minimum(u + 1, hi - 1)).to(gl.int64)
        w0, w1, v0, v1, c0, c1, z0, z1, rope, rs, rsw, pb = _load_record64(
            rec16_ptr, rec32_ptr, recbf_ptr, map_ptr, nb, t64,
            REC, CS_OFF, ZP_OFF, RS_OFF, ROPE_OFF, BITS,
        )  # fmt: skip

        fence_async_shared()
        gl.thread_barrier()

        # scores S^T [64 tokens, 64 heads], base-2 logits (two chains over the channel halves)
        sa = warpgroup_mma(t0.permute((1, 0)),
                           qs.slice(0, 256, dim=1).permute((1, 0)), zs, use_acc=False,
                           is_async=True)  # fmt: skip
        sb = warpgroup_mma(t1.permute((1, 0)),
                           qs.slice(256, 256, dim=1).permute((1, 0)), zs, use_acc=False,
                           is_async=True)  # fmt: skip
        sr = warpgroup_mma(rope_s, qr_hi.permute((1, 0)), zs, use_acc=False, is_async=True)
        sr = warpgroup_mma(rope_s, qr_lo.permute((1, 0)), sr, is_async=True)
        sa, sb, sr = warpgroup_mma_wait(num_outstanding=0, deps=(sa, sb, sr))
        s = sa + sb
        e2 = 1.0 / inv
        okt = t64 < valid
        rw = gl.where(okt, rw, 0.0)
        sc = s * gl.expand_dims(rw * e2, 1) + sr
        sc = gl.where(gl.expand_dims(okt, 1), sc, float("-inf"))
        p, m, l, alpha = _block_softmax(sc, m, l, red_m, red_l, gl.constexpr(_REP))
        # the largest row scale: within each warp
        rmax = gl.max(gl.max(gl.where(tw < valid, rwm, 0.0), axis=1), axis=0)
        rmax = gl.where(rmax > 0.0, rmax, 1.0)
        pw = (p * gl.expand_dims(rw / rmax, 1)).to(gl.float16)
        ps.store(gl.permute(pw, (1, 0)))
        f_new = rmax * e2
        alpha_s.store(alpha * (f_run / f_new))
        f_run = f_new
        fence_async_shared()
        gl.thread_barrier()
        # each head's rescale, now in the value product's layout (heads on the M axis)
        rescale = gl.expand_dims(alpha_s.load(_HEAD_O), 1)
        o0 = warpgroup_mma(ps, t0.permute((1, 0)), o0 * rescale, is_async=True)
        o1 = warpgroup_mma(ps, t1.permute((1, 0)), o1 * rescale, is_async=True)

    o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1))

    seen = l != 0.0  # l NaN (a NaN or infinite query) is kept: the output is NaN
    scale = gl.where(seen, f_run / gl.where(seen, l, 1.0), 0.0)
    lse = gl.where(seen, (m + gl.log2(gl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(plse_ptr + qrow * S + split, lse, mask=hok)
    ho = h0 + gl.arange(0, 64, layout=_HEAD_O)
    hok_o = ho < H
    qrow_o = b * H + gl.where(hok_o, ho, 0)
    ch = gl.arange(0, 256, layout=_CHAN_O)
    ptr = po_ptr + gl.expand_dims((qrow_o * S + split) * 512, 1) + gl.expand_dims(ch, 0)
    scale_o = gl.expand_dims(gl.convert_layout(scale, _HEAD_O), 1)
    gl.store(ptr, o0 * scale_o, mask=gl.expand_dims(hok_o, 1))
    gl.store(ptr + 256, o1 * scale_o, mask=gl.expand_dims(hok_o, 1))
