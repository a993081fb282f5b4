"""Which runs go through ``decode``: at most ``MAX_QUERY_TOKENS`` query tokens and at most
``MAX_QUERY_ROWS`` query rows per KV head (T * GQA), the limit kvarn_ops' decode enforces;
longer runs take the prefill path."""

from __future__ import annotations

import pytest
import torch

from kvarn_ops.reference import MAX_QUERY_ROWS, MAX_QUERY_TOKENS
from kvarn_vllm.exact_pool import ExactPoolAllocator
from kvarn_vllm.metadata import MAX_GQA, decode_route_note, decode_token_limit, plan_step

G = 64


#: (GQA, longest decode run) by kvarn_ops' row limit: 64 since it computes runs in chunks of
#: query tokens, 32 in kvarn-ops 1.0.0 (the oldest release the pins admit)
LIMITS = {
    64: [(1, 8), (4, 8), (5, 8), (8, 8), (9, 7), (16, 4), (17, 3), (32, 2), (33, 0), (71, 0)],
    32: [(1, 8), (4, 8), (5, 6), (8, 4), (16, 2), (32, 1), (33, 0), (71, 0)],
}


@pytest.mark.parametrize(("gqa", "tokens"), LIMITS[MAX_QUERY_ROWS])
def test_decode_token_limit(gqa, tokens):
    assert MAX_GQA == 32
    assert decode_token_limit(gqa) == tokens
    assert tokens <= MAX_QUERY_TOKENS and tokens * gqa <= MAX_QUERY_ROWS


def test_decode_token_limit_rejects_nonpositive_gqa():
    with pytest.raises(ValueError, match="gqa"):
        decode_token_limit(0)


def _plan(runs, limit):
    """runs: (tokens cached before, after) per request, each in its own blocks."""
    alloc = ExactPoolAllocator(64)
    qsl = [0]
    for c, t in runs:
        qsl.append(qsl[-1] + t - c)
    bt = torch.tensor([[10 * i + j for j in range(4)] for i in range(len(runs))], dtype=torch.int32)
    return plan_step(alloc, G, qsl, [t for _, t in runs], bt, qsl[-1], torch.device("cpu"), limit)


def test_runs_longer_than_the_limit_take_the_prefill_path():
    # fresh requests of T = 4, 5, 1, 8 tokens, inside one block each
    runs = [(0, 4), (0, 5), (0, 1), (0, 8)]
    md = _plan(runs, 8)
    assert sorted(b.t for b in md.decodes) == [1, 4, 5, 8] and not md.prefills
    md = _plan(runs, 4)  # e.g. GQA 16 (GQA 8 with kvarn-ops 1.0.0): T <= 4
    assert sorted(b.t for b in md.decodes) == [1, 4]
    assert [(p.computed, p.total) for p in md.prefills] == [(0, 5), (0, 8)]
    md = _plan(runs, 0)  # more than 32 query heads per KV head: no decode at all
    assert not md.decodes and len(md.prefills) == 4


def test_plan_step_rejects_a_limit_beyond_the_ops():
    with pytest.raises(ValueError, match="max_decode_tokens"):
        _plan([(0, 1)], MAX_QUERY_TOKENS + 1)


def test_route_note_says_when_decode_steps_take_the_prefill_path():
    assert decode_route_note(8) is None and decode_route_note(8, drafts=3) is None
    assert decode_route_note(8, drafts=3) is None
    assert (decode_route_note(16, drafts=3) is None) == (MAX_QUERY_ROWS == 64)
    note = decode_route_note(32, drafts=3)
    limit = decode_token_limit(32)
    assert note is not None and f"more than {limit} tokens" in note and "up to 4" in note
    note = decode_route_note(71)
    assert note is not None and "every step takes the prefill path" in note


def _rows(batch) -> list[int]:
    tok = batch.tokens
    return list(range(tok.start, tok.stop)) if isinstance(tok, slice) else tok.tolist()


def test_decode_rows_are_a_slice_when_consecutive():
    """Consecutive decode rows (every decode-only step) come as a slice, so the backend writes
    decode's output in place; rows split by a prefill come as an index tensor."""
    md = _plan([(0, 1), (0, 1), (0, 1)], 8)  # three runs of one token
    (batch,) = md.decodes
    assert isinstance(batch.tokens, slice) and _rows(batch) == [0, 1, 2]
    md = _plan([(0, 1), (0, 20), (0, 1)], 1)  # decode, prefill, decode
    (batch,) = md.decodes
    assert isinstance(batch.tokens, torch.Tensor) and _rows(batch) == [0, 21]
    md = _plan([(0, 2), (0, 2)], 8)  # runs of T = 2, request-major
    (batch,) = md.decodes
    assert isinstance(batch.tokens, slice) and _rows(batch) == [0, 1, 2, 3]
