"""The transposed MMA decode kernel at head_dim 256 (Gemma-2 / Gemma-3): two 128-channel halves.

``decode_mma_t.py`` holds a KV head's 128 channels in one layout: each lane's code words, the
score operand ``q_rot * s_col_K`` and the output accumulators. At head_dim 256 a program reads
each 64-token block as two such halves of one record:

- the scores ``S^T = K^T q^T`` run over both halves into one accumulator (each half's
  zero-point term added before its MMAs);
- one softmax step per block, as at d128;
- the values ``O^T = V^T P^T`` go to eight 32-channel accumulators, four per half, all fed by
  the same transposed weights.

The halves' words, channel vectors (K scale and zero point, V scale) sit in one stage side by
side; the token vectors (row scales, V zero points) are the head's, staged once. q is rotated by
the 256-point Walsh-Hadamard transform as two 128-point transforms and one butterfly between
the halves; its fp16 parts (``hi + lo`` per 32-channel chunk, 64 registers at d256) wait in
shared memory and each chunk's are read (``ldmatrix``) where its score operand is formed.
"""

from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kvarn_ops.kernels import decode_mma as M
from kvarn_ops.kernels import decode_mma_t as MT

__all__ = ["D256", "mma_decode_t256_kernel"]

D256 = 256
"""The head_dim of this kernel."""

FUSED_COLUMNS_D256 = os.environ.get("KVARN_DECODE_FUSED_COLUMNS_D256", "1") != "0"
"""On by default (``KVARN_DECODE_FUSED_COLUMNS_D256=0``, read at import, turns it off; it
also needs ``decode_mma_t.FUSED_COLUMNS``): the fused score columns in this kernel, where at
most four query rows a KV head (Gemma's GQA 2 at one or two query tokens) take two MMA
columns each, q's fp16 high part in the even one and its low part in the odd one: one score
MMA per code operand and one zero-point MMA per chunk instead of two (224 -> 144 MMAs a
64-token block, 228 -> 148 with 2-bit V). GPU parity of the d256 decode cases of at most four
rows, and 3-5% faster at batch 8-64 on an H100 (BENCHMARKS.md "2026-12-07")."""
_FUSED256: gl.constexpr = gl.constexpr(FUSED_COLUMNS_D256 and MT.FUSED_COLUMNS)

_MMA = M._MMA
_OPA = M._OPA
_OPB = M._OPB
_TOK = MT._TOK
_QR = MT._QR
_SH2 = M._SH2
# the q parts in shared memory: [16 (chunk, part)] x [32 channels, 8 rows], channels fastest
_SHQ: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1])
# [8, 32] channel vectors (K scale and zero point of the 256 channels), 16-byte copies
_CP832: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[8, 4], warps_per_cta=[1, 1], order=[1, 0]
)
# [16, 16] V column scales of the 256 channels
_CP1616: gl.constexpr = gl.BlockedLayout(
    size_per_thread=[1, 8], threads_per_warp=[16, 2], warps_per_cta=[1, 1], order=[1, 0]
)


@gluon.jit
def _stage_half(sk, sv, r32, ok, half, HF: gl.constexpr, K_OFF, V_OFF, VB: gl.constexpr,
                G: gl.constexpr, KB: gl.constexpr = 4):  # fmt: skip
    """``decode_mma._stage_words`` of channel half ``HF`` (channels ``128 HF ..``) of a
    256-channel record: K words of channel ``d`` at ``d * G / 8`` (2-bit K: ``d * G / 16``,
    lanes ``w`` and ``w ^ 1`` copying word ``w // 2``), V rows of ``8 VB`` words (the half's
    ``4 VB`` from word ``4 VB HF``)."""
    HV: gl.constexpr = VB // 2
    WV: gl.constexpr = 256 * VB // 32
    koff = M.k_word_offsets(G, KB)
    kbase = r32 + (K_OFF // 4 + HF * 128 * (G * KB // 32)) + half * (2 * KB)
    async_copy.async_copy_global_to_shared(sk, kbase + koff, mask=(koff >= 0) & ok)
    CPV: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[16 * HV, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1], order=[1, 0]
    )
    vr = gl.arange(0, 16 * HV, layout=gl.SliceLayout(1, CPV))
    vl = gl.arange(0, 32, layout=gl.SliceLayout(0, CPV))
    tok = (vl[None, :] & 3) * 16 + vr[:, None] // HV
    voff = tok * WV + (vl[None, :] >> 2) * HV + vr[:, None] % HV
    vbase = r32 + (V_OFF // 4 + HF * (WV // 2)) + half * (64 * WV)
    async_copy.async_copy_global_to_shared(sv, vbase + voff, mask=(voff >= 0) & ok)


@gluon.jit
def _issue_stage(sk, sv, skc, skz, skr, svc, svr, svz, uu, u1, bt_row, num_kv_heads, h,
                 rec32_ptr, rec16_ptr, REC: gl.constexpr, K_OFF: gl.constexpr,
                 KCS_OFF: gl.constexpr, KZP_OFF: gl.constexpr, KRS_OFF: gl.constexpr,
                 V_OFF: gl.constexpr, VCS_OFF: gl.constexpr, VRS_OFF: gl.constexpr,
                 VZP_OFF: gl.constexpr, VB: gl.constexpr, G: gl.constexpr,
                 KB: gl.constexpr = 4):  # fmt: skip
    """Stage 64-token unit ``uu`` of the request: both halves' words ([64, 32] K words, V words
    half by half), the channel vectors of 256 channels ([8, 32] K scale and zero point, [16,
    16] V scale) and the unit's token vectors ([8, 8]); then commit the copy group."""
    HV: gl.constexpr = VB // 2
    r32, r16, ok, half = M.unit_record(
        uu, u1, bt_row, num_kv_heads, h, rec32_ptr, rec16_ptr, REC, G
    )
    _stage_half(sk.slice(0, 32), sv.slice(0, 16 * HV), r32, ok, half, 0, K_OFF, V_OFF, VB, G,
                KB)  # fmt: skip
    _stage_half(sk.slice(32, 32), sv.slice(16 * HV, 16 * HV), r32, ok, half, 1, K_OFF, V_OFF,
                VB, G, KB)  # fmt: skip
    c = gl.arange(0, 8, layout=gl.SliceLayout(1, _CP832))
    j = gl.arange(0, 32, layout=gl.SliceLayout(0, _CP832))
    oc = c[:, None] * 32 + j[None, :]
    async_copy.async_copy_global_to_shared(skc, r16 + KCS_OFF // 2 + oc, mask=(oc >= 0) & ok)
    async_copy.async_copy_global_to_shared(skz, r16 + KZP_OFF // 2 + oc, mask=(oc >= 0) & ok)
    g = gl.arange(0, 16, layout=gl.SliceLayout(1, _CP1616))
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, _CP1616))
    ov = g[:, None] * 16 + i[None, :]
    async_copy.async_copy_global_to_shared(svc, r16 + VCS_OFF // 2 + ov, mask=(ov >= 0) & ok)
    g8 = gl.arange(0, 8, layout=gl.SliceLayout(1, M._CP88))
    i8 = gl.arange(0, 8, layout=gl.SliceLayout(0, M._CP88))
    ot = g8[:, None] * 8 + i8[None, :]
    mt = (ot >= 0) & ok
    r16h = r16 + half * 64
    async_copy.async_copy_global_to_shared(skr, r16h + KRS_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svr, r16h + VRS_OFF // 2 + ot, mask=mt)
    async_copy.async_copy_global_to_shared(svz, r16h + VZP_OFF // 2 + ot, mask=mt)
    async_copy.commit_group()


@gluon.jit
def _q_rows256(q_ptr, b, h, num_q_heads, qk_scale, T: gl.constexpr, GQA: gl.constexpr,
               QL: gl.constexpr, PAIRED: gl.constexpr = False):  # fmt: skip
    """Query rows as two [8, 128] halves in ``QL``, scaled and rotated by ``H_256 / 16`` in
    fp32: each half by the 128-point transform (``H_128 / sqrt(128)``), then one butterfly
    between them, over sqrt(2). With ``PAIRED`` (fused columns) row ``n`` holds query row
    ``n >> 1``."""
    rq = gl.arange(0, 8, layout=gl.SliceLayout(1, QL))
    if PAIRED:
        rq = rq >> 1
    cq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    ok = rq < T * GQA
    qrow = ((b * T + rq // GQA) * num_q_heads + h * GQA + rq % GQA).to(gl.int64)
    ptr = q_ptr + qrow[:, None] * 256 + cq[None, :]
    lo = M._q_rotated(gl.load(ptr, mask=ok[:, None], other=0.0).to(gl.float32) * qk_scale, QL)
    hi = M._q_rotated(gl.load(ptr + 128, mask=ok[:, None], other=0.0).to(gl.float32) * qk_scale, QL)
    return (lo + hi) * 0.7071067811865476, (lo - hi) * 0.7071067811865476


@gluon.jit
def _store_q_parts(sq, qrot, HF: gl.constexpr, QB: gl.constexpr):
    """The fp16 parts of half ``HF``'s four chunks into ``sq`` [16, 32, 8] (entry ``2 (4 HF +
    CQ) + part``)."""
    for CQ in gl.static_range(4):
        hi, lo = MT._q_parts(MT._q_chunk(qrot, QB, CQ), QB)
        sq.index(2 * (4 * HF + CQ)).store(hi)
        sq.index(2 * (4 * HF + CQ) + 1).store(lo)


@gluon.jit
def _chunk_qs(qz, sq, kc, kz, CQ: gl.constexpr, B: gl.constexpr, QB: gl.constexpr,
              FUSED: gl.constexpr, lo_cols):  # fmt: skip
    """``MT._qs_t`` of chunk ``CQ`` with its q parts read from ``sq`` (entries ``B + 2 CQ``
    and ``B + 2 CQ + 1``); ``FUSED``: the fused zero-point operand formed from them."""
    qh = sq.index(B + 2 * CQ).load(_OPB)
    ql = sq.index(B + 2 * CQ + 1).load(_OPB)
    qf = None
    if FUSED:
        qf = MT._fused_q(qh, ql, lo_cols, QB)
    return MT._qs_t(qz, qh, ql, M._run8(kc, CQ), M._run8(kz, CQ), QB, qf, lo_cols)


@gluon.jit
def _half_scores(s, sq, ck, kc, kz, odd, HF: gl.constexpr, QB: gl.constexpr,
                 KB: gl.constexpr = 4, FUSED: gl.constexpr = False,
                 lo_cols=None):  # fmt: skip
    """``s`` plus half ``HF``'s score sums over its 128 channels: its zero-point term (odd
    nibble rows 16 times it; 2-bit K: each row ``1 / F`` times it), then each chunk's code
    operand against both fp16 parts of ``q_rot * s_col_K`` (the q parts read from ``sq``), or
    against the one fused operand that holds both (``FUSED``; the caller sums the column
    pairs)."""
    B: gl.constexpr = 8 * HF
    qz = gl.full([16, 8], 0.0, gl.float32, _MMA)
    qs0, qt0, qz = _chunk_qs(qz, sq, kc, kz, 0, B, QB, FUSED, lo_cols)
    qs1, qt1, qz = _chunk_qs(qz, sq, kc, kz, 1, B, QB, FUSED, lo_cols)
    qs2, qt2, qz = _chunk_qs(qz, sq, kc, kz, 2, B, QB, FUSED, lo_cols)
    qs3, qt3, qz = _chunk_qs(qz, sq, kc, kz, 3, B, QB, FUSED, lo_cols)
    qzg = MT._equal_rows(qz) * MT._C_IN
    if KB == 2:
        s = s + MT._rows_like(qzg, 64) * MT._k_row_factors(False, KB)[:, None]
    else:
        s = s + gl.where(odd[:, None], MT._rows_like(16.0 * qzg, 64), MT._rows_like(qzg, 64))
    s = MT._score_chunk(ck, 0, qs0, qt0, s, False, KB, FUSED)
    s = MT._score_chunk(ck, 1, qs1, qt1, s, False, KB, FUSED)
    s = MT._score_chunk(ck, 2, qs2, qt2, s, False, KB, FUSED)
    return MT._score_chunk(ck, 3, qs3, qt3, s, False, KB, FUSED)


@gluon.jit
def _half_values(a0, a1, a2, a3, pwb, pt, svh, vc, VB: gl.constexpr):
    """The four 32-channel accumulators of one half plus ``s_col_V * (p @ cV + pz)`` from its
    staged V words ``svh`` [16 HV, 32] and V scales ``vc`` [8, 16]."""
    HV: gl.constexpr = VB // 2
    RDV: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[16 * HV, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1], order=[1, 0]
    )
    vt3 = gl.reshape(svh.load(RDV), [16, HV, 32])  # [i, h, lane]
    if VB == 4:
        t0, t1 = gl.split(gl.permute(vt3, [0, 2, 1]))
        va0, vb0 = M._v_pairs(M._vw_from_lanes(t0))
        va1, vb1 = M._v_pairs(M._vw_from_lanes(t1))
    else:
        va0, vb0 = M._v_pairs(M._vw_from_lanes(gl.reshape(vt3, [16, 32])))
        va1 = va0
        vb1 = vb0
    a0 = MT._values_t(a0, pwb, pt, va0, vb0, vc.slice(0, 4, dim=1).load(MT._RUNG4), 0, VB)
    a1 = MT._values_t(a1, pwb, pt, va0, vb0, vc.slice(4, 4, dim=1).load(MT._RUNG4), 1, VB)
    a2 = MT._values_t(a2, pwb, pt, va1, vb1, vc.slice(8, 4, dim=1).load(MT._RUNG4), 2, VB)
    a3 = MT._values_t(a3, pwb, pt, va1, vb1, vc.slice(12, 4, dim=1).load(MT._RUNG4), 3, VB)
    return a0, a1, a2, a3


@gluon.jit
def _store_half(a0, a1, a2, a3, inv_l, ws_rows, row_ok, hr, VB: gl.constexpr):
    MT._store_t(a0, inv_l, ws_rows, row_ok, hr, 0, VB, 0)
    MT._store_t(a1, inv_l, ws_rows, row_ok, hr, 1, VB, 0)
    MT._store_t(a2, inv_l, ws_rows, row_ok, hr, 2, VB, 0)
    MT._store_t(a3, inv_l, ws_rows, row_ok, hr, 3, VB, 0)


@gluon.jit
def mma_decode_t256_kernel(
    q_ptr,
    rec16_ptr,
    rec32_ptr,
    bt_ptr,
    seq_ptr,
    ws_ptr,
    qk_scale,
    bt_stride,
    num_kv_heads,
    num_q_heads,
    lse_numel,
    T: gl.constexpr,
    GQA: gl.constexpr,
    VB: gl.constexpr,
    REC: gl.constexpr,
    K_OFF: gl.constexpr,
    KCS_OFF: gl.constexpr,
    KZP_OFF: gl.constexpr,
    KRS_OFF: gl.constexpr,
    V_OFF: gl.constexpr,
    VCS_OFF: gl.constexpr,
    VRS_OFF: gl.constexpr,
    VZP_OFF: gl.constexpr,
    S: gl.constexpr,
    MIN_UNITS: gl.constexpr,
    NBUF: gl.constexpr,
    G: gl.constexpr = 64,
    PDL: gl.constexpr = False,
    LAG: gl.constexpr = 0,
    KB: gl.constexpr = 4,
):
    """``decode_mma_t.mma_decode_t_kernel`` at head_dim 256 (``T * GQA <= 8``, the query
    tokens ``T``; the 256-channel record's ``REC`` and offsets; 2-bit K with ``KB = 2``)."""
    if PDL:
        M.launch_dependents()
    gl.static_assert(T * GQA <= 8)
    gl.static_assert(KB == 4 or (KB == 2 and not MT._SUB))
    gl.static_assert(NBUF >= 2)
    QB: gl.constexpr = MT._as_linear(gl.to_linear_layout(_OPB, [32, 8]))
    split = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    seq_len = gl.load(seq_ptr + b)
    n_full = seq_len // G
    if n_full == 0:
        return
    n_splits = gl.maximum(gl.minimum(S, (n_full + MIN_UNITS - 1) // MIN_UNITS), 1)
    per = (n_full + n_splits - 1) // n_splits
    n_live = (n_full + per - 1) // per
    if split >= n_live:
        return
    u0 = split * per * (G // 64)
    u1 = gl.minimum(split * per + per, n_full) * (G // 64)

    HV: gl.constexpr = VB // 2
    sk = gl.allocate_shared_memory(gl.int32, [NBUF, 64, 32], _SH2)
    sv = gl.allocate_shared_memory(gl.int32, [NBUF, 32 * HV, 32], _SH2)
    skc = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 32], _SH2)
    skz = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 32], _SH2)
    skr = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 8], _SH2)
    svc = gl.allocate_shared_memory(gl.float16, [NBUF, 16, 16], _SH2)
    svr = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 8], _SH2)
    svz = gl.allocate_shared_memory(gl.float16, [NBUF, 8, 8], _SH2)
    sq = gl.allocate_shared_memory(gl.float16, [16, 32, 8], _SHQ)
    bt_row = bt_ptr + b.to(gl.int64) * bt_stride
    for st in gl.static_range(NBUF - 1):
        _issue_stage(sk.index(st), sv.index(st), skc.index(st), skz.index(st), skr.index(st),
                     svc.index(st), svr.index(st), svz.index(st), u0 + st, u1, bt_row,
                     num_kv_heads, h, rec32_ptr, rec16_ptr, REC, K_OFF, KCS_OFF, KZP_OFF,
                     KRS_OFF, V_OFF, VCS_OFF, VRS_OFF, VZP_OFF, VB, G, KB)  # fmt: skip

    # at most four query rows: column n of every [*, 8] tile is query row n >> 1, the score
    # MMAs take q's hi part in the even columns and its lo part in the odd ones
    FUSED: gl.constexpr = T * GQA <= 4 and not MT._SUB and _FUSED256
    qlo, qhi = _q_rows256(q_ptr, b, h, num_q_heads, qk_scale, T, GQA, gl.constexpr(M._QL8), FUSED)
    _store_q_parts(sq, qlo, 0, QB)
    _store_q_parts(sq, qhi, 1, QB)

    rr = gl.arange(0, 8, layout=_QR)
    lo_cols = None
    if FUSED:
        lo_cols = MT._odd_cols(QB)
        row_ok = (rr < 2 * T * GQA) & ((rr & 1) == 0)  # one column of each pair stores
        rr = rr >> 1
    else:
        row_ok = rr < T * GQA
    q_pos = seq_len - (T + LAG) + rr // GQA
    mt = gl.arange(0, 64, layout=_TOK)
    tok_of_row = (mt & 7) * 8 + (mt >> 4) * 2 + ((mt >> 3) & 1)
    odd = MT._tok_rows(MT._run_consts(gl.constexpr(MT._RUNG8), 8, 0.0, 1.0, 0.0, 1.0)) > 0.5

    m = gl.full([8], -1.0e30, gl.float32, _QR)
    l = gl.full([8], 0.0, gl.float32, _QR)
    a0 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a1 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a2 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a3 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a4 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a5 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a6 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    a7 = gl.full([32, 8], 0.0, gl.float32, _MMA)
    for u in range(u0, u1):
        j = u - u0
        nst = (j + NBUF - 1) % NBUF
        gl.thread_barrier()  # every lane is done with the stage about to be overwritten
        _issue_stage(sk.index(nst), sv.index(nst), skc.index(nst), skz.index(nst),
                     skr.index(nst), svc.index(nst), svr.index(nst), svz.index(nst),
                     u + NBUF - 1, u1, bt_row, num_kv_heads, h, rec32_ptr, rec16_ptr, REC,
                     K_OFF, KCS_OFF, KZP_OFF, KRS_OFF, V_OFF, VCS_OFF, VRS_OFF, VZP_OFF, VB,
                     G, KB)  # fmt: skip
        async_copy.wait_group(NBUF - 1)
        gl.thread_barrier()
        cst = j % NBUF
        ck = sk.index(cst)
        kc = skc.index(cst)
        kz = skz.index(cst)
        s = gl.full([64, 8], 0.0, gl.float32, _MMA)
        s = _half_scores(s, sq, ck.slice(0, 32), kc.slice(0, 4), kz.slice(0, 4), odd, 0, QB, KB,
                         FUSED, lo_cols)  # fmt: skip
        s = _half_scores(s, sq, ck.slice(32, 32), kc.slice(4, 4), kz.slice(4, 4), odd, 1, QB, KB,
                         FUSED, lo_cols)  # fmt: skip
        if FUSED:
            s = MT._pair_sum(s, 64)
        kf = MT._k_row_factors(True, KB)
        krs = MT._tok_rows(skr.index(cst).load(MT._RUNG8)) * kf
        s = s * krs[:, None]
        if T + LAG > 1:
            key = u * 64 + tok_of_row
            s = gl.where(key[:, None] <= q_pos[None, :], s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        a0 = a0 * alpha[None, :]
        a1 = a1 * alpha[None, :]
        a2 = a2 * alpha[None, :]
        a3 = a3 * alpha[None, :]
        a4 = a4 * alpha[None, :]
        a5 = a5 * alpha[None, :]
        a6 = a6 * alpha[None, :]
        a7 = a7 * alpha[None, :]
        p = gl.exp2(s - m_new[None, :])
        m = m_new
        l = l * alpha + gl.sum(p, axis=0)
        vzp = MT._tok_rows(svz.index(cst).load(MT._RUNG8))
        vrs = MT._tok_rows(svr.index(cst).load(MT._RUNG8))
        pz = gl.sum(p * vzp[:, None], axis=0)
        pwb = gl.convert_layout((p * vrs[:, None]).to(gl.float16), _OPB)  # the transpose
        if VB == 2 and MT._SUB:
            pt = pz[None, :] * MT._v_factors(True)[:, None]
        elif VB == 2:
            spw = mma_v2(
                gl.full([16, 64], 1.0, gl.float16, _OPA),
                pwb,
                gl.full([16, 8], 0.0, gl.float32, _MMA),
            )
            pt = pz[None, :] * MT._v_factors(True)[:, None] - MT._rows_like(MT._equal_rows(spw), 32)
        else:
            pt = gl.full([32, 8], 0.0, gl.float32, _MMA) + pz[None, :]
        vs = sv.index(cst)
        vc = svc.index(cst)
        a0, a1, a2, a3 = _half_values(a0, a1, a2, a3, pwb, pt, vs.slice(0, 16 * HV),
                                      vc.slice(0, 8), VB)  # fmt: skip
        a4, a5, a6, a7 = _half_values(a4, a5, a6, a7, pwb, pt, vs.slice(16 * HV, 16 * HV),
                                      vc.slice(8, 8), VB)  # fmt: skip
    async_copy.wait_group(0)

    seen = l > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l, 1.0), 0.0)
    lse = gl.where(seen, m + gl.log2(gl.where(seen, l, 1.0)), float("-inf"))
    q_row = ((b * T + rr // GQA) * num_q_heads + h * GQA + rr % GQA).to(gl.int64)
    ws_row = q_row * S + split
    gl.store(ws_ptr + ws_row, lse, mask=row_ok)
    ws_rows = ws_ptr + lse_numel + ws_row * 256
    hr = rr * 0
    _store_half(a0, a1, a2, a3, inv_l, ws_rows, row_ok, hr, VB)
    _store_half(a4, a5, a6, a7, inv_l, ws_rows + 128, row_ok, hr, VB)
