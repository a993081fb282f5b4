"""The MLA pool manager against a model of the data: plans are run literally on a fake pool
and fake packed tiles, and every token each scheduled request reads must be the token the
oracle says it wrote there, over random serving-like steps (vLLM's block pool, prefix cache,
preemption and speculative rollback modelled in Python)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

from kvarn_vllm.mla_pool import (
    GROUP,
    NULL_BLOCK,
    BlockState,
    LostTail,
    MlaPoolManager,
    PoolTooSmall,
    Scheduled,
    StepPlan,
    mla_pool_slots_needed,
)

POISON = "poison"  # what a row holds before anything is written to it


class FakeCache:
    """One layer's cache as Python lists: ``pool[slot][row]`` and ``tiles[block][row]``."""

    def __init__(self, num_slots: int, group: int) -> None:
        self.g = group
        self.pool: list[list[object]] = [[POISON] * group for _ in range(num_slots)]
        self.tiles: dict[int, list[object]] = {}

    def run(self, plan: StepPlan, new_values: list[object]) -> None:
        """Rehydrate, scatter, pack: exactly what the plan says, in a layer's order."""
        assert len(plan.token_rows) == len(new_values)
        for block, slot in plan.rehydrate:
            self.pool[slot] = list(self.tiles.get(block, [POISON] * self.g))
        for row, value in zip(plan.token_rows, new_values, strict=True):
            if row >= 0:
                self.pool[row // self.g][row % self.g] = value
        for slot, block in plan.pack:
            self.tiles[block] = list(self.pool[slot])

    def read(self, read_map: dict[int, int], block_ids: list[int], n: int) -> list[object]:
        out = []
        for p in range(n):
            block = block_ids[p // self.g]
            slot = read_map.get(block, -1)
            rows = self.pool[slot] if slot >= 0 else self.tiles.get(block, [POISON] * self.g)
            out.append(rows[p % self.g])
        return out


def check_ownership(mgr: MlaPoolManager, plan: StepPlan, requests: list[Scheduled]) -> None:
    """No slot in a plan serves anything but the block it is listed with (no shared scratch)."""
    g = mgr.group
    assert NULL_BLOCK not in plan.read_map or plan.read_map[NULL_BLOCK] == -1
    slots = [s for s in plan.read_map.values() if s >= 0]
    assert len(slots) == len(set(slots)), f"two blocks read one slot: {plan.read_map}"
    for block, slot in plan.read_map.items():
        assert slot == -1 or (block != NULL_BLOCK and mgr.slot_of(block) == slot)
        assert -1 <= slot < mgr.num_slots
    for slot, block in plan.pack + [(s, b) for b, s in plan.rehydrate]:
        assert block != NULL_BLOCK and mgr.slot_of(block) == slot == plan.read_map[block]
    rows = iter(plan.token_rows)
    for computed, total, blocks in requests:
        for p in range(computed, total):
            row, block = next(rows), blocks[p // g]
            want = -1 if block == NULL_BLOCK else mgr.slot_of(block) * g + p % g
            assert row == want


# ---------------------------------------------------------------------------------------------
# a model of vLLM's scheduler and block pool


@dataclass
class Req:
    tokens: list[int]  # the oracle: what logical position p must read back
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    idle: int = 0


class Sim:
    def __init__(self, rng: random.Random, group: int, max_seqs: int, budget: int) -> None:
        self.rng, self.g, self.max_seqs, self.budget = rng, group, max_seqs, budget
        self.max_len = 10 * group  # a request finishes once it holds this many tokens
        self.chunk = max(1, group // 4)
        # Many more blocks than slots: tails of finished requests hold slots until reclaimed.
        self.num_blocks = 1 + max_seqs * (self.max_len // group + 8) + 300
        self.free = list(range(1, self.num_blocks))  # vLLM's free queue; block 0 is null
        self.ref = [0] * self.num_blocks
        self.cached: dict[tuple[int, ...], int] = {}  # prefix of full blocks -> block
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.running: dict[int, Req] = {}
        self.waiting: list[Req] = []  # preempted, recomputed from scratch when resumed
        self.next_id = 0
        self.events = dict.fromkeys(
            ("prefix_hits", "preempted", "resumed", "finished", "rollbacks", "rollback_into_full"),
            0,
        )
        # A running request idles at most 2 steps, so its tail survives LRU reclaim when the
        # pool holds more slots than 4 steps can touch (each step touches <= T // G + 2R).
        step = budget // group + 2 * max_seqs
        self.num_slots = 4 * step + max_seqs
        assert self.num_slots >= mla_pool_slots_needed(max_seqs, budget, group)

    def _token(self) -> int:
        return self.rng.getrandbits(40)

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # vLLM frees tail blocks first, so they are evicted first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def _alloc(self) -> int:
        b = self.free.pop(self.rng.choice((0, -1)))  # oldest freed, or just freed: both reuse
        if b in self.key_of:
            del self.cached[self.key_of.pop(b)]
        self.ref[b] = 1
        return b

    def _admit(self, req: Req) -> None:
        """Prefix lookup (full blocks, leaving at least one token to compute), as vLLM does."""
        g, req.blocks, req.computed = self.g, [], 0
        while (len(req.blocks) + 1) * g < len(req.tokens):
            b = self.cached.get(tuple(req.tokens[: (len(req.blocks) + 1) * g]))
            if b is None:
                break
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            req.blocks.append(b)
            self.events["prefix_hits"] += 1
        req.computed = len(req.blocks) * g
        self.running[self.next_id] = req
        self.next_id += 1

    def arrivals(self) -> None:
        rng = self.rng
        for rid in [
            r for r, q in self.running.items() if q.computed >= len(q.tokens) > self.max_len
        ]:
            self._release(self.running.pop(rid).blocks)
            self.events["finished"] += 1
        if self.running and rng.random() < 0.04:  # finished early: vLLM tells no attention backend
            self._release(self.running.pop(rng.choice(list(self.running))).blocks)
            self.events["finished"] += 1
        if self.running and rng.random() < 0.03:  # preempted: blocks freed, recomputed later
            req = self.running.pop(rng.choice(list(self.running)))
            self._release(req.blocks)
            self.waiting.append(req)
            self.events["preempted"] += 1
        if len(self.running) < self.max_seqs and rng.random() < 0.4:
            if self.waiting and rng.random() < 0.5:
                self._admit(self.waiting.pop(0))
                self.events["resumed"] += 1
            elif self.cached and rng.random() < 0.5:  # shares a prefix of earlier requests
                key = rng.choice(list(self.cached))
                self._admit(Req(list(key) + [self._token() for _ in range(rng.randint(1, 9))]))
            else:
                self._admit(Req([self._token() for _ in range(rng.randint(1, 3 * self.g))]))

    def schedule(self) -> list[tuple[int, int, bool]]:
        """(request id, new tokens, decode?) for the step. Every running request gets a token
        (budget >= max_seqs) but for a random pause of at most 2 steps."""
        batch, budget = [], self.budget
        order = list(self.running)
        for n, rid in enumerate(order):
            req = self.running[rid]
            if req.idle < 2 and self.rng.random() < 0.1:
                req.idle += 1
                continue
            cap = budget - (len(order) - n - 1)  # leave a token for each request after this one
            left = len(req.tokens) - req.computed
            if left > 0:  # prompt, recompute or chunked prefill
                q = min(left, cap, self.chunk * self.rng.choice((1, 2, 3, 5, 8, 13)))
            else:  # decode, with speculative tokens
                q = min(cap, 1 + (self.rng.randint(1, 4) if self.rng.random() < 0.4 else 0))
                req.tokens += [self._token() for _ in range(q)]
            budget -= q
            req.idle = 0
            while len(req.blocks) < -(-(req.computed + q) // self.g):
                req.blocks.append(self._alloc())
            batch.append((rid, q, left == 0))
        return batch

    def finish_step(self, rid: int, q: int, rollback: int) -> None:
        req, g = self.running[rid], self.g
        total = req.computed + q
        req.computed = total - rollback
        if rollback:  # rejected speculative tokens: vLLM rewinds; later tokens differ
            self.events["rollbacks"] += 1
            if total // g > req.computed // g:
                self.events["rollback_into_full"] += 1
            del req.tokens[req.computed :]
            need = -(-req.computed // g)
            if len(req.blocks) > need and self.rng.random() < 0.5:
                self._release(req.blocks[need:])
                del req.blocks[need:]
        for i in range(req.computed // g):  # full, final blocks become prefix-cache hits
            key = tuple(req.tokens[: (i + 1) * g])
            if req.blocks[i] not in self.key_of and key not in self.cached:
                self.cached[key] = req.blocks[i]
                self.key_of[req.blocks[i]] = key


def run_random(seed: int, steps: int, group: int, max_seqs: int, budget: int) -> dict[str, int]:
    rng = random.Random(seed)
    sim = Sim(rng, group, max_seqs, budget)
    mgr = MlaPoolManager(sim.num_slots, sim.num_blocks, group)
    cache = FakeCache(sim.num_slots, group)
    counts = dict(sim.events, rehydrates=0, packs=0)
    for step in range(steps):
        sim.arrivals()
        batch = sim.schedule()
        requests, values = [], []
        for rid, q, _ in batch:
            req = sim.running[rid]
            pad = [NULL_BLOCK] * rng.randint(0, 2)  # block tables are padded with the null block
            requests.append(Scheduled(req.computed, req.computed + q, req.blocks + pad))
            values += req.tokens[req.computed : req.computed + q]
        plan = mgr.plan(requests)
        check_ownership(mgr, plan, requests)
        cache.run(plan, values)
        counts["rehydrates"] += len(plan.rehydrate)
        counts["packs"] += len(plan.pack)
        for (rid, _, _), (_, total, blocks) in zip(batch, requests, strict=True):
            want = sim.running[rid].tokens[:total]
            for view in (plan.read_map, plan.read_map_after_pack()):
                got = cache.read(view, blocks, total)
                if got != want:
                    bad = next(p for p in range(total) if got[p] != want[p])
                    pytest.fail(
                        f"seed {seed} step {step}: request {rid} position {bad} "
                        f"(block {blocks[bad // group]}) read {got[bad]}, wrote {want[bad]}"
                    )
        for rid, q, decode in batch:  # a decode step of q > 1 tokens verifies q - 1 drafts
            sim.finish_step(rid, q, rng.randint(0, q - 1) if decode else 0)
    counts.update(sim.events, reclaimed=mgr.reclaimed)
    return counts


def test_random_steps_against_oracle():
    seed = int(os.environ.get("KVARN_MLA_POOL_SEED", "20240607"))
    print(f"seed {seed} (set KVARN_MLA_POOL_SEED to replay)")
    counts = run_random(seed, 10_000, group=4, max_seqs=6, budget=16)
    print(counts)
    for event in counts:  # every operation the test claims to cover did happen, repeatedly
        assert counts[event] >= 20, (event, counts)


def test_random_steps_full_size_blocks():
    seed = int(os.environ.get("KVARN_MLA_POOL_SEED", "20240607")) + 1
    print(f"seed {seed}")
    counts = run_random(seed, 1_500, group=GROUP, max_seqs=3, budget=96)
    for event in ("packs", "prefix_hits", "reclaimed", "rollback_into_full", "preempted"):
        assert counts[event] >= 10, (event, counts)


# ---------------------------------------------------------------------------------------------
# rules, one at a time (G = 4)

G = 4


def step(mgr: MlaPoolManager, cache: FakeCache, reqs: list[tuple[int, int, list[int]]], tag: str):
    """Run one step writing ``tag:p`` at position p of each request."""
    requests = [Scheduled(*r) for r in reqs]
    plan = mgr.plan(requests)
    check_ownership(mgr, plan, requests)
    cache.run(plan, [f"{tag}:{p}" for c, t, _ in reqs for p in range(c, t)])
    return plan


def test_fill_pack_then_release_next_step():
    mgr, cache = MlaPoolManager(4, 16, G), FakeCache(4, G)
    plan = step(mgr, cache, [(0, 3, [5])], "a")
    assert plan.read_map == {5: 0} and plan.pack == [] and mgr.state(5) is BlockState.LIVE
    plan = step(mgr, cache, [(3, 4, [5])], "a")
    assert plan.pack == [(0, 5)] and plan.read_map == {5: 0}
    assert plan.read_map_after_pack() == {5: -1} and mgr.state(5) is BlockState.PENDING
    plan = step(mgr, cache, [(4, 5, [5, 6])], "a")  # 5's slot is freed first, then reused
    assert plan.read_map == {5: -1, 6: 0} and mgr.state(5) is BlockState.PACKED
    assert cache.read(plan.read_map, [5, 6], 5) == [f"a:{p}" for p in range(5)]


def test_prefix_hit_block_whose_slot_was_recycled_reads_its_own_tile():
    """Regression: a full block shared by prefix caching read through a stale block -> slot
    entry returned the rows of the block that took the slot over."""
    mgr, cache = MlaPoolManager(2, 16, G), FakeCache(2, G)
    step(mgr, cache, [(0, 4, [5])], "a")  # A fills block 5 in slot 0
    step(mgr, cache, [(4, 6, [5, 6])], "a")  # slot 0 now serves block 6
    assert mgr.slot_of(6) == 0 and mgr.slot_of(5) == -1
    plan = step(mgr, cache, [(6, 7, [5, 6]), (4, 7, [5, 7])], "b")  # B hits A's block 5
    assert plan.read_map[5] == -1 and plan.rehydrate == []
    assert cache.read(plan.read_map, [5, 7], 7) == [f"a:{p}" for p in range(4)] + [
        f"b:{p}" for p in range(4, 7)
    ]


def test_no_scratch_slot_every_slot_is_a_blocks_own():
    """Regression: a shared scratch slot was handed out as the cache of real blocks. The null
    block takes no slot (a one-slot pool suffices) and never reads or writes the pool."""
    mgr, cache = MlaPoolManager(1, 16, G), FakeCache(1, G)
    plan = step(mgr, cache, [(0, 6, [NULL_BLOCK, 3])], "a")
    assert plan.token_rows[:4] == [-1] * 4 and plan.token_rows[4:] == [0, 1]
    assert plan.read_map == {3: 0}
    assert NULL_BLOCK not in plan.read_map and mgr.slot_of(NULL_BLOCK) == -1
    plan = step(mgr, cache, [(0, 4, [NULL_BLOCK]), (6, 7, [NULL_BLOCK, 3])], "b")
    assert plan.pack == [] and plan.read_map == {3: 0} and mgr.state(NULL_BLOCK) is BlockState.FREE


def test_prefix_hit_in_the_step_that_fills_the_block():
    """B shares block 5 in the very step A fills it: the exact rows are read until the pack
    ran, the tile after."""
    mgr, cache = MlaPoolManager(4, 16, G), FakeCache(4, G)
    step(mgr, cache, [(0, 2, [5])], "a")
    plan = step(mgr, cache, [(2, 4, [5]), (4, 6, [5, 6])], "a")
    assert plan.read_map[5] == 0 and plan.read_map_after_pack()[5] == -1
    want = [f"a:{p}" for p in range(6)]
    for view in (plan.read_map, plan.read_map_after_pack()):
        assert cache.read(view, [5, 6], 6) == want


def test_rollback_right_after_fill_keeps_exact_slot():
    mgr, cache = MlaPoolManager(4, 16, G), FakeCache(4, G)
    step(mgr, cache, [(0, 2, [5])], "a")
    plan = step(mgr, cache, [(2, 6, [5, 6])], "s")  # speculative tokens fill 5, spill into 6
    assert plan.pack == [(0, 5)]
    plan = step(mgr, cache, [(3, 4, [5, 6])], "t")  # 3 of them rejected: back into block 5
    assert plan.rehydrate == [] and mgr.slot_of(5) == 0 and plan.pack == [(0, 5)]
    assert cache.read(plan.read_map, [5], 4) == ["a:0", "a:1", "s:2", "t:3"]


def test_rollback_into_packed_block_rehydrates_it():
    mgr, cache = MlaPoolManager(4, 16, G), FakeCache(4, G)
    step(mgr, cache, [(0, 6, [5, 6])], "s")  # fills 5 (packed), 6 partial
    step(mgr, cache, [(0, 1, [9])], "x")  # the request idles: 5 is packed, its slot released
    assert mgr.state(5) is BlockState.PACKED and mgr.slot_of(5) == -1
    plan = step(mgr, cache, [(3, 5, [5, 6])], "t")  # rolled back to 3 tokens
    slot = mgr.slot_of(5)
    assert plan.rehydrate == [(5, slot)] and (slot, 5) in plan.pack
    assert cache.read(plan.read_map, [5, 6], 5) == ["s:0", "s:1", "s:2", "t:3", "t:4"]


def test_recompute_from_zero_is_fresh_not_rehydrated():
    mgr, cache = MlaPoolManager(4, 16, G), FakeCache(4, G)
    step(mgr, cache, [(0, 4, [5])], "a")
    step(mgr, cache, [(0, 1, [9])], "x")  # 5 packed
    plan = step(mgr, cache, [(0, 2, [5])], "b")  # block 5 reused from offset 0
    assert plan.rehydrate == [] and mgr.state(5) is BlockState.LIVE
    assert cache.read(plan.read_map, [5], 2) == ["b:0", "b:1"]


def test_reclaims_least_recent_and_refuses_lost_tail():
    mgr, cache = MlaPoolManager(2, 16, G), FakeCache(2, G)
    step(mgr, cache, [(0, 1, [1])], "a")
    step(mgr, cache, [(0, 1, [2])], "b")
    step(mgr, cache, [(1, 2, [2]), (0, 1, [3])], "c")  # block 1 (oldest, untouched) reclaimed
    assert mgr.reclaimed == 1 and mgr.state(1) is BlockState.FREE and mgr.slot_of(3) >= 0
    with pytest.raises(LostTail, match="block 1 "):
        mgr.plan([Scheduled(1, 2, [1])])
    with pytest.raises(LostTail, match="block 7 "):
        mgr.plan([Scheduled(2, 3, [7])])  # never written
    plan = step(mgr, cache, [(0, 1, [1])], "d")  # from offset 0 it is fine again
    assert cache.read(plan.read_map, [1], 1) == ["d:0"]


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_slots=0, num_blocks=8), "num_slots"),
        (dict(num_slots=2, num_blocks=0), "num_blocks"),
        (dict(num_slots=2, num_blocks=8, group=0), "group"),
    ],
)
def test_constructor_errors(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        MlaPoolManager(**kwargs)


@pytest.mark.parametrize(
    "requests, name",
    [
        ([(-1, 2, [1])], "computed"),
        ([(3, 2, [1])], "total"),
        ([(0, 5, [1])], "block_ids"),  # 5 tokens need 2 blocks
        ([(0, 2, [16])], "block_ids"),  # out of range
        ([(0, 2, [-3])], "block_ids"),
        ([(0, 8, [2, 2])], "block_ids"),  # one block twice
        ([(0, 2, [1]), (0, 3, [1])], "requests"),  # two requests write one block
    ],
)
def test_plan_errors_name_the_argument(requests, name):
    mgr = MlaPoolManager(4, 16, G)
    with pytest.raises(ValueError, match=f"^{name}:"):
        mgr.plan([Scheduled(*r) for r in requests])


def test_pool_smaller_than_one_step_is_refused_without_side_effects():
    mgr, cache = MlaPoolManager(2, 16, G), FakeCache(2, G)
    step(mgr, cache, [(0, 2, [1])], "a")
    before = (mgr.slot_of(1), mgr.state(1), mgr.reclaimed)
    with pytest.raises(PoolTooSmall, match="^num_slots: this step needs 3") as info:
        mgr.plan([Scheduled(2, 3, [1]), Scheduled(0, 8, [2, 3])])
    assert isinstance(info.value, ValueError)
    assert (mgr.slot_of(1), mgr.state(1), mgr.reclaimed) == before
    plan = step(mgr, cache, [(2, 3, [1])], "b")
    assert cache.read(plan.read_map, [1], 3) == ["a:0", "a:1", "b:2"]


@pytest.mark.parametrize("arg", ["max_num_seqs", "max_num_batched_tokens", "group"])
def test_sizing_errors(arg):
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=512, group=64)
    kwargs[arg] = 0
    with pytest.raises(ValueError, match=f"^{arg}:"):
        mla_pool_slots_needed(**kwargs)


def test_sizing_formula():
    assert mla_pool_slots_needed(32, 4096) == 4096 // 64 + 2 * 32 + 2 * 32
