"""Which MLA cache block keeps its exact rows in which pool slot (host-side bookkeeping, no torch).

An MLA layer's cache (kvarn_ops.reference.mla) has one packed tile per physical block of G = 64
tokens and an exact pool of P slots of G rows, indexed the same way in every layer. A block
still filling keeps its rows exact in a slot; once full it is packed into its tile, which is
then the truth. One :class:`MlaPoolManager` per engine turns each step's scheduled work into a
:class:`StepPlan` that every layer runs: rehydrate, scatter the new tokens, pack, then read.

Block states: FREE (no rows known: never written, or its slot was reclaimed while it filled),
LIVE (owns a slot, filling), PENDING (filled in the step: packed in it, its slot kept for the
step's reads), PACKED (no slot; its tile holds its G rows).

Rules (the physical block id is the key: vLLM never gives a partial block to two live
requests, and only full blocks are shared by prefix caching):

- A block written from offset 0 starts fresh: it keeps the slot it owns, else takes one. Rows
  past those the step writes are never read, so what a recycled slot held stays invisible.
- A block written at offset k > 0 needs its first k rows: a LIVE block has them in its slot;
  a PACKED block (re-entered after a speculative rollback or a preemption) takes a slot that
  is rehydrated from its tile before the step's writes; a FREE block, or one holding fewer
  than k rows, is refused with :class:`LostTail` (never read another block's rows).
- A block holding G rows after the step is packed in the step and is PENDING. At the start of
  the next step its slot is released (the block is PACKED), unless that step writes to it
  again (a rollback right after the fill): then it stays LIVE in its slot, exact.
- Reads: a LIVE or PENDING block reads its slot, a PACKED block its tile (-1), so a prefix-hit
  full block never needs a slot. Reading a FREE block, or rows it lacks, raises LostTail.
- The null block (id 0) never owns a slot: its tokens are not stored (-1), reads give -1.
  There is no scratch slot: every slot in a plan belongs to the block it is listed with.
- Slots of finished requests are not announced by vLLM; they are reclaimed lazily: a new slot
  comes from the free list, else from the least recently touched block not touched in this
  step (that block becomes FREE). A step whose blocks need more than P slots is refused with
  :class:`PoolTooSmall`.
- Speculative rollback needs no call: a request whose ``computed`` is below its last
  ``total`` is written again from there.
- ``plan`` checks everything before it changes anything: a refused step leaves no trace.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvarn_vllm.exact_pool import NULL_BLOCK, LostTail

__all__ = [
    "GROUP",
    "NULL_BLOCK",
    "BlockState",
    "LostTail",
    "MlaPoolManager",
    "PoolTooSmall",
    "Scheduled",
    "StepPlan",
    "mla_pool_slots_needed",
]

GROUP = 64


def _at_least_one(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}: must be at least 1, got {value}")


def mla_pool_slots_needed(
    max_num_seqs: int, max_num_batched_tokens: int, group: int = GROUP
) -> int:
    """Pool slots for an engine: one step's blocks, a live tail per request not scheduled, and
    a reserve of as many again for tails of finished requests awaiting reclaim.

    A request of q new tokens touches at most ``q // G + 2`` blocks, so a step of T tokens over
    R requests touches at most ``T // G + 2R``.
    """
    _at_least_one(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, group=group
    )
    step = max_num_batched_tokens // group + 2 * min(max_num_seqs, max_num_batched_tokens)
    return step + 2 * max_num_seqs


class PoolTooSmall(ValueError):
    """One step needs more slots than the pool has: the message names ``num_slots``."""


class BlockState(enum.Enum):
    FREE = "free"
    LIVE = "live"
    PENDING = "pending pack"
    PACKED = "packed"


class Scheduled(NamedTuple):
    """One request of the step: tokens cached before it, after it, and its block table (at
    least ``ceil(total / G)`` physical block ids; entries past those are ignored)."""

    computed: int
    total: int
    block_ids: Sequence[int]


@dataclass
class StepPlan:
    """What every layer does in one step (host-side indices).

    ``token_rows``: per new token, in request order, ``slot * G + offset`` (the ``slots`` of
    ``mla_exact_scatter``) or -1 (not stored). ``rehydrate``: ``(block, slot)`` pairs to run
    before the writes (``mla_rehydrate``). ``pack``: ``(slot, block)`` pairs to run after them
    (``mla_pack``). ``read_map``: every block the step's requests read -> its slot, or -1 to
    read its tile; blocks not listed (the null block among them) read -1.
    """

    token_rows: list[int]
    rehydrate: list[tuple[int, int]]
    pack: list[tuple[int, int]]
    read_map: dict[int, int]

    def read_map_after_pack(self) -> dict[int, int]:
        """``read_map`` with the blocks packed this step read from their (new) tiles."""
        packed = {block for _, block in self.pack}
        return {b: -1 if b in packed else s for b, s in self.read_map.items()}


class MlaPoolManager:
    """Assigns pool slots ``0 .. num_slots - 1`` to physical blocks ``1 .. num_blocks - 1``."""

    def __init__(self, num_slots: int, num_blocks: int, group: int = GROUP) -> None:
        _at_least_one(num_slots=num_slots, num_blocks=num_blocks, group=group)
        self.num_slots, self.num_blocks, self.group = num_slots, num_blocks, group
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot: OrderedDict[int, int] = OrderedDict()  # block -> slot, oldest touch first
        self._state: dict[int, BlockState] = {}  # absent = FREE
        self._rows: dict[int, int] = {}  # rows a LIVE/PENDING/PACKED block holds
        self._pending: list[int] = []  # blocks packed in the last planned step
        self.reclaimed = 0

    def state(self, block: int) -> BlockState:
        return self._state.get(block, BlockState.FREE)

    def slot_of(self, block: int) -> int:
        """The block's slot, or -1."""
        return self._slot.get(block, -1)

    def _check(self, requests: Sequence[Scheduled]) -> tuple[dict[int, int], dict[int, int]]:
        """Validate; return ``writes`` (block -> first offset written) and ``reads`` (block ->
        rows read, null block left out)."""
        g = self.group
        writes: dict[int, int] = {}
        reads: dict[int, int] = {}
        for r, (computed, total, block_ids) in enumerate(requests):
            if computed < 0:
                raise ValueError(f"computed: request {r} has {computed} cached tokens (< 0)")
            if total < computed:
                raise ValueError(f"total: request {r} ends at {total}, before computed={computed}")
            n = -(-total // g)
            blocks = [int(b) for b in block_ids[:n]]
            if len(blocks) < n:
                raise ValueError(
                    f"block_ids: request {r} holds {total} tokens, so needs {n} blocks of {g}, "
                    f"got {len(blocks)}"
                )
            real = [b for b in blocks if b != NULL_BLOCK]
            if any(not 0 <= b < self.num_blocks for b in blocks) or len(set(real)) < len(real):
                raise ValueError(
                    f"block_ids: request {r} has {blocks}; ids must be distinct (but the null "
                    f"block {NULL_BLOCK}) and in [0, {self.num_blocks})"
                )
            for i, b in enumerate(blocks):
                if b == NULL_BLOCK:
                    continue
                reads[b] = max(reads.get(b, 0), min(g, total - i * g))
                if (i + 1) * g > computed and i * g < total:
                    if b in writes:
                        raise ValueError(f"requests: block {b} is written by two requests")
                    writes[b] = max(0, computed - i * g)
        return writes, reads

    def plan(self, requests: Sequence[Scheduled]) -> StepPlan:
        """Assign slots for one step (in vLLM's request order) and return what to run.

        Raises
        ------
        ValueError
            An argument is malformed (the message names it); PoolTooSmall if the step's
            blocks need more than ``num_slots`` slots.
        LostTail
            A block is written at offset k > 0 or read without rows it should hold.
        """
        g = self.group
        writes, reads = self._check(requests)

        def now(b: int) -> BlockState:  # state once the last step's packs are settled
            st = self.state(b)
            if st is BlockState.PENDING:
                return BlockState.LIVE if b in writes else BlockState.PACKED
            return st

        for b, rows in reads.items():  # a written block needs its rows before the write offset
            st, need = now(b), writes.get(b, rows)
            have = 0 if st is BlockState.FREE else self._rows[b]
            if need > have:
                raise LostTail(
                    f"block {b} ({st.value}) holds {have} known rows but the step needs its "
                    f"first {need}: its pool slot was reclaimed (the request was not scheduled "
                    "for a long time) or the block table is stale; raise the pool size "
                    "(mla_pool_slots_needed, --max-num-seqs)"
                )
        fresh = [b for b in writes if now(b) is not BlockState.LIVE]
        held = sum(1 for b in reads if now(b) is BlockState.LIVE)
        if held + len(fresh) > self.num_slots:
            raise PoolTooSmall(
                f"num_slots: this step needs {held + len(fresh)} pool slots, the pool has "
                f"{self.num_slots}; size it with mla_pool_slots_needed(...)"
            )

        for b in self._pending:  # nothing is refused past this point
            if b in writes:
                self._state[b] = BlockState.LIVE
            else:
                self._state[b] = BlockState.PACKED
                self._free.append(self._slot.pop(b))
        self._pending = []
        rehydrate = []
        for b in fresh:
            self._slot[b] = self._take(reads)
            if writes[b] > 0:
                rehydrate.append((b, self._slot[b]))
        for b in reads:
            if b in self._slot:
                self._slot.move_to_end(b)

        token_rows: list[int] = []
        pack: list[tuple[int, int]] = []
        for computed, total, block_ids in requests:
            for p in range(computed, total):
                b = int(block_ids[p // g])
                token_rows.append(-1 if b == NULL_BLOCK else self._slot[b] * g + p % g)
            for i in range(computed // g, -(-total // g)):
                b = int(block_ids[i])
                if b == NULL_BLOCK:
                    continue
                self._rows[b] = min(g, total - i * g)
                self._state[b] = BlockState.PENDING if self._rows[b] == g else BlockState.LIVE
                if self._rows[b] == g:
                    self._pending.append(b)
                    pack.append((self._slot[b], b))
        read_map = {b: self._slot.get(b, -1) for b in reads}
        return StepPlan(token_rows, rehydrate, pack, read_map)

    def _take(self, touched: Container[int]) -> int:
        if self._free:
            return self._free.pop()
        for b in self._slot:  # least recently touched first
            if b not in touched:
                self.reclaimed += 1
                self._state.pop(b, None)
                self._rows.pop(b, None)
                return self._slot.pop(b)
        raise AssertionError("unreachable: plan() counted the slots before taking any")
