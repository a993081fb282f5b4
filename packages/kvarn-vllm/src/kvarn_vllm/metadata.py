"""Per-step attention metadata for the dense KVarN cache, built once and shared by all layers.

What every query sees (the same rule in decode and prefill, so results do not depend on how a
prompt is chunked, batched or served from the prefix cache): query position ``p`` attends to
the dequantized records of the blocks that are full once ``p`` is cached (blocks
``i < (p + 1) // G``) and to the exact rows of its own block up to ``p``. Decode gets this
from ``decode`` (full blocks packed, ``seq_len % G`` newest exact); prefill builds it from
``materialize`` (full blocks, and the first G - 1 exact rows of each block the step touches)
with a boolean mask.

Requests whose T new tokens (T <= ``max_decode_tokens``, at most ``MAX_QUERY_TOKENS`` and
``MAX_QUERY_ROWS // GQA``, see :func:`decode_token_limit`: a decode, T = 1, or a speculative
verify run, T = 1 + drafts) all see the same packed blocks (``(L0 + 1) // G == L1 // G``: the
run does not fill a block before its last token) go through ``decode`` with T queries, grouped
by T; the others (a run that crosses a block boundary, longer chunks, prompts) through the
prefill path. Both give every query the view above.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from kvarn_ops.reference.decode import MAX_QUERY_ROWS, MAX_QUERY_TOKENS
from kvarn_vllm.exact_pool import NULL_BLOCK, ExactPoolAllocator, StepPlan


@dataclass
class PrefillRequest:
    """One request of the step with more than one new token (or a fresh prompt)."""

    tokens: slice  # rows of the step's query/key/value
    computed: int  # L0: tokens cached before the step
    total: int  # L1: tokens cached after it
    key_rows: slice  # rows of the step's context buffer: full blocks, then exact rows
    mask: torch.Tensor  # bool [q_len, keys]: True = attend


@dataclass
class DecodeBatch:
    """Requests of the step that attend through ``decode`` with T queries each."""

    t: int
    # rows of the step, request-major: a slice when they are consecutive (every decode-only
    # step), else int64 [B * T]
    tokens: torch.Tensor | slice
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    tail: torch.Tensor  # int32 [B] pool block of the partial block
    max_seq_len: int
    # decode scratch of the step, keyed by geometry: shared by the layers, which run one after
    # another on one stream (filled by the backend's first decode of the step)
    workspaces: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class KvarnMetadata:
    """Everything a layer needs for one step (tensors on the cache device)."""

    num_actual_tokens: int
    group: int
    pool_slots: torch.Tensor  # int64 [num_actual_tokens], -1 = not stored
    flush_src: torch.Tensor  # int32 [N] pool blocks
    flush_dst: torch.Tensor  # int32 [N] physical blocks
    # int32 [N]: 0 for a request's first block (token 0 is the attention sink), else -1
    flush_sink: torch.Tensor | None = None
    # decode and speculative verify, one batch per T (ascending)
    decodes: list[DecodeBatch] = field(default_factory=list)
    # prefill
    prefills: list[PrefillRequest] = field(default_factory=list)
    context_rows: int = 0  # rows of the step's dequantized context buffer
    full_block_table: torch.Tensor | None = None  # int32 [Bp, max_blocks]
    full_seq_lens: torch.Tensor | None = None  # int32 [Bp] (multiples of G)
    full_cu: torch.Tensor | None = None  # int32 [Bp + 1]
    exact_tail: torch.Tensor | None = None  # int32 [Be] pool blocks read exactly
    exact_seq_lens: torch.Tensor | None = None  # int32 [Be] rows read (<= G - 1)
    exact_cu: torch.Tensor | None = None  # int32 [Be + 1]


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _decode_batch(
    t: int, reqs: list[tuple[int, int, int, int]], block_table: torch.Tensor, device: torch.device
) -> DecodeBatch:
    rows = [start + i for start, _, _, _ in reqs for i in range(t)]
    lens = [total for _, _, total, _ in reqs]
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeBatch(
        t=t,
        tokens=(
            slice(rows[0], rows[0] + len(rows))
            if consecutive
            else torch.tensor(rows, dtype=torch.int64, device=device)
        ),
        block_table=block_table[[r for _, r, _, _ in reqs]].to(device),
        seq_lens=_i32(lens, device),
        tail=_i32([tail for _, _, _, tail in reqs], device),
        max_seq_len=max(lens),
    )


MAX_GQA = getattr(importlib.import_module("kvarn_ops.reference.decode"), "MAX_GQA", MAX_QUERY_ROWS)
"""Most query heads per KV head kvarn_ops' decode serves (32; kvarn-ops 1.0.0 has no name for
it: there it is its row limit, also 32)."""


def decode_token_limit(gqa: int) -> int:
    """Longest run (query tokens) that goes through ``decode`` for a model with ``gqa`` query
    heads per KV head: ``MAX_QUERY_TOKENS``, and ``T * gqa <= MAX_QUERY_ROWS`` (64 since
    kvarn-ops computes longer runs in chunks; 32 with kvarn-ops 1.0.0): with 64, 8 up to GQA 8,
    4 at GQA 16, 2 at GQA 32, and 0 beyond ``MAX_GQA`` (every run then takes the prefill path,
    which gives the same attention)."""
    if gqa < 1:
        raise ValueError(f"gqa: must be >= 1, got {gqa}")
    if gqa > MAX_GQA:
        return 0
    return min(MAX_QUERY_TOKENS, MAX_QUERY_ROWS // gqa)


def decode_route_note(gqa: int, drafts: int = 0) -> str | None:
    """A one-line note when some decode steps will take the prefill path because of the
    query-row limit (None when every single-token step and every verify run of ``1 + drafts``
    tokens fits ``decode``)."""
    limit = decode_token_limit(gqa)
    if limit == 0:
        return (
            f"{gqa} query heads per KV head exceed kvarn_ops' decode limit of {MAX_GQA}: every "
            "step takes the prefill path (materialize + attention, the same result, much slower "
            "per generated token)"
        )
    if 1 + drafts > limit:
        return (
            f"{gqa} query heads per KV head: verify runs of more than {limit} tokens (here up to "
            f"{1 + drafts}) exceed kvarn_ops' decode limit of {MAX_QUERY_ROWS} query rows and "
            "take the prefill path"
        )
    return None


def plan_step(
    allocator: ExactPoolAllocator,
    group: int,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    num_actual_tokens: int,
    device: torch.device,
    max_decode_tokens: int = MAX_QUERY_TOKENS,
) -> KvarnMetadata:
    """Build the step's metadata from host-side lists (the testable core of the builder).

    Parameters
    ----------
    allocator : the engine's exact-pool bookkeeping (updated).
    group : G.
    query_start_loc : [B + 1] token offsets of each request's new tokens.
    seq_lens : [B] tokens cached after the step, per request.
    block_table : int32 [B, max_blocks] physical block ids (any device).
    num_actual_tokens : rows of the step (>= query_start_loc[B]; extra rows are padding).
    max_decode_tokens : longest run that goes through ``decode`` (:func:`decode_token_limit`
        of the model's GQA); longer runs take the prefill path.
    """
    if not 0 <= max_decode_tokens <= MAX_QUERY_TOKENS:
        raise ValueError(
            f"max_decode_tokens: must be 0 to {MAX_QUERY_TOKENS}, got {max_decode_tokens}"
        )
    g = group
    bt_host = block_table.to("cpu", torch.int32)
    b = len(seq_lens)
    requests = []
    for r in range(b):
        q = query_start_loc[r + 1] - query_start_loc[r]
        total = seq_lens[r]
        n_blocks = -(-total // g)
        requests.append((total - q, total, bt_host[r, :n_blocks].tolist()))
    plan: StepPlan = allocator.plan(requests, g)

    slots = [-1] * num_actual_tokens
    dec: dict[int, list[tuple[int, int, int, int]]] = {}  # T -> (first row, request, L1, tail)
    pre: list[PrefillRequest] = []
    full_rows, full_lens, ex_tail, ex_lens = [], [], [], []
    ctx = 0
    for r, (computed, total, blocks) in enumerate(requests):
        start = query_start_loc[r]
        for p in range(computed, total):
            physical = blocks[p // g]
            if physical != NULL_BLOCK:
                slots[start + p - computed] = plan.pool_of[physical] * g + p % g
        tail_pool = allocator.scratch
        if total % g:
            tail_pool = plan.pool_of[blocks[total // g]]
        t = total - computed
        if 1 <= t <= max_decode_tokens and (computed + 1) // g == total // g:
            dec.setdefault(t, []).append((start, r, total, tail_pool))
            continue
        if total <= computed:
            continue
        n_full = total // g
        first = computed // g
        touched = list(range(first, (total - 1) // g + 1))
        keys = n_full * g + len(touched) * g
        q_pos = torch.arange(computed, total)
        visible_full = (q_pos + 1) // g  # blocks packed and visible to each query
        k_block = torch.arange(n_full * g) // g
        mask_full = k_block[None, :] < visible_full[:, None]
        ex_pos = torch.cat([torch.arange(j * g, (j + 1) * g) for j in touched])
        own = ex_pos[None, :] // g == q_pos[:, None] // g
        mask_ex = (
            own
            & (ex_pos[None, :] <= q_pos[:, None])
            & (visible_full[:, None] == q_pos[:, None] // g)
        )
        pre.append(
            PrefillRequest(
                tokens=slice(start, start + total - computed),
                computed=computed,
                total=total,
                key_rows=slice(ctx, ctx + keys),
                mask=torch.cat([mask_full, mask_ex], dim=1).to(device),
            )
        )
        full_rows.append(r)
        full_lens.append(n_full * g)
        for j in touched:
            owner = blocks[j]
            ex_tail.append(allocator.scratch if owner == NULL_BLOCK else plan.pool_of[owner])
            ex_lens.append(min(g - 1, total - j * g))
        ctx += keys

    md = KvarnMetadata(
        num_actual_tokens=num_actual_tokens,
        group=g,
        pool_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        flush_src=_i32([s for s, _ in plan.flush], device),
        flush_dst=_i32([d for _, d in plan.flush], device),
        flush_sink=_i32([0 if first else -1 for first in plan.flush_first], device),
        decodes=[_decode_batch(t, dec[t], block_table, device) for t in sorted(dec)],
        prefills=pre,
        context_rows=ctx,
    )
    if pre:
        # Full blocks of request i land at its key_rows start; exact rows follow, G per block.
        full_cu, exact_cu = [], []
        for req in pre:
            full_cu.append(req.key_rows.start)
            n_full = req.total // g
            first = req.computed // g
            for t in range((req.total - 1) // g - first + 1):
                exact_cu.append(req.key_rows.start + n_full * g + t * g)
        md.full_block_table = block_table[full_rows].to(device)
        md.full_seq_lens = _i32(full_lens, device)
        md.full_cu = _i32([*full_cu, ctx], device)
        md.exact_tail = _i32(ex_tail, device)
        md.exact_seq_lens = _i32(ex_lens, device)
        md.exact_cu = _i32([*exact_cu, ctx], device)
    return md
