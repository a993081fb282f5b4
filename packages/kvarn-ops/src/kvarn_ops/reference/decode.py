"""Paged attention over packed full blocks plus the exact tail (decode and speculative verify).

The scores over a packed tile use the folded form of the method doc (section 7), so the
reference also checks that algebra against dequantize-then-attend (``attention_oracle``):

``score[t] = s_row_K[t] * (sum_d (q[d] * s_col_K[d]) * codeK[d, t] + sum_d q[d] * zp_K[d])``
``out[d]  += s_col_V[d] * (sum_t (p[t] * s_row_V[t]) * codeV[t, d] + sum_t p[t] * zp_V[t])``

Memory traffic of ``decode`` (B requests of length L_b, Hkv heads, R record bytes, pool element
bytes E, s = 4 for fp8 pools else 0): read ``sum_b(floor(L_b/G))*Hkv*R``
``+ sum_b(L_b mod G)*2*Hkv*(D*E + s) + B*T*Hq*D*bytes(q)`` plus the used block-table entries
and ``12B`` bytes of lengths and tail blocks; write ``B*T*Hq*D*bytes(out)``.
"""

from __future__ import annotations

import math

import torch

from kvarn_formats import RecordLayout
from kvarn_ops._validate import MODEL_DTYPES, check_softmax_scale, check_tensor
from kvarn_ops.reference.cache import check_context_args, read_pool_blocks
from kvarn_ops.reference.hadamard import hadamard
from kvarn_ops.reference.records import record_fields

__all__ = [
    "MAX_GQA",
    "MAX_QUERY_ROWS",
    "MAX_QUERY_TOKENS",
    "OPERAND_PRECISIONS",
    "attention_oracle",
    "decode",
]

MAX_QUERY_TOKENS = 8
"""Largest T (query tokens per request: 1 for decode, up to 8 for speculative verify)."""
MAX_QUERY_ROWS = 64
"""Largest ``T * GQA`` (query rows per KV head: query tokens times query heads per KV head)
the decode kernels serve: GQA 8 up to T = 8, GQA 16 (Llama-3.1-405B, GLM-4) up to T = 4, GQA
32 up to T = 2. Every implementation refuses more, the same way. (The kernels compute more
than 32 rows in chunks of query tokens: ``kernels.decode.chunk_tokens``.)"""
MAX_GQA = 32
"""Largest GQA (query heads per KV head): one query token's rows fit one program."""

OPERAND_PRECISIONS = (None, "fp16", "fp16_tf32")
"""What ``decode(operand_precision=...)`` emulates. ``None``: every operand in the compute
dtype. ``"fp16"``: the Triton decode's 16-bit operands (q times softmax_scale * log2(e) before
the rotation and the softmax weights times the V row scales rounded to fp16; q times the K
column scales as two fp16 parts ``hi + lo``, as every decode kernel feeds it since one fp16
operand proved too coarse on records whose zero-point term nearly cancels the code term;
sums stay in the compute dtype), with fp32 operands kept whole, as the Triton interpreter
computes them. ``"fp16_tf32"``: the same on tensor cores, where fp32 dot operands (the exact tail's
q, K, p and V) keep 10 mantissa bits (truncated)."""

_LOG2E = 1.4426950408889634


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


def _fp16_pair(x: torch.Tensor) -> torch.Tensor:
    """``hi + lo``: ``x`` rounded to fp16, plus its remainder rounded to fp16."""
    hi = _fp16(x)
    return hi + _fp16(x - hi)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 with the 13 low mantissa bits cleared (what sm_90 tensor cores read)."""
    bits = x.to(torch.float32).view(torch.int32) & ~0x1FFF
    return bits.view(torch.float32).to(x.dtype)


def _check_workspace(workspace: torch.Tensor | None, device: torch.device) -> None:
    # The scratch belongs to the Triton kernel (kvarn_ops.decode_workspace: a flat float32
    # tensor); the reference does not use it but rejects what the launcher would reject.
    if workspace is None:
        return
    check_tensor("workspace", workspace, dtypes=torch.float32, ndim=1, device=device)


def _attend_request(
    qr: torch.Tensor,
    packed: torch.Tensor,
    blocks: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    layout: RecordLayout,
    length: int,
    scale: float,
    cd: torch.dtype,
    operands: str | None = None,
    weight_shift: float = 0.0,
) -> torch.Tensor:
    """Rotated-frame attention of one request. qr: [T, Hkv, g, D] (compute dtype)."""
    r16 = _fp16 if operands else (lambda x: x)
    r32 = _tf32 if operands == "fp16_tf32" else (lambda x: x)
    if operands:  # the kernels' frame: q pre-multiplied by scale * log2(e), scores in log2
        qr, scale = qr * (scale * _LOG2E), 1.0 / _LOG2E
    t_q, hkv, grp, d = qr.shape
    g = layout.block_size
    n_full = blocks.shape[0]
    f = record_fields(packed[blocks].reshape(n_full * hkv, layout.record_bytes), layout)
    view = {k: v.view(n_full, hkv, *v.shape[1:]).to(cd) for k, v in f.items()}
    # Packed keys, folded: [n, Hkv, D] query-side scales, codes fed raw.
    r16x2 = _fp16_pair if operands else (lambda x: x)
    q_scaled = r16x2(torch.einsum("tkgd,nkd->ntkgd", qr, view["k_col_scale"]))
    dots = torch.einsum("ntkgd,nkdj->ntkgj", q_scaled, view["k_codes"])
    bias = torch.einsum("tkgd,nkd->ntkg", qr, view["k_zero_point"])
    s_packed = (dots + bias[..., None]) * view["k_row_scale"][:, None, :, None, :]
    s_packed = s_packed.permute(1, 2, 3, 0, 4).reshape(t_q, hkv, grp, n_full * g)
    s_tail = torch.einsum("tkgd,skd->tkgs", r32(qr), r32(tail_k))
    scores = torch.cat((s_packed, s_tail), dim=-1) * scale
    # Causal: query t sits at position length - T + t and sees keys at positions <= it.
    key_pos = torch.arange(length, device=qr.device)
    q_pos = length - t_q + torch.arange(t_q, device=qr.device)
    scores = scores.masked_fill((key_pos[None, :] > q_pos[:, None])[:, None, None, :], -math.inf)
    m = scores.amax(dim=-1, keepdim=True) + weight_shift / _LOG2E
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    p_packed = p[..., : n_full * g].reshape(t_q, hkv, grp, n_full, g)
    p_tail = p[..., n_full * g :]
    # Packed values, folded: weights scaled per token, codes fed raw, channel scale last.
    p_scaled = r16(p_packed * view["v_row_scale"].permute(1, 0, 2)[None, :, None])
    acc = torch.einsum("tkgnj,nkjd->tkgnd", p_scaled, view["v_codes"])
    vbias = torch.einsum("tkgnj,nkj->tkgn", p_packed, view["v_zero_point"])
    o_packed = (acc + vbias[..., None]) * view["v_col_scale"].permute(1, 0, 2)[None, :, None]
    o = o_packed.sum(dim=3) + torch.einsum("tkgs,skd->tkgd", r32(p_tail), r32(tail_v))
    return o / denom


def decode(
    q: torch.Tensor,
    packed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tail_pool_block: torch.Tensor,
    layout: RecordLayout,
    softmax_scale: float,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    operand_precision: str | None = None,
    weight_shift: float = 0.0,
) -> None:
    """Attention of the T newest tokens of each request over its whole cached context.

    Parameters
    ----------
    q : [B, T, Hq, D] float16/bfloat16/float32, model frame; T <= 8; Hq a multiple of Hkv
        (query head h reads KV head ``h // (Hq // Hkv)``). The T queries are the last T tokens
        of the sequence and are causal among themselves.
    packed : uint8 [num_blocks, Hkv, R]; block_table : int32 [B, max_blocks];
    seq_lens : int32 [B], tokens in the cache including the T new ones (>= T);
    exact_k, exact_v, k_scale, v_scale : the exact pool; tail_pool_block : int32 [B], the pool
        block holding the ``seq_len % G`` newest tokens (not read when that is 0).
    layout : dense kvarn_formats.RecordLayout.
    softmax_scale : float, multiplies q.k.
    out : [B, T, Hq, D] float16/bfloat16/float32, model frame (written).
    workspace : float32 tensor from ``kvarn_ops.decode_workspace(...)`` (the Triton kernel's
        scratch) or None; not used by the reference.
    compute_dtype : torch.float32 (default) or torch.float64 (the oracle).
    operand_precision : one of ``OPERAND_PRECISIONS``: None (default), or the rounding of the
        kernels' dot operands to emulate (the error yardstick of kernel tests).
    weight_shift : float >= 0, softmax weights are taken relative to the row max times
        ``2**weight_shift`` (the result is the same up to rounding). The kernels round weights
        taken relative to a running max, so with ``operand_precision`` set, shifts other than
        integers give other realizations of the same rounding error.
    """
    b, g, hkv, d = check_context_args(
        packed, block_table, seq_lens, exact_k, exact_v, k_scale, v_scale, tail_pool_block, layout
    )
    dev = exact_k.device
    check_tensor("q", q, dtypes=MODEL_DTYPES, ndim=4, device=dev)
    qb, t_q, hq, qd = q.shape
    if qb != b or qd != d:
        raise ValueError(
            f"q: expected shape [{b}, T, Hq, {d}] (batch of block_table, head_dim "
            f"of the layout), got {list(q.shape)}"
        )
    if not 1 <= t_q <= MAX_QUERY_TOKENS:
        raise ValueError(f"q: T (dim 1) must be 1 to {MAX_QUERY_TOKENS}, got {t_q}")
    if hq < hkv or hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a positive multiple of {hkv} KV heads")
    if hq // hkv > MAX_GQA:
        raise ValueError(f"q: {hq // hkv} query heads per KV head exceed {MAX_GQA}")
    if t_q * (hq // hkv) > MAX_QUERY_ROWS:
        raise ValueError(
            f"q: T * (query heads per KV head) = {t_q} * {hq // hkv} exceeds {MAX_QUERY_ROWS} "
            "query rows per KV head"
        )
    check_tensor("out", out, dtypes=MODEL_DTYPES, shape=tuple(q.shape), device=dev)
    softmax_scale = check_softmax_scale(softmax_scale)
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"compute_dtype: must be torch.float32 or torch.float64, got {compute_dtype}"
        )
    if not isinstance(weight_shift, (int, float)) or not 0 <= weight_shift <= 64:
        raise ValueError(f"weight_shift: must be a float in [0, 64], got {weight_shift!r}")
    if operand_precision not in OPERAND_PRECISIONS:
        raise ValueError(
            f"operand_precision: must be one of {OPERAND_PRECISIONS}, got {operand_precision!r}"
        )
    _check_workspace(workspace, dev)
    if seq_lens.device.type == "cpu" and b and int(seq_lens.min()) < t_q:
        raise ValueError(f"seq_lens: every entry must be >= T = {t_q} (the queries are cached)")
    qc = q.to(compute_dtype)
    if operand_precision:
        qk = float(softmax_scale) * _LOG2E
        qc = _fp16(qc * qk) / qk
    qr = hadamard(qc).view(b, t_q, hkv, hq // hkv, d)
    res = torch.empty(b, t_q, hkv, hq // hkv, d, dtype=compute_dtype, device=dev)
    for r in range(b):
        length = int(seq_lens[r])
        n_full, tail = divmod(length, g)
        blocks = block_table[r, :n_full].to(torch.long)
        pb = tail_pool_block[r : r + 1]
        if tail:
            tail_k = read_pool_blocks(exact_k, k_scale, pb, compute_dtype)[0, :tail]
            tail_v = read_pool_blocks(exact_v, v_scale, pb, compute_dtype)[0, :tail]
        else:
            tail_k = tail_v = torch.empty(0, hkv, d, dtype=compute_dtype, device=dev)
        res[r] = _attend_request(
            qr[r],
            packed,
            blocks,
            tail_k,
            tail_v,
            layout,
            length,
            float(softmax_scale),
            compute_dtype,
            operand_precision,
            float(weight_shift),
        )
    out.copy_(hadamard(res.view(b, t_q, hq, d)))


def attention_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Plain softmax attention over explicit K/V, computed in ``dtype``.

    Parameters
    ----------
    q : [T, Hq, D]; the T queries are the last T of the S positions (causal among themselves).
    k, v : [S, Hkv, D], S >= T, Hq a multiple of Hkv. Any frame, as long as q and k share one;
        the output is in v's frame.

    Returns
    -------
    [T, Hq, D] in ``dtype``.
    """
    t_q, hq, d = q.shape
    s, hkv, _ = k.shape
    grp = hq // hkv
    qh = q.to(dtype).permute(1, 0, 2)  # [Hq, T, D]
    kh = k.to(dtype).repeat_interleave(grp, dim=1).permute(1, 0, 2)  # [Hq, S, D]
    vh = v.to(dtype).repeat_interleave(grp, dim=1).permute(1, 0, 2)
    scores = torch.bmm(qh, kh.transpose(1, 2)) * softmax_scale
    allowed = torch.ones(t_q, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t_q)
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.bmm(torch.softmax(scores, dim=-1), vh).permute(1, 0, 2)
