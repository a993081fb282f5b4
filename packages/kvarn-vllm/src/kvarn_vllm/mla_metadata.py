"""Per-step metadata of the kvarn MLA cache, built once per step and shared by all layers.

What every query sees (the rule of the dense backend, kvarn_vllm.metadata, so results do not
depend on how a prompt is chunked, batched or served from the prefix cache): the query at
position ``p`` attends to the dequantized tiles of the blocks that are full once ``p`` is
cached (blocks ``i < (p + 1) // 64``) and to the exact pool rows of its own block up to ``p``.

Decode gets this from ``mla_decode`` over the whole context with ``map_after`` (full blocks
read from their tiles, packed ones included, the block still filling from its pool slot).
Prefill gathers the same keys with ``mla_materialize`` (full blocks through ``map_after``, the
exact rows of the blocks the step writes through ``map_exact``) and attends with a mask.

The pool bookkeeping is kvarn_vllm.mla_pool.MlaPoolManager; vLLM's MLA builder (decodes
first, then prefills) still builds its own metadata, which the layer uses to split the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)

from kvarn_vllm import settings as kv_settings
from kvarn_vllm.mla_pool import GROUP, MlaPoolManager, Scheduled, mla_pool_slots_needed


@dataclass
class MlaPrefill:
    """One request of the step served by the prefill path."""

    tokens: slice  # rows of the step's prefill tokens (after the decode tokens)
    key_rows: slice  # rows of the step's context buffer
    mask: torch.Tensor  # bool [q_len, keys]: True = attend


@dataclass
class MlaStep:
    """Everything an MLA layer runs in one step (tensors on the cache device)."""

    token_rows: torch.Tensor  # int64 [T] pool row of each new token, -1 = not stored
    rehydrate_blocks: torch.Tensor  # int32 [N] physical blocks restored from their tiles
    rehydrate_slots: torch.Tensor  # int32 [N] pool slots they land in
    pack_slots: torch.Tensor  # int32 [M] pool slots packed after the writes
    pack_blocks: torch.Tensor  # int32 [M] physical blocks they are packed to
    map_exact: torch.Tensor  # int32 [num_blocks] read map before the step's packs
    map_after: torch.Tensor  # int32 [num_blocks] read map after them
    decode_block_table: torch.Tensor  # int32 [Bd, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [Bd]
    prefills: list[MlaPrefill] = field(default_factory=list)
    context_full_slots: torch.Tensor | None = None  # int64 [K] physical slot or -1
    context_exact_slots: torch.Tensor | None = None  # int64 [K] physical slot or -1
    # decode scratch of the step, keyed by geometry: shared by the layers, which run one after
    # another on one stream (filled by the first decode of the step)
    workspaces: dict = field(default_factory=dict, repr=False, compare=False)

    def decode_workspace(
        self, make: Callable[..., Any], batch: int, heads: int, device: torch.device
    ) -> Any:
        """The step's MLA decode workspace for ``batch`` requests of ``heads`` heads:
        ``make(batch, heads, device=device)`` on the step's first decode of that geometry,
        the same object for every later layer (one allocation a step instead of one a
        layer)."""
        key = (batch, heads, device)
        ws = self.workspaces.get(key)
        if ws is None:
            ws = self.workspaces[key] = make(batch, heads, device=device)
        return ws


def _read_map(entries: dict[int, int], num_blocks: int, device: torch.device) -> torch.Tensor:
    out = torch.full((num_blocks,), -1, dtype=torch.int32)
    if entries:
        out[torch.tensor(list(entries))] = torch.tensor(list(entries.values()), dtype=torch.int32)
    return out.to(device)


def _i32(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def plan_mla_step(
    manager: MlaPoolManager,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    num_decodes: int,
    num_blocks: int,
    device: torch.device,
) -> MlaStep:
    """Plan one step from host-side lists (the testable core of the builder).

    Parameters
    ----------
    manager : the engine's pool manager (updated).
    query_start_loc : [B + 1] offsets of each request's new tokens (decodes first).
    seq_lens : [B] tokens cached after the step.
    block_table : int32 [B, max_blocks] physical 64-token blocks (any device).
    num_decodes : the first ``num_decodes`` requests are decodes (one new token each).
    num_blocks : blocks of the cache (size of the read maps).
    """
    g = GROUP
    bt = block_table.to("cpu", torch.int32)
    requests = []
    for r in range(len(seq_lens)):
        total = int(seq_lens[r])
        q = query_start_loc[r + 1] - query_start_loc[r]
        if r < num_decodes and q != 1:
            raise ValueError(f"num_decodes: request {r} is a decode but has {q} new tokens")
        requests.append(Scheduled(total - q, total, bt[r, : -(-total // g)].tolist()))
    plan = manager.plan(requests)
    after = plan.read_map_after_pack()
    step = MlaStep(
        token_rows=torch.tensor(plan.token_rows, dtype=torch.int64, device=device),
        rehydrate_blocks=_i32([b for b, _ in plan.rehydrate], device),
        rehydrate_slots=_i32([s for _, s in plan.rehydrate], device),
        pack_slots=_i32([s for s, _ in plan.pack], device),
        pack_blocks=_i32([b for _, b in plan.pack], device),
        map_exact=_read_map(plan.read_map, num_blocks, device),
        map_after=_read_map(after, num_blocks, device),
        decode_block_table=block_table[:num_decodes].to(device, torch.int32),
        decode_seq_lens=_i32(seq_lens[:num_decodes], device),
    )
    first_prefill_token = query_start_loc[num_decodes]
    full_slots: list[torch.Tensor] = []
    exact_slots: list[torch.Tensor] = []
    ctx = 0
    for r in range(num_decodes, len(seq_lens)):
        computed, total, blocks = requests[r]
        if total <= computed:
            continue
        n_full = total // g
        touched = list(range(computed // g, (total - 1) // g + 1))
        blk = torch.tensor(blocks, dtype=torch.int64)
        full_pos = torch.arange(n_full * g)
        ex_pos = torch.cat([torch.arange(j * g, (j + 1) * g) for j in touched])
        ex_phys = blk[ex_pos // g] * g + ex_pos % g
        full_slots += [blk[full_pos // g] * g + full_pos % g, torch.full_like(ex_pos, -1)]
        exact_slots += [torch.full_like(full_pos, -1), torch.where(ex_pos < total, ex_phys, -1)]
        q_pos = torch.arange(computed, total)
        visible = (q_pos + 1) // g  # blocks full (and read from tiles) once p is cached
        mask_full = (full_pos // g)[None, :] < visible[:, None]
        mask_ex = (
            (ex_pos[None, :] // g == q_pos[:, None] // g)
            & (ex_pos[None, :] <= q_pos[:, None])
            & (visible[:, None] == q_pos[:, None] // g)
        )
        keys = full_pos.numel() + ex_pos.numel()
        start = query_start_loc[r] - first_prefill_token
        step.prefills.append(
            MlaPrefill(
                tokens=slice(start, start + total - computed),
                key_rows=slice(ctx, ctx + keys),
                mask=torch.cat([mask_full, mask_ex], dim=1).to(device),
            )
        )
        ctx += keys
    if step.prefills:
        step.context_full_slots = torch.cat(full_slots).to(device)
        step.context_exact_slots = torch.cat(exact_slots).to(device)
    return step


@dataclass
class KvarnMlaMetadata(MLACommonMetadata):
    """vLLM's MLA metadata plus the kvarn step (None only while profiling)."""

    kvarn: MlaStep | None = None


class KvarnMlaMetadataBuilder(MLACommonMetadataBuilder[KvarnMlaMetadata]):
    """vLLM's MLA builder, plus one :class:`MlaStep` per step from the pool manager."""

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(
            kv_cache_spec, layer_names, vllm_config, device, metadata_cls=KvarnMlaMetadata
        )
        self.settings = kv_settings.active()
        sched = vllm_config.scheduler_config
        self.num_slots = mla_pool_slots_needed(sched.max_num_seqs, sched.max_num_batched_tokens)
        self._manager: MlaPoolManager | None = None

    def _pool_manager(self) -> MlaPoolManager:
        """The engine's pool manager, made at the first step (when vLLM knows the number of
        cache blocks)."""
        if self._manager is None:
            cache = self.vllm_config.cache_config
            num_blocks = cache.num_gpu_blocks or getattr(cache, "num_cpu_blocks", None)
            if not num_blocks:
                raise RuntimeError("kvarn MLA: the number of KV-cache blocks is not known yet")
            self._manager = MlaPoolManager(self.num_slots, int(num_blocks))
        return self._manager

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> KvarnMlaMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        cam = common_attn_metadata
        seq_lens = cam.seq_lens_cpu_upper_bound
        if seq_lens is None:
            seq_lens = cam.seq_lens.cpu()
        bt = cam.block_table_tensor[: cam.num_reqs]
        manager = self._pool_manager()
        md.kvarn = plan_mla_step(
            manager,
            cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist(),
            seq_lens[: cam.num_reqs].tolist(),
            bt,
            md.num_decodes,
            manager.num_blocks,
            self.device,
        )
        return md
