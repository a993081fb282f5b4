"""Synchronization between the programs of one split tile (Triton helpers).

A decode step packs a few tiles per layer, so a launch may give each tile several programs
(``flush.parts_for``, ``mla_pack_split.parts_for``). The dense flush uses :func:`fence` for
its last program's count; the split MLA pack has each program hold a slice of the tile's rows
and normalize it together with the others (``flush_math.normalize_split``). Their column
statistics meet in the tile's fp32 scratch: every program publishes its partials in an
exchange slot, counts itself in on the tile's counter and waits until every program of the
tile has done the same (:func:`exchange`). All programs then read every partial, in part
order, so all of them combine the same numbers in the same order and agree on every column
statistic bit for bit.

Waiting on other programs needs them all resident at once: the launcher splits tiles only
while the launch fits one program per SM. The CPU interpreter runs programs one after
another, so there (``EMU``) one program computes every part's partials itself from the whole
tile, publishes them all and reads them back: the same slots, the same combination.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["exchange", "fence", "load_acquire", "partials"]


@triton.jit
def fence(x, ASM: tl.constexpr):
    """``fence.acq_rel.gpu`` in every thread (compiled only; the interpreter runs programs one
    after another). ``x``: any int32 scalar, passed through so the asm has an operand."""
    if ASM:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;",
            "=r,r",
            [x],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def load_acquire(ptr):
    """``ld.acquire.gpu`` of the int32 at ``ptr`` in every thread (compiled only)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l",
        [ptr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def partials(u, RP: tl.constexpr, C: tl.constexpr, PARTS: tl.constexpr, EMU: tl.constexpr):
    """Column partials of this program's rows ``u``: sums and sums of squared deviations from
    the slice's own column means, ``[C]`` each, or ``[PARTS, C]`` (every part's ``RP``-row
    slice) when ``EMU`` (``u`` then holds the whole tile)."""
    if EMU:
        u3 = tl.reshape(u, [PARTS, RP, C])
        s1 = tl.sum(u3, axis=1)
        dev = u3 - (s1 / RP)[:, None, :]
        return s1, tl.sum(dev * dev, axis=1)
    else:
        s1 = tl.sum(u, axis=0)
        dev = u - (s1 / RP)[None, :]
        return s1, tl.sum(dev * dev, axis=0)


@triton.jit
def exchange(
    scr,
    cnt,
    slot,
    part,
    a,
    b,
    c,
    NV: tl.constexpr,
    N: tl.constexpr,
    PARTS: tl.constexpr,
    EMU: tl.constexpr,
):
    """Publish this part's partials ``a, b`` and, if ``NV == 3``, ``c`` (``[N]`` fp32 each;
    ``[PARTS, N]``, every part's, when ``EMU``) in exchange slot ``slot`` of the scratch
    ``scr``, wait for the other parts, and return every part's: three ``[PARTS, N]`` tensors
    in part order (the third is ``a``'s again when ``NV == 2``).

    Slots are never reused within a launch, so a part that runs ahead cannot overwrite what a
    slower one still reads. The counter ``cnt`` (zero at launch) counts arrivals over all
    slots: slot ``k`` is complete at ``(k + 1) * PARTS``. Release: every thread's stores, a
    barrier, then one thread's release increment (cumulative: it orders the stores the
    barrier made visible to it, the pattern of a cooperative grid barrier). Acquire: every
    thread polls the counter with acquire loads; the partials are then read from L2
    (``.cg``), never from a stale L1 line. On the H200 one exchange costs 1.1-2.6 us
    (``benchmarks/probe_exchange.py``)."""
    p = tl.arange(0, PARTS)
    n = tl.arange(0, N)
    base = scr + slot * (PARTS * 3 * N)
    offs = p[:, None] * (3 * N) + n[None, :]
    if EMU:
        tl.store(base + offs, a)
        tl.store(base + offs + N, b)
        if NV == 3:
            tl.store(base + offs + 2 * N, c)
        tl.debug_barrier()
    else:
        mine = base + part * (3 * N) + n
        tl.store(mine, a)
        tl.store(mine + N, b)
        if NV == 3:
            tl.store(mine + 2 * N, c)
        tl.debug_barrier()
        tl.atomic_add(cnt, 1, sem="release", scope="gpu")
        target = (slot + 1) * PARTS
        seen = load_acquire(cnt)
        while seen < target:
            seen = load_acquire(cnt)
    ga = tl.load(base + offs, cache_modifier=".cg")
    gb = tl.load(base + offs + N, cache_modifier=".cg")
    gc = ga
    if NV == 3:
        gc = tl.load(base + offs + 2 * N, cache_modifier=".cg")
    return ga, gb, gc
