"""CuTe DSL split-K decode over a dense KVarN paged cache (packed records + exact tail).

Two launches per call, inside one compiled function:

1. ``split``: grid ``(S, B * Hkv)``, 128 threads. One CTA per (split, request, KV head)
   serves all ``R = T * GQA`` query rows of that KV head, so each record is read once. It
   loads q, rotates it into the cache frame with an in-shared-memory fast Walsh-Hadamard
   transform, walks its share of the request's full blocks (packed records) and, in the
   last split, the exact tail, and writes a normalized partial output row and its base-2
   log-sum-exp to the workspace.
2. ``combine``: grid ``(B * T * Hq,)``, ``D`` threads. Merges the live splits of one query
   row, rotates the result back to the model frame (same transform) and writes ``out``.

The split count of each request follows its live context length read on the device, with
the same formula as kvarn-ops' Triton decode (``n`` work units = full blocks plus one for a
non-empty tail; ``per = cdiv(n, min(S, cdiv(n, MIN_UNITS)))``; ``cdiv(n, per)`` live splits),
so nothing is synchronized with the host and the call can be captured in a CUDA graph.

Dequantization folds into the dot products (kvarn-method.md section 7)::

    score[t] = s_row_K[t] * (sum_d (q[d] * s_col_K[d]) * cK[d, t] + sum_d q[d] * zp_K[d])
    out[d]  += s_col_V[d] * (sum_t (p[t] * s_row_V[t]) * cV[t, d] + sum_t p[t] * zp_V[t])

The kernel uses only instructions SM90 and SM120 both have (scalar global loads, shared
memory, warp shuffles, ``ex2.approx``, FP32 FMA); it is a correctness-first GEMV, with no
tensor-core path.

Workspace layout (float32, the same size as kvarn-ops' ``decode_workspace``): partial
outputs ``[S, NR, D]`` then log-sum-exps ``[S, NR]``, ``NR = B * T * Hq``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from kvarn_cutedsl._spec import KernelSpec

NUM_THREADS = 128
"""Threads of a split CTA: 4 warps. Token-parallel score phase (``128 / G`` threads share a
token), channel-parallel value phase (``128 / D`` threads share a channel)."""
MIN_UNITS_PER_SPLIT = 2
"""Same as kvarn-ops (a split gets at least two blocks when the context allows)."""
_NEG_INF = -math.inf

_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
}


def _warp_sum(x):
    # plain Python loop: unrolled at trace time
    for i in range(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


def _warp_max(x):
    for i in range(5):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1 << i))
    return x


class DenseDecode:
    """One specialization of the decode (``spec``), callable as a ``@cute.jit`` function."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        s = spec
        self.G, self.D, self.R = s.group, s.head_dim, s.rows
        self.KB, self.VB = s.k_bits, s.v_bits
        self.P = NUM_THREADS // self.G  # threads sharing one token in the score phase
        self.P2 = NUM_THREADS // self.D  # threads sharing one channel in the value phase
        self.q_dtype = _DTYPES[s.q_dtype]
        self.pool_dtype = _DTYPES[s.pool_dtype]
        self.out_dtype = _DTYPES[s.out_dtype]

    # ------------------------------------------------------------------ host entry
    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        packed_u8: cute.Tensor,
        packed_f16: cute.Tensor,
        block_table: cute.Tensor,
        seq_lens: cute.Tensor,
        tail_pool_block: cute.Tensor,
        exact_k: cute.Tensor,
        exact_v: cute.Tensor,
        workspace: cute.Tensor,
        out: cute.Tensor,
        batch: Int32,
        num_kv_heads: Int32,
        bt_stride: Int32,
        num_splits: Int32,
        scale_log2: Float32,
        stream,
    ):
        hq = num_kv_heads * self.spec.gqa
        self.split_kernel(
            q,
            packed_u8,
            packed_f16,
            block_table,
            seq_lens,
            tail_pool_block,
            exact_k,
            exact_v,
            workspace,
            batch,
            num_kv_heads,
            bt_stride,
            num_splits,
            scale_log2,
        ).launch(
            grid=[num_splits, batch * num_kv_heads, 1], block=[NUM_THREADS, 1, 1], stream=stream
        )
        self.combine_kernel(workspace, seq_lens, out, batch, hq, num_splits).launch(
            grid=[batch * self.spec.query_len * hq, 1, 1], block=[self.D, 1, 1], stream=stream
        )

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def _live_splits(self, length: Int32, num_splits: Int32):
        """(live split count, units per split) for a request of ``length`` tokens."""
        n_full = length // self.G
        units = n_full + Int32(0)
        if length - n_full * self.G > 0:
            units = units + 1
        units = cutlass.max(units, Int32(1))
        want = (units + MIN_UNITS_PER_SPLIT - 1) // MIN_UNITS_PER_SPLIT
        live = cutlass.min(num_splits, want)
        per = (units + live - 1) // live
        live = (units + per - 1) // per
        return live, per, units, n_full

    @cute.jit
    def _fwht(
        self, buf: cute.Tensor, nrows: cutlass.Constexpr, tid: Int32, nthreads: cutlass.Constexpr
    ):
        """In-place unnormalized Sylvester Hadamard of each row of ``buf`` [nrows, D]."""
        half = self.D // 2
        h = 1
        for _stage in cutlass.range_constexpr(int(math.log2(self.D))):
            for idx in cutlass.range(tid, nrows * half, nthreads):
                r = idx // half
                k = idx - r * half
                i = (k // h) * (2 * h) + (k - (k // h) * h)
                a = buf[r, i]
                b = buf[r, i + h]
                buf[r, i] = a + b
                buf[r, i + h] = a - b
            cute.arch.sync_threads()
            h *= 2

    # ------------------------------------------------------------------ split kernel
    @cute.kernel
    def split_kernel(
        self,
        q: cute.Tensor,
        packed_u8: cute.Tensor,
        packed_f16: cute.Tensor,
        block_table: cute.Tensor,
        seq_lens: cute.Tensor,
        tail_pool_block: cute.Tensor,
        exact_k: cute.Tensor,
        exact_v: cute.Tensor,
        workspace: cute.Tensor,
        batch: Int32,
        num_kv_heads: Int32,
        bt_stride: Int32,
        num_splits: Int32,
        scale_log2: Float32,
    ):
        s = self.spec
        G, D, R, P, P2 = self.G, self.D, self.R, self.P, self.P2
        T, GQA = s.query_len, s.gqa
        KB, VB = self.KB, self.VB
        tid, _, _ = cute.arch.thread_idx()
        split, bh, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid - warp * 32
        b = bh // num_kv_heads
        h = bh - b * num_kv_heads
        hq = num_kv_heads * GQA
        nr = batch * T * hq

        smem = cutlass.utils.SmemAllocator()
        sq = smem.allocate_tensor(Float32, cute.make_layout((R, D), stride=(D, 1)), 16)
        sqs = smem.allocate_tensor(Float32, cute.make_layout((R, D), stride=(D, 1)), 16)
        ssc = smem.allocate_tensor(Float32, cute.make_layout((P, R, G), stride=(R * G, G, 1)), 16)
        sp = smem.allocate_tensor(Float32, cute.make_layout((R, G), stride=(G, 1)), 16)
        sout = smem.allocate_tensor(Float32, cute.make_layout((P2, R, D), stride=(R * D, D, 1)), 16)
        # per-tile scale vectors: k_col, k_zp, v_col [D]; k_row, v_row, v_zp [G]
        sdv = smem.allocate_tensor(Float32, cute.make_layout((3, D), stride=(D, 1)), 16)
        sgv = smem.allocate_tensor(Float32, cute.make_layout((3, G), stride=(G, 1)), 16)
        # per-row running stats: m, l, alpha, q.zp_K, p.zp_V
        sst = smem.allocate_tensor(Float32, cute.make_layout((5, R), stride=(R, 1)), 16)

        length = seq_lens[b]
        live, per, units, n_full = self._live_splits(length, num_splits)
        if split < live:
            u0 = split * per
            u1 = cutlass.min(units, u0 + per)
            # q rows r = t * GQA + g -> query head h * GQA + g of token t
            for idx in cutlass.range(tid, R * D, NUM_THREADS):
                r = idx // D
                d = idx - r * D
                t = r // GQA
                g = r - t * GQA
                qi = ((Int64(b) * T + t) * hq + h * GQA + g) * D + d
                sq[r, d] = Float32(q[qi])
            if tid < R:
                sst[0, tid] = Float32(_NEG_INF)
                sst[1, tid] = Float32(0.0)
            cute.arch.sync_threads()
            self._fwht(sq, R, tid, NUM_THREADS)
            qscale = scale_log2 * Float32(1.0 / math.sqrt(D))
            for idx in cutlass.range(tid, R * D, NUM_THREADS):
                r = idx // D
                d = idx - r * D
                sq[r, d] = sq[r, d] * qscale
            cute.arch.sync_threads()

            acc_o = cute.make_rmem_tensor((R,), Float32)
            for r in cutlass.range_constexpr(R):
                acc_o[r] = Float32(0.0)
            acc_s = cute.make_rmem_tensor((R,), Float32)
            tok = tid % G  # score phase: this thread's token
            part = tid // G
            dlen = D // P
            ch = tid % D  # value phase: this thread's channel
            part2 = tid // D
            glen = G // P2
            tail_blk = tail_pool_block[b]

            for u in cutlass.range(u0, u1, 1):
                is_packed = u < n_full
                ntok = Int32(G)
                if u >= n_full:
                    ntok = length - n_full * G
                # ---- per-tile scales (packed) and q . zp_K
                rec = Int64(0)
                if is_packed:
                    blk = block_table[Int64(b) * bt_stride + u]
                    rec = (Int64(blk) * num_kv_heads + h) * s.record_bytes
                    rec_h = rec // 2
                    for i in cutlass.range(tid, D, NUM_THREADS):
                        sdv[0, i] = Float32(packed_f16[rec_h + s.k_col_scale // 2 + i])
                        sdv[1, i] = Float32(packed_f16[rec_h + s.k_zero_point // 2 + i])
                        sdv[2, i] = Float32(packed_f16[rec_h + s.v_col_scale // 2 + i])
                    for i in cutlass.range(tid, G, NUM_THREADS):
                        sgv[0, i] = Float32(packed_f16[rec_h + s.k_row_scale // 2 + i])
                        sgv[1, i] = Float32(packed_f16[rec_h + s.v_row_scale // 2 + i])
                        sgv[2, i] = Float32(packed_f16[rec_h + s.v_zero_point // 2 + i])
                    cute.arch.sync_threads()
                    for idx in cutlass.range(tid, R * D, NUM_THREADS):
                        r = idx // D
                        d = idx - r * D
                        sqs[r, d] = sq[r, d] * sdv[0, d]
                    for r in cutlass.range(warp, R, NUM_THREADS // 32):
                        z = Float32(0.0)
                        for d in cutlass.range(lane, D, 32):
                            z = z + sq[r, d] * sdv[1, d]
                        z = _warp_sum(z)
                        if lane == 0:
                            sst[3, r] = z
                    cute.arch.sync_threads()
                # ---- partial scores: thread (tok, part) sums channels of its part
                for r in cutlass.range_constexpr(R):
                    acc_s[r] = Float32(0.0)
                if is_packed:
                    kbase = rec + s.k_codes
                    for dd in cutlass.range(dlen):
                        d = part * dlen + dd
                        bit = (d * G + tok) * KB
                        byte = Int32(packed_u8[kbase + (bit >> 3)])
                        code = Float32((byte >> (bit & 7)) & ((1 << KB) - 1))
                        for r in cutlass.range_constexpr(R):
                            acc_s[r] = acc_s[r] + sqs[r, d] * code
                else:
                    if tok < ntok:
                        kb = ((Int64(tail_blk) * G + tok) * num_kv_heads + h) * D
                        for dd in cutlass.range(dlen):
                            d = part * dlen + dd
                            kv = Float32(exact_k[kb + d])
                            for r in cutlass.range_constexpr(R):
                                acc_s[r] = acc_s[r] + sq[r, d] * kv
                for r in cutlass.range_constexpr(R):
                    ssc[part, r, tok] = acc_s[r]
                cute.arch.sync_threads()
                # ---- online softmax, one warp per row
                for r in cutlass.range(warp, R, NUM_THREADS // 32):
                    t_r = r // GQA
                    q_pos = length - T + t_r
                    m_old = sst[0, r]
                    mt = Float32(_NEG_INF)
                    for j in cutlass.range(lane, G, 32):
                        sc = Float32(0.0)
                        for pp in cutlass.range_constexpr(P):
                            sc = sc + ssc[pp, r, j]
                        if is_packed:
                            sc = (sc + sst[3, r]) * sgv[0, j]
                        if (j >= ntok) | (u * G + j > q_pos):
                            sc = Float32(_NEG_INF)
                        sp[r, j] = sc
                        mt = cute.arch.fmax(mt, sc)
                    mt = _warp_max(mt)
                    m_new = cute.arch.fmax(m_old, mt)
                    m_use = m_new
                    if m_new == Float32(_NEG_INF):
                        m_use = Float32(0.0)
                    lsum = Float32(0.0)
                    zsum = Float32(0.0)
                    for j in cutlass.range(lane, G, 32):
                        pj = cute.math.exp2(sp[r, j] - m_use, fastmath=True)
                        lsum = lsum + pj
                        if is_packed:
                            zsum = zsum + pj * sgv[2, j]
                            pj = pj * sgv[1, j]
                        sp[r, j] = pj
                    lsum = _warp_sum(lsum)
                    zsum = _warp_sum(zsum)
                    if lane == 0:
                        alpha = cute.math.exp2(m_old - m_use, fastmath=True)
                        sst[0, r] = m_new
                        sst[1, r] = sst[1, r] * alpha + lsum
                        sst[2, r] = alpha
                        sst[4, r] = zsum
                cute.arch.sync_threads()
                # ---- values: thread (ch, part2) sums the tokens of its part
                for r in cutlass.range_constexpr(R):
                    acc_s[r] = Float32(0.0)
                if is_packed:
                    vbase = rec + s.v_codes
                    for jj in cutlass.range(glen):
                        j = part2 * glen + jj
                        bit = (j * D + ch) * VB
                        byte = Int32(packed_u8[vbase + (bit >> 3)])
                        code = Float32((byte >> (bit & 7)) & ((1 << VB) - 1))
                        for r in cutlass.range_constexpr(R):
                            acc_s[r] = acc_s[r] + sp[r, j] * code
                    vcs = sdv[2, ch]
                    for r in cutlass.range_constexpr(R):
                        zp = sst[4, r]
                        if part2 != 0:
                            zp = Float32(0.0)
                        acc_o[r] = acc_o[r] * sst[2, r] + vcs * (acc_s[r] + zp)
                else:
                    j_end = cutlass.min(ntok, (part2 + 1) * glen)
                    for j in cutlass.range(part2 * glen, j_end, 1):
                        vb = ((Int64(tail_blk) * G + j) * num_kv_heads + h) * D
                        vv = Float32(exact_v[vb + ch])
                        for r in cutlass.range_constexpr(R):
                            acc_s[r] = acc_s[r] + sp[r, j] * vv
                    for r in cutlass.range_constexpr(R):
                        acc_o[r] = acc_o[r] * sst[2, r] + acc_s[r]
                cute.arch.sync_threads()

            # ---- reduce the P2 token parts and write the normalized partial row
            for r in cutlass.range_constexpr(R):
                sout[part2, r, ch] = acc_o[r]
            cute.arch.sync_threads()
            if part2 == 0:
                for r in cutlass.range_constexpr(R):
                    o = Float32(0.0)
                    for pp in cutlass.range_constexpr(P2):
                        o = o + sout[pp, r, ch]
                    lsum = sst[1, r]
                    inv = Float32(0.0)
                    if lsum > Float32(0.0):
                        inv = Float32(1.0) / lsum
                    t_r = r // GQA
                    g_r = r - t_r * GQA
                    row = (b * T + t_r) * hq + h * GQA + g_r
                    workspace[(Int64(split) * nr + row) * D + ch] = o * inv
            if tid < R:
                t_r = tid // GQA
                g_r = tid - t_r * GQA
                row = (b * T + t_r) * hq + h * GQA + g_r
                lsum = sst[1, tid]
                lse = Float32(_NEG_INF)
                if lsum > Float32(0.0):
                    lse = sst[0, tid] + cute.math.log2(lsum, fastmath=True)
                workspace[Int64(num_splits) * nr * D + Int64(split) * nr + row] = lse

    # ------------------------------------------------------------------ combine kernel
    @cute.kernel
    def combine_kernel(
        self,
        workspace: cute.Tensor,
        seq_lens: cute.Tensor,
        out: cute.Tensor,
        batch: Int32,
        num_q_heads: Int32,
        num_splits: Int32,
    ):
        D = self.D
        T = self.spec.query_len
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        b = row // (T * num_q_heads)
        nr = batch * T * num_q_heads
        live, _, _, _ = self._live_splits(seq_lens[b], num_splits)
        lse_base = Int64(num_splits) * nr * D
        mx = Float32(_NEG_INF)
        for sp_i in cutlass.range(live):
            mx = cute.arch.fmax(mx, workspace[lse_base + Int64(sp_i) * nr + row])
        if mx == Float32(_NEG_INF):
            mx = Float32(0.0)
        den = Float32(0.0)
        acc = Float32(0.0)
        for sp_i in cutlass.range(live):
            w = cute.math.exp2(workspace[lse_base + Int64(sp_i) * nr + row] - mx, fastmath=True)
            den = den + w
            acc = acc + w * workspace[(Int64(sp_i) * nr + row) * D + tid]
        smem = cutlass.utils.SmemAllocator()
        so = smem.allocate_tensor(Float32, cute.make_layout((1, D), stride=(D, 1)), 16)
        so[0, tid] = acc / den
        cute.arch.sync_threads()
        self._fwht(so, 1, tid, D)
        val = so[0, tid] * Float32(1.0 / math.sqrt(D))
        out[Int64(row) * D + tid] = val.to(self.out_dtype)
