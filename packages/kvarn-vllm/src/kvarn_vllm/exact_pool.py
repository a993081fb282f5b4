"""Which physical cache block owns which exact-pool block (host-side bookkeeping, no torch).

A block still filling keeps its tokens exact in a side pool until it holds G tokens, then it
is packed into its record ("flush") and its pool block is released. The pool is shared by all
layers (each layer has its own pool tensors, indexed the same way) and is assigned once per
step by the metadata builder.

Rules (the physical block id is the key: vLLM never gives a partial block to two live
requests, and only full blocks are shared by prefix caching):

- A block written from offset 0 gets a pool block (its own previous one if it still has one).
- A block written at offset > 0 must already own one; if not, the step is refused (never read
  another block's rows).
- A block that becomes full in a step is packed in that step; its pool block is released at
  the start of the next step (the step's layers still read it). With speculative decoding
  (``keep_packed``) a verify step can fill a block with draft tokens that are then rejected,
  and the request continues inside that block: so the pool block of a packed block is kept
  instead, first in line to be reclaimed. A block written again is packed again when it fills,
  so its record always holds the accepted tokens once they fill it.
- The null block (id 0, vLLM's padding block) never owns a pool block; writes to it go
  nowhere and reads of it come from a reserved scratch pool block.
- Pool blocks of finished requests are not announced by vLLM to attention backends. They are
  reclaimed lazily: when the pool runs out, the pool block untouched for the longest time and
  not touched in this step is taken back. If the request it belonged to is in fact alive
  (scheduled again after a long pause), its next step is refused by the rule above, loudly.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

NULL_BLOCK = 0


def pool_blocks_needed(max_num_seqs: int, max_num_batched_tokens: int, group: int) -> int:
    """Pool blocks one layer needs: the transient blocks of one step, the live tails, a
    reserve of as many again for tails of finished requests, and one scratch block.

    A step of T tokens over R requests touches at most ``T // G + 2R`` blocks; requests not
    scheduled in the step hold at most ``max_num_seqs - R`` partial tails.
    """
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("group", group),
    ):
        n = _index(value)
        if n is None or n < 1:
            raise ValueError(f"{name}: must be at least 1, got {value!r}")
    transient = -(-max_num_batched_tokens // group) + max_num_seqs
    return transient + 2 * max_num_seqs + 1


def _index(value: Any) -> int | None:
    """``value`` as an int when it is an integer (bool excluded), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_requests(requests: list[tuple[int, int, list[int]]], group: int) -> None:
    """The scheduler's step as :meth:`ExactPoolAllocator.plan` reads it, checked before any
    bookkeeping changes: a block written by two requests (or twice by one) would share a pool
    block, and a short or negative block list would read another block's rows."""
    g = _index(group)
    if g is None or g < 1:
        raise ValueError(f"group: must be at least 1, got {group!r}")
    written: dict[int, int] = {}
    for r, req in enumerate(requests):
        computed, total, blocks = req
        for name, value in (("computed", computed), ("total", total)):
            n = _index(value)
            if n is None or n < 0:
                raise ValueError(f"requests[{r}]: {name} must be an integer >= 0, got {value!r}")
        if total < computed:
            raise ValueError(
                f"requests[{r}]: total ({total}) below computed ({computed}): tokens are only "
                "added in a step"
            )
        need = -(-total // group)
        if len(blocks) < need:
            raise ValueError(
                f"requests[{r}]: {len(blocks)} block ids for {total} tokens; need {need}"
            )
        if total == computed:
            continue  # nothing written
        for i in range(computed // group, need):
            physical = _index(blocks[i])
            if physical is None or physical < 0:
                raise ValueError(f"requests[{r}]: block id {blocks[i]!r} is not an id >= 0")
            if physical == NULL_BLOCK:
                continue
            if physical in written:
                raise ValueError(
                    f"requests[{r}]: block {physical} is written twice in one step (also by "
                    f"request {written[physical]}); a partial block belongs to one request"
                )
            written[physical] = r


class PoolExhausted(RuntimeError):
    """No pool block is free, even after reclaiming: the message names the setting."""


class LostTail(RuntimeError):
    """A partial block has no pool block (it was reclaimed): refused rather than misread."""


@dataclass
class StepPlan:
    """What the layers do in one step, all indices host-side.

    ``pool_of`` maps each touched physical block to its pool block; ``flush`` lists
    ``(pool_block, physical_block)`` pairs to pack after the new tokens are stored, and
    ``flush_first`` says for each whether it is its request's first block (its token 0 is the
    sequence's first token, the attention sink).
    """

    pool_of: dict[int, int]
    flush: list[tuple[int, int]]
    flush_first: list[bool] = field(default_factory=list)


class ExactPoolAllocator:
    """Assigns pool blocks ``0 .. size - 2`` to physical blocks; ``size - 1`` is scratch."""

    def __init__(self, size: int, keep_packed: bool = False) -> None:
        if size < 2:
            raise ValueError(f"size: the pool needs at least 2 blocks, got {size}")
        self.size = size
        self.scratch = size - 1
        self._free = list(range(size - 2, -1, -1))  # pop() hands out 0 first
        self._owner: dict[int, int] = {}  # physical block -> pool block
        self._last_touch: OrderedDict[int, int] = OrderedDict()  # physical -> step, LRU order
        self._release_next: list[int] = []  # physical blocks packed in the previous step
        self.keep_packed = keep_packed
        self._packed: OrderedDict[int, None] = OrderedDict()  # packed, pool block kept
        self._step = 0
        self.reclaimed = 0

    @property
    def kept_packed(self) -> list[int]:
        """Packed physical blocks whose pool block is kept for a rollback, oldest first."""
        return list(self._packed)

    @property
    def owned(self) -> dict[int, int]:
        """A copy of the physical -> pool block map (tests)."""
        return dict(self._owner)

    def _release(self, physical: int) -> None:
        pool = self._owner.pop(physical, None)
        self._last_touch.pop(physical, None)
        self._packed.pop(physical, None)
        if pool is not None:
            self._free.append(pool)

    def _take(self, touched: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for physical in self._packed:  # packed blocks kept for a rollback, oldest first
            if physical not in touched:
                self._release(physical)
                return self._free.pop()
        for physical in self._last_touch:  # oldest first
            if physical not in touched:
                self.reclaimed += 1
                self._release(physical)
                return self._free.pop()
        raise PoolExhausted(
            f"the exact pool ({self.size - 1} blocks) is full with blocks of this step; raise "
            "--max-num-seqs's headroom or lower --max-num-batched-tokens"
        )

    def plan(self, requests: list[tuple[int, int, list[int]]], group: int) -> StepPlan:
        """Assign pool blocks for one step.

        Parameters
        ----------
        requests : list of ``(computed, total, block_ids)``: tokens already cached before the
            step, tokens cached after it, and the request's physical block ids (at least
            ``ceil(total / G)`` of them).
        group : G, tokens per block.

        Raises
        ------
        ValueError
            A malformed step (see :func:`_check_requests`), before anything changes.
        LostTail
            A block continued at offset > 0 owns no pool block.
        PoolExhausted
            No pool block can be freed.
        """
        _check_requests(requests, group)
        for physical in self._release_next:
            if self.keep_packed and physical in self._owner:
                self._last_touch.pop(physical, None)
                self._packed[physical] = None
            else:
                self._release(physical)
        self._release_next = []
        self._step += 1
        touched_ids: set[int] = set()
        for computed, total, blocks in requests:
            for i in range(computed // group, -(-total // group)):
                touched_ids.add(blocks[i])
        pool_of: dict[int, int] = {}
        flush: list[tuple[int, int]] = []
        flush_first: list[bool] = []
        for computed, total, blocks in requests:
            if total <= computed:
                continue
            first, last = computed // group, (total - 1) // group
            for i in range(first, last + 1):
                physical = blocks[i]
                if physical == NULL_BLOCK:
                    pool_of[physical] = self.scratch
                    continue
                starts_fresh = i > first or computed % group == 0
                if physical not in self._owner:
                    if not starts_fresh:
                        raise LostTail(
                            f"block {physical} continues at offset {computed % group} but its "
                            "exact rows were reclaimed (the request was not scheduled for a long "
                            "time); raise --max-num-seqs so the pool keeps more tails"
                        )
                    self._owner[physical] = self._take(touched_ids)
                pool_of[physical] = self._owner[physical]
                self._packed.pop(physical, None)  # written again: a live block
                self._last_touch[physical] = self._step
                self._last_touch.move_to_end(physical)
                if (i + 1) * group <= total:
                    flush.append((self._owner[physical], physical))
                    flush_first.append(i == 0)
                    self._release_next.append(physical)
        return StepPlan(pool_of=pool_of, flush=flush, flush_first=flush_first)
