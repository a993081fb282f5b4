"""Build a random paged KVarN cache on the GPU with the reference ops (the oracle's own cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gpu_support import DEVICE, realistic_kv

import kvarn_formats as kf
from kvarn_ops import reference


@dataclass
class PagedCache:
    layout: kf.RecordLayout
    packed: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    exact_k: torch.Tensor
    exact_v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    tail_pool_block: torch.Tensor

    def args(self) -> tuple:
        return (
            self.packed,
            self.block_table,
            self.seq_lens,
            self.exact_k,
            self.exact_v,
            self.k_scale,
            self.v_scale,
            self.tail_pool_block,
            self.layout,
        )


def build_cache(
    gen: torch.Generator,
    fmt: str,
    head_dim: int,
    num_kv_heads: int,
    seq_lens: list[int],
    pool_dtype: torch.dtype = torch.bfloat16,
    spare_blocks: int = 3,
) -> PagedCache:
    """Every request's full blocks packed (through a flush of its own exact tokens), its
    partial block in the exact pool; physical blocks and pool blocks shuffled."""
    layout = kf.dense_layout(fmt, head_dim)
    g = layout.block_size
    b = len(seq_lens)
    n_full = [n // g for n in seq_lens]
    max_blocks = max(1, max(-(-n // g) for n in seq_lens))
    num_blocks = sum(n_full) + spare_blocks
    # Pool: one tail block per request, spares, then staging blocks that full blocks pass
    # through on their way to being packed.
    staging = max(n_full) if n_full else 0
    pool_blocks = b + spare_blocks + staging
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    pool_perm = torch.randperm(b + spare_blocks, generator=gen, device=DEVICE).to(torch.int32)

    packed = torch.randint(
        0,
        256,
        (num_blocks, num_kv_heads, layout.record_bytes),
        generator=gen,
        device=DEVICE,
        dtype=torch.uint8,
    )
    shape = (pool_blocks, g, num_kv_heads, head_dim)
    exact_k = torch.empty(shape, dtype=pool_dtype, device=DEVICE)
    exact_v = torch.empty(shape, dtype=pool_dtype, device=DEVICE)
    fp8 = pool_dtype == torch.float8_e4m3fn
    k_scale = torch.ones(shape[:3], device=DEVICE) if fp8 else None
    v_scale = torch.ones(shape[:3], device=DEVICE) if fp8 else None
    # Unused table entries point at a real block, as a serving engine's padding would.
    block_table = torch.full((b, max_blocks), int(perm[0]), dtype=torch.int32, device=DEVICE)
    tail = pool_perm[:b].contiguous()

    used = 0
    for r, length in enumerate(seq_lens):
        k = realistic_kv(gen, (length, num_kv_heads, head_dim))
        v = realistic_kv(gen, (length, num_kv_heads, head_dim))
        nf = n_full[r]
        if nf:
            src = torch.arange(
                b + spare_blocks, b + spare_blocks + nf, dtype=torch.int32, device=DEVICE
            )
            dst = perm[used : used + nf].contiguous()
            used += nf
            block_table[r, :nf] = dst
            slots = src.to(torch.int64).repeat_interleave(g) * g + torch.arange(
                g, device=DEVICE
            ).repeat(nf)
            reference.store(k[: nf * g], v[: nf * g], slots, exact_k, exact_v, k_scale, v_scale)
            reference.flush(exact_k, exact_v, k_scale, v_scale, src, dst, packed, layout)
        rest = length - nf * g
        if rest:
            slots = tail[r].to(torch.int64) * g + torch.arange(rest, device=DEVICE)
            reference.store(k[nf * g :], v[nf * g :], slots, exact_k, exact_v, k_scale, v_scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return PagedCache(layout, packed, block_table, lens, exact_k, exact_v, k_scale, v_scale, tail)
