"""Exact-pool bookkeeping against a simple oracle, over random serving-like steps."""

from __future__ import annotations

import random
import re

import pytest

from kvarn_vllm.exact_pool import (
    NULL_BLOCK,
    ExactPoolAllocator,
    LostTail,
    PoolExhausted,
    pool_blocks_needed,
)

G = 4


def test_fresh_block_partial_then_full():
    alloc = ExactPoolAllocator(8)
    plan = alloc.plan([(0, 3, [5])], G)  # 3 tokens into block 5
    assert plan.flush == [] and plan.pool_of == {5: 0}
    plan = alloc.plan([(3, 4, [5])], G)  # the 4th fills it: packed this step
    assert plan.pool_of == {5: 0} and plan.flush == [(0, 5)]
    plan = alloc.plan([(4, 5, [5, 6])], G)  # pool block 0 is released first, then reused
    assert plan.pool_of == {6: 0} and 5 not in alloc.owned


def test_flush_marks_each_requests_first_block():
    """Token 0 of a request's first block is its attention sink: the flush keeps that V row
    almost exact, so the plan says which flushed blocks are first blocks."""
    alloc = ExactPoolAllocator(16)
    plan = alloc.plan([(0, 9, [5, 6, 7]), (0, 2, [8])], G)  # blocks 5 and 6 fill
    assert plan.flush == [(0, 5), (1, 6)] and plan.flush_first == [True, False]
    plan = alloc.plan([(9, 12, [5, 6, 7]), (2, 4, [8])], G)  # 7 (third) and 8 (first) fill
    assert plan.flush == [(2, 7), (3, 8)] and plan.flush_first == [False, True]
    assert len(plan.flush_first) == len(plan.flush)


def test_null_block_uses_scratch_and_is_never_owned():
    alloc = ExactPoolAllocator(4)
    plan = alloc.plan([(0, 6, [NULL_BLOCK, NULL_BLOCK])], G)
    assert plan.pool_of == {NULL_BLOCK: alloc.scratch} and plan.flush == []
    assert alloc.owned == {}


def test_continuation_without_pool_block_is_refused():
    alloc = ExactPoolAllocator(4)
    with pytest.raises(LostTail, match="offset 2"):
        alloc.plan([(2, 3, [7])], G)


def test_reclaims_oldest_untouched_and_refuses_when_all_touched():
    alloc = ExactPoolAllocator(3)  # 2 usable blocks
    alloc.plan([(0, 1, [1])], G)
    alloc.plan([(0, 1, [2])], G)
    alloc.plan([(0, 1, [3])], G)  # takes block 1's pool block (oldest untouched)
    assert alloc.reclaimed == 1 and set(alloc.owned) == {2, 3}
    with pytest.raises(PoolExhausted, match="max-num"):
        alloc.plan([(1, 2, [2]), (1, 2, [3]), (0, 1, [4])], G)


def test_sizing_formula():
    assert pool_blocks_needed(32, 4096, 64) == 64 + 32 + 64 + 1


def test_rollback_into_a_packed_block():
    """Speculative verify fills block 5 with drafts, some are rejected, and the request goes on
    inside block 5: with keep_packed its exact rows are still there, and it is packed again
    when it fills; without, the continuation is refused (never misread)."""
    for keep in (True, False):
        alloc = ExactPoolAllocator(8, keep_packed=keep)
        alloc.plan([(0, 2, [5])], G)
        plan = alloc.plan([(2, 6, [5, 6])], G)  # tokens 2..5: block 5 fills, packed
        assert plan.flush == [(0, 5)]
        if not keep:
            with pytest.raises(LostTail, match="offset 3"):
                alloc.plan([(3, 4, [5])], G)
            continue
        plan = alloc.plan([(3, 4, [5])], G)  # tokens 3.. rejected: token 3 again
        assert plan.pool_of == {5: 0} and plan.flush == [(0, 5)]
        assert alloc.kept_packed == []
        alloc.plan([(4, 5, [5, 6])], G)
        assert alloc.kept_packed == [5] and alloc.owned[5] == 0


def test_kept_packed_blocks_are_reclaimed_first():
    alloc = ExactPoolAllocator(3, keep_packed=True)  # 2 usable blocks
    alloc.plan([(0, 4, [1]), (0, 1, [2])], G)  # block 1 packed, block 2 a live tail
    alloc.plan([(1, 2, [2])], G)
    assert alloc.kept_packed == [1]
    plan = alloc.plan([(0, 1, [3])], G)  # needs a pool block: block 1's, not the tail's
    assert plan.pool_of == {3: 0} and set(alloc.owned) == {2, 3} and alloc.reclaimed == 0


@pytest.mark.parametrize("speculative", [False, True])
def test_random_steps_against_oracle(speculative):
    """Requests arrive, grow by random chunks, finish; every partial block read back holds
    exactly the tokens its own request wrote (no other block's rows). With ``speculative``,
    steps of 1 + k tokens are verify runs: a random number of the k drafts is rejected and
    the request continues from the last accepted token (into a block packed with drafts)."""
    rng = random.Random(7)
    alloc = ExactPoolAllocator(pool_blocks_needed(6, 16, G), keep_packed=speculative)
    pool = {}  # (pool block, offset) -> token tag
    free_blocks = list(range(1, 400))
    rng.shuffle(free_blocks)
    live = {}  # rid -> [computed, blocks]
    next_rid = 0
    for _ in range(3000):
        if len(live) < 6 and rng.random() < 0.3:
            live[next_rid] = [0, []]
            next_rid += 1
        for rid in [r for r, (c, _) in live.items() if c > 40 or rng.random() < 0.05]:
            free_blocks.extend(live.pop(rid)[1])  # finished: vLLM frees its blocks
        batch, budget = [], 16
        for rid, (computed, blocks) in live.items():
            if budget <= 0 or rng.random() < 0.2:
                continue  # not scheduled this step
            q = min(budget, rng.choice([1, 4, 4, 2] if speculative else [1, 1, 1, 2, 5, 9]))
            budget -= q
            total = computed + q
            while len(blocks) < -(-total // G):
                blocks.append(free_blocks.pop())
            batch.append((rid, computed, total, list(blocks)))
        plan = alloc.plan([(c, t, b) for _, c, t, b in batch], G)
        for rid, computed, total, blocks in batch:
            for p in range(computed, total):
                pool[(plan.pool_of[blocks[p // G]], p % G)] = (rid, p)
            if total % G:  # the partial block's earlier rows are still this request's
                pb = plan.pool_of[blocks[total // G]]
                for p in range(total - total % G, total):
                    assert pool[(pb, p % G)] == (rid, p)
            live[rid][0] = total
            if speculative and total - computed > 1:  # reject 0..k of the k drafts
                live[rid][0] = total - rng.randrange(total - computed)
    assert next_rid > 20


@pytest.mark.parametrize(
    ("requests", "needle"),
    [
        ([(0, 3, [5]), (0, 2, [5])], "block 5 is written twice"),
        ([(0, 9, [5, 5, 6])], "block 5 is written twice"),
        ([(4, 2, [5, 6])], "total (2) below computed (4)"),
        ([(0, 3, [-3])], "block id -3"),
        ([(0, 9, [5, 6])], "2 block ids for 9 tokens; need 3"),
        ([(0.5, 3, [5])], "computed must be an integer"),
    ],
)
def test_malformed_steps_are_refused_before_any_change(requests, needle):
    alloc = ExactPoolAllocator(8)
    alloc.plan([(0, 3, [7])], G)
    before = dict(alloc.owned)
    with pytest.raises(ValueError, match=re.escape(needle)):
        alloc.plan(requests, G)
    assert alloc.owned == before
    assert alloc.plan([(3, 4, [7])], G).flush == [(before[7], 7)]  # still usable


def test_null_block_may_repeat_and_bad_group_is_refused():
    alloc = ExactPoolAllocator(8)
    plan = alloc.plan([(0, 3, [NULL_BLOCK]), (0, 2, [NULL_BLOCK])], G)
    assert plan.pool_of == {NULL_BLOCK: alloc.scratch}
    with pytest.raises(ValueError, match="group"):
        alloc.plan([(0, 3, [5])], 0)
    for bad in ((0, 100, 64), (4, 0, 64), (4, 100, 0)):
        with pytest.raises(ValueError, match="must be at least 1"):
            pool_blocks_needed(*bad)
