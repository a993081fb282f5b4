"""Head pairs: the transposed MMA decode kernel (``decode_mma_t.py``) at head_dim 64.

The kernel's lane and register layouts are built for 128 channels. At head_dim 64 (Llama-3.2-1B,
Qwen2.5-0.5B, SmolLM2) one program takes two KV heads of a request, ``h`` and ``h + 1``, as one
128-channel head: virtual channel ``c`` is channel ``c % 64`` of head ``h + c // 64``. The
query rows of head ``h`` are the first ``T * GQA`` of the MMA's 8 columns, those of head
``h + 1`` the next ``T * GQA`` (so at most 4 rows a head), and each query row is zero on the
other head's channels. Then

- the score dot over the 128 virtual channels is each row's own head's score (the other
  head's channels meet zeros), and so is the zero-point term (an MMA of the zero points
  against the same rows);
- the token vectors (K row scale, V row scale and zero point) differ between the heads, so
  each is staged for both and picked per column;
- the value dot gives every row all 128 virtual channels; a row keeps those of its own head
  (the other half, the other head's values under this head's weights, is not stored).

The unpack, the MMAs and the softmax are the 128-channel kernel's, on two records' bytes:
per program about the instructions of a 128-channel block (offline 1,321 against 1,244 a
block: the per-column token vectors and the copies' masks) for the same bytes (two
64-channel records). With an odd number of KV heads the last pair has no second head: that
half of each stage is zero-filled (nothing read) and its rows are masked. The Walsh-Hadamard
rotation of q runs over each head's 64 channels (six stages, the 128-channel transform
without its stage on channel bit 6).

With 5 to 8 rows a head (TinyLlama's GQA 8, Qwen2.5-0.5B's GQA 7) the rows do not fit twice:
a program then takes one KV head (``PAIR = 1``), the second half of every stage zero-filled
(nothing read), so it does a pair's work for one head's bytes.

This file holds what differs: the staging addresses, the query rows and the row bookkeeping.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from kvarn_ops.kernels import decode_mma as M

__all__ = ["PAIR_D"]

PAIR_D = 64
"""The head_dim whose KV heads the transposed kernel takes in pairs."""

# [16, 8] token vectors of both heads (rows 0-7 head h, 8-15 head h + 1), 16-byte copies
_CP168: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[16, 2], warps_per_cta=[1, 1], order=[1, 0]
)


@gluon.jit
def _stage_words(sk, sv, r32, r32b, ok, ok2, half, K_OFF, V_OFF, VB: gl.constexpr,
                 G: gl.constexpr, KB: gl.constexpr = 4):  # fmt: skip
    """``decode_mma._stage_words`` for a head pair (records at ``r32`` and ``r32b``): K word
    ``w`` of virtual channel ``c`` is word ``w`` of channel ``c % 64`` in head ``c // 64``'s
    record; a token's virtual V row is the two heads' 64-channel rows one after the other
    (``2 VB`` words each). Each lane picks its head's record pointer once, so its offsets
    are small constants over its registers (one base a lane, immediate offsets). ``ok2``
    false: no second head, its half of the stage is zero-filled (nothing read). 2-bit K
    (``KB = 2``): four words a channel and half, lanes ``w`` and ``w ^ 1`` copy word ``w //
    2`` (as ``decode_mma._stage_words``)."""
    HV: gl.constexpr = VB // 2
    WV: gl.constexpr = 64 * VB // 32
    # K: row r, lane c + 4 w: virtual channel 32 c + r (head c // 2, channel 32 (c % 2) + r)
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, M._CPK))
    ln = gl.arange(0, 32, layout=gl.SliceLayout(0, M._CPK))
    kh = ((ln >> 1) & 1) == 1
    kb = gl.where(kh, r32b, r32) + (K_OFF // 4 + half * (2 * KB))
    CW: gl.constexpr = G * KB // 32  # K words of a channel
    koff = r[:, None] * CW + ((ln & 1) * (32 * CW) + (ln >> M.k_lane_shift(KB)))[None, :]
    km = (koff >= 0) & ((ok & (kh == 0)) | ok2)[None, :]
    async_copy.async_copy_global_to_shared(sk, kb[None, :] + koff, mask=km)
    # V: row i * HV + x, lane c + 4 g: token 16 c + i, virtual word g HV + x (head g // 4)
    CPV: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[16 * HV, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1], order=[1, 0]
    )
    vr = gl.arange(0, 16 * HV, layout=gl.SliceLayout(1, CPV))
    vl = gl.arange(0, 32, layout=gl.SliceLayout(0, CPV))
    vh = (vl >> 4) == 1
    vb = gl.where(vh, r32b, r32) + (V_OFF // 4 + half * (64 * WV))
    vlane = (vl & 3) * (16 * WV) + ((vl >> 2) & 3) * HV
    voff = ((vr // HV) * WV + vr % HV)[:, None] + vlane[None, :]
    vm = (voff >= 0) & ((ok & (vh == 0)) | ok2)[None, :]
    async_copy.async_copy_global_to_shared(sv, vb[None, :] + voff, mask=vm)


@gluon.jit
def _runs(r16, r16b, rows, RUN: gl.constexpr):
    """Row pointers of a [R, RUN] tile of a virtual 128-element vector (element ``RUN row +
    i``): the row's run in its head's 64-element vector of record ``r16`` or ``r16b``. The
    column offset stays a plain ``arange``, so the copies keep their 16-byte runs."""
    PER: gl.constexpr = 64 // RUN
    return gl.where(rows >= PER, r16b, r16) + (rows % PER) * RUN


@gluon.jit
def _stage_vectors(skc, skz, skr, svc, svr, svz, r16, r16b, ok, ok2, half, KCS_OFF, KZP_OFF,
                   KRS_OFF, VCS_OFF, VRS_OFF, VZP_OFF):  # fmt: skip
    """The channel vectors of the virtual 128 channels (K scale and zero point [4, 32], V
    scale [8, 16], as ``decode_mma_t`` reads them) and the token vectors of both heads
    ([16, 8]: rows 0-7 head ``h``, 8-15 head ``h + 1``)."""
    c32 = gl.arange(0, 4, layout=gl.SliceLayout(1, M._CP32))
    j32 = gl.arange(0, 32, layout=gl.SliceLayout(0, M._CP32))
    p32 = _runs(r16, r16b, c32, 32)[:, None] + j32[None, :]
    m32 = (j32[None, :] >= 0) & ((ok & (c32 < 2)) | ok2)[:, None]
    async_copy.async_copy_global_to_shared(skc, p32 + KCS_OFF // 2, mask=m32)
    async_copy.async_copy_global_to_shared(skz, p32 + KZP_OFF // 2, mask=m32)
    g16 = gl.arange(0, 8, layout=gl.SliceLayout(1, M._CP816))
    i16 = gl.arange(0, 16, layout=gl.SliceLayout(0, M._CP816))
    pc = _runs(r16, r16b, g16, 16)[:, None] + i16[None, :]
    mc = (i16[None, :] >= 0) & ((ok & (g16 < 4)) | ok2)[:, None]
    async_copy.async_copy_global_to_shared(svc, pc + VCS_OFF // 2, mask=mc)
    g8 = gl.arange(0, 16, layout=gl.SliceLayout(1, _CP168))
    i8 = gl.arange(0, 8, layout=gl.SliceLayout(0, _CP168))
    pt = _runs(r16, r16b, g8, 8)[:, None] + (i8[None, :] + half * 64)
    mt = (i8[None, :] >= 0) & ((ok & (g8 < 8)) | ok2)[:, None]
    async_copy.async_copy_global_to_shared(skr, pt + KRS_OFF // 2, mask=mt)
    async_copy.async_copy_global_to_shared(svr, pt + VRS_OFF // 2, mask=mt)
    async_copy.async_copy_global_to_shared(svz, pt + VZP_OFF // 2, mask=mt)


@gluon.jit
def issue_stage(
    sk,
    sv,
    skc,
    skz,
    skr,
    svc,
    svr,
    svz,
    uu,
    u1,
    bt_row,
    num_kv_heads,
    h,
    dh,
    rec32_ptr,
    rec16_ptr,
    REC: gl.constexpr,
    K_OFF: gl.constexpr,
    KCS_OFF: gl.constexpr,
    KZP_OFF: gl.constexpr,
    KRS_OFF: gl.constexpr,
    V_OFF: gl.constexpr,
    VCS_OFF: gl.constexpr,
    VRS_OFF: gl.constexpr,
    VZP_OFF: gl.constexpr,
    VB: gl.constexpr,
    G: gl.constexpr,
    KB: gl.constexpr = 4,
):
    """``decode_mma._issue_stage`` for the head pair ``h``, ``h + dh``: both records of the
    block into one stage (``dh`` 0 where the program has one head, the odd head out or 5-8
    rows a head: the second half zero-filled)."""
    r32, r16, ok, half = M.unit_record(
        uu, u1, bt_row, num_kv_heads, h, rec32_ptr, rec16_ptr, REC, G
    )
    ok2 = ok & (dh > 0)  # one head: the second half of the stage zero-filled
    _stage_words(sk, sv, r32, r32 + dh * (REC // 4), ok, ok2, half, K_OFF, V_OFF, VB, G, KB)
    _stage_vectors(skc, skz, skr, svc, svr, svz, r16, r16 + dh * (REC // 2), ok, ok2, half,
                   KCS_OFF, KZP_OFF, KRS_OFF, VCS_OFF, VRS_OFF, VZP_OFF)  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _q_rotated64(q, QL: gl.constexpr):
    """``q @ H_64 / 8`` on each 64-channel half of ``q`` [R, 128] (``decode_mma._q_rotated``
    without the stage on channel bit 6)."""
    R: gl.constexpr = q.shape[0]
    ch = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    s5 = gl.full([R, 128], 1.0, gl.float32, QL) - 2.0 * ((ch >> 5) & 1).to(gl.float32)[None, :]
    x = M._butterfly_regs(q, 0, QL)
    x = M._butterfly_regs(x, 1, QL)
    x = M._butterfly_regs(x, 2, QL)
    x = M._butterfly_regs(x, 3, QL)
    x = M._butterfly_regs(x, 4, QL)
    return M._butterfly_lanes(x, s5, 1) * 0.125  # 1 / sqrt(64)


@gluon.jit
def row_heads(T: gl.constexpr, GQA: gl.constexpr, LAYOUT: gl.constexpr):
    """``(hr, rr)`` of the 8 columns: the head (0: ``h``, 1: ``h + 1``; 2 for unused
    columns) and the row within it (``t * GQA + g``)."""
    r = gl.arange(0, 8, layout=LAYOUT)
    return r // (T * GQA), r % (T * GQA)


@gluon.jit
def q_rows(q_ptr, b, h, has2, num_q_heads, qk_scale, T: gl.constexpr, GQA: gl.constexpr,
           QL: gl.constexpr):  # fmt: skip
    """Both heads' query rows as [8, 128] virtual channels in ``QL`` (row ``r``: head ``h +
    r // (T GQA)``, zero on the other head's 64 channels and on unused rows), scaled and each
    half rotated, fp32. ``has2``: whether head ``h + 1`` exists."""
    hr, rr = row_heads(T, GQA, gl.SliceLayout(1, QL))
    cq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    ok = (hr == 0) | ((hr == 1) & has2)
    qrow = ((b * T + rr // GQA) * num_q_heads + (h + hr) * GQA + rr % GQA).to(gl.int64)
    m = ok[:, None] & ((cq >> 6)[None, :] == hr[:, None])
    q = gl.load(q_ptr + qrow[:, None] * 64 + (cq & 63)[None, :], mask=m, other=0.0)
    return _q_rotated64(q.to(gl.float32) * qk_scale, QL)


@gluon.jit
def per_column(colb, va, vb):
    """[64, 8]: token vector ``vb`` [64] in the columns of head ``h + 1`` (``colb``), ``va``
    in the others."""
    return gl.where(colb[None, :], vb[:, None], va[:, None])
