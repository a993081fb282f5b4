"""The attention impl and metadata builder of the dense KVarN cache.

Per layer and step: store the new K/V into the exact pool, pack the blocks that filled, then
attend (decode and speculative verify through ``decode``; every other request through
``materialize`` + masked attention, see kvarn_vllm.metadata for the rule both follow). The
ops come from kvarn_ops, chosen by kvarn_vllm.kernel_choice; nothing here is a kernel.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

import kvarn_formats as kf
from kvarn_ops.reference import MAX_QUERY_TOKENS
from kvarn_vllm import gates
from kvarn_vllm import settings as kv_settings
from kvarn_vllm.exact_pool import ExactPoolAllocator, pool_blocks_needed
from kvarn_vllm.kernel_choice import DecodeGeometry, OpSet, choose_kernel, log_choice_once
from kvarn_vllm.metadata import (
    DecodeBatch,
    KvarnMetadata,
    decode_route_note,
    decode_token_limit,
    plan_step,
)

logger = logging.getLogger("vllm.kvarn")

POOL_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}


def max_query_len(vllm_config: Any) -> int:
    """Query tokens of the longest run that goes through ``decode``: 1, or 1 + the speculative
    tokens of a verify run (runs longer than kvarn_ops' limit take the prefill path)."""
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    return min(1 + drafts, MAX_QUERY_TOKENS)


def model_gqa(vllm_config: Any) -> int:
    """Query heads per KV head of the model on this worker (vLLM's ``ModelConfig`` with the
    parallel config); 1 for a config without those methods (hand-made test configs)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    heads = getattr(mc, "get_num_attention_heads", None)
    kv_heads = getattr(mc, "get_num_kv_heads", None)
    if heads is None or kv_heads is None:
        return 1
    return max(1, int(heads(pc)) // max(1, int(kv_heads(pc))))


def pool_size(vllm_config: Any, group: int) -> int:
    """Exact-pool blocks per layer for an engine config (kvarn_vllm.exact_pool)."""
    sched = vllm_config.scheduler_config
    return pool_blocks_needed(sched.max_num_seqs, sched.max_num_batched_tokens, group)


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    """Plans the exact pool once per step for every layer of the KV-cache group."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings = kv_settings.active()
        group = self.settings.group
        assert group is not None
        self.group = group
        # Verify runs can fill a block with drafts that are then rejected: keep packed blocks'
        # exact rows for the continuation (kvarn_vllm.exact_pool).
        speculative = getattr(vllm_config, "speculative_config", None) is not None
        self.allocator = ExactPoolAllocator(pool_size(vllm_config, group), keep_packed=speculative)
        # runs with more query rows per KV head than a decode program holds take the prefill
        # path (GQA 8: T <= 4, GQA 16: T <= 2)
        gqa = model_gqa(vllm_config)
        self.max_decode_tokens = decode_token_limit(gqa)
        note = decode_route_note(gqa, max_query_len(vllm_config) - 1)
        if note is not None:
            logger.warning("kvarn: %s", note)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KvarnMetadata:
        cam = common_attn_metadata
        seq_lens = cam.seq_lens_cpu_upper_bound
        if seq_lens is None:
            seq_lens = cam.seq_lens.cpu()
        return plan_step(
            self.allocator,
            self.group,
            cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist(),
            seq_lens[: cam.num_reqs].tolist(),
            cam.block_table_tensor[: cam.num_reqs],
            cam.num_actual_tokens,
            self.device,
            self.max_decode_tokens,
        )


class KvarnAttentionImpl(AttentionImpl[KvarnMetadata]):
    """Dense self-attention over a KVarN-packed paged cache plus an exact pool."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        vllm_config = get_current_vllm_config()
        self.settings = kv_settings.active()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        reasons = gates.layer_problems(
            self.settings,
            head_size=head_size,
            dtype=vllm_config.model_config.dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=vllm_config.cache_config.block_size,
            attn_type=str(getattr(attn_type, "value", attn_type)),
            has_sliding_window=sliding_window is not None,
            has_sink=extra.get("sinks") is not None,
            has_alibi=alibi_slopes is not None,
        )
        reasons += gates.engine_problems(self.settings, vllm_config)
        if logits_soft_cap:
            reasons.append("logits soft-capping (model) not supported")
        if kv_sharing_target_layer_name is not None:
            reasons.append("cross-layer KV sharing (model) not supported")
        if reasons:
            raise gates.ConfigurationRejected(reasons)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.layout = self.settings.layout(head_size)
        group = self.layout.block_size
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        fmt = kf.parse_format(self.settings.format_name)
        assert isinstance(fmt, kf.DenseFormat)
        geometry = DecodeGeometry(
            k_bits=fmt.k_bits,
            v_bits=fmt.v_bits,
            group=group,
            head_dim=head_size,
            gqa=num_heads // num_kv_heads,
            q_dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
            pool_dtype=self.settings.pool_dtype,
            max_query_len=max_query_len(vllm_config),
        )
        choice = choose_kernel(device.type, device.index or 0, geometry=geometry)
        log_choice_once(choice, str(device))
        self.ops = OpSet(choice)
        # The exact pool is allocated here, while the model is built, so that vLLM's memory
        # profiling counts it before the KV cache is sized.
        pool_dtype = POOL_TORCH_DTYPES[self.settings.pool_dtype]
        shape = (pool_size(vllm_config, group), group, num_kv_heads, head_size)
        self.exact_k = torch.zeros(shape, dtype=pool_dtype, device=device)
        self.exact_v = torch.zeros(shape, dtype=pool_dtype, device=device)
        self.k_scale = self.v_scale = None
        if pool_dtype == torch.float8_e4m3fn:
            self.k_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
        self._workspace: torch.Tensor | None = None

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Nothing: ``forward`` stores, packs and attends (the pool slots come from the
        step's metadata, not from vLLM's slot mapping)."""

    def packed_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as uint8 ``[num_blocks, Hkv, R]`` (no copy)."""
        raw = kv_cache.view(torch.uint8)
        num_blocks = raw.shape[0]
        packed = raw.view(num_blocks, self.num_kv_heads, self.layout.record_bytes)
        return packed

    def _context_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvarnMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        md = attn_metadata
        if md is None:  # profiling run
            return output
        ops, lay = self.ops, self.layout
        n = md.num_actual_tokens
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:n].reshape(n, hq, d)
        # q/k/v are views into the fused QKV projection: store reads the token rows where
        # they are (each token's [Hkv, D] packed, tokens at the projection's stride).
        k = key[:n].reshape(n, hkv, d)
        v = value[:n].reshape(n, hkv, d)
        if not ops.strided_store:
            k, v = k.contiguous(), v.contiguous()
        out = output[:n].view(n, hq, d)
        packed = self.packed_view(kv_cache)
        pools = (self.exact_k, self.exact_v, self.k_scale, self.v_scale)
        ops.store(k, v, md.pool_slots, *pools)
        if md.flush_src.numel():
            if ops.flush_sink_rows and md.flush_sink is not None:
                ops.flush(*pools, md.flush_src, md.flush_dst, packed, lay, sink_rows=md.flush_sink)
            else:
                ops.flush(*pools, md.flush_src, md.flush_dst, packed, lay)
        for batch in md.decodes:
            bd = batch.seq_lens.shape[0]
            qd = q[batch.tokens].reshape(bd, batch.t, hq, d).contiguous()
            # consecutive rows (every decode-only step): decode writes the output in place
            direct = isinstance(batch.tokens, slice) and out.dtype == qd.dtype
            od = out[batch.tokens].view(bd, batch.t, hq, d) if direct else torch.empty_like(qd)
            ops.decode(
                qd,
                packed,
                batch.block_table,
                batch.seq_lens,
                *pools,
                batch.tail,
                lay,
                self.scale,
                od,
                self._decode_workspace(batch, qd),
            )
            if not direct:
                out[batch.tokens] = od.view(bd * batch.t, hq, d)
        if md.prefills:
            self._prefill(q, out, packed, md)
        return output

    def _decode_workspace(self, batch: DecodeBatch, qd: torch.Tensor) -> torch.Tensor | None:
        if self.ops.decode_workspace is None:
            return None
        # Sized for this step (the Triton path is not captured in CUDA graphs by this release)
        # and allocated once per step: every layer's decode and combine finish, in stream
        # order, before the next layer's decode starts.
        key = (qd.shape, self.num_kv_heads, self.head_size, self.layout.block_size, qd.device)
        ws = batch.workspaces.get(key)
        if ws is None:
            ws = batch.workspaces[key] = self.ops.decode_workspace(
                qd.shape[0],
                batch.t,
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                max(batch.max_seq_len, 1),
                self.layout.block_size,
                device=qd.device,
            )
        return ws

    def _prefill(
        self, q: torch.Tensor, out: torch.Tensor, packed: torch.Tensor, md: KvarnMetadata
    ) -> None:
        assert md.full_block_table is not None and md.full_seq_lens is not None
        assert md.full_cu is not None and md.exact_tail is not None
        assert md.exact_seq_lens is not None and md.exact_cu is not None
        hkv, d = self.num_kv_heads, self.head_size
        cdt = self._context_dtype(q.dtype)
        k_ctx = torch.zeros(md.context_rows, hkv, d, dtype=cdt, device=q.device)
        v_ctx = torch.zeros_like(k_ctx)
        pools = (self.exact_k, self.exact_v, self.k_scale, self.v_scale)
        ops = self.ops
        ops.materialize(
            packed,
            md.full_block_table,
            md.full_seq_lens,
            *pools,
            torch.zeros_like(md.full_seq_lens),
            self.layout,
            k_ctx,
            v_ctx,
            md.full_cu,
        )
        ex_bt = torch.zeros(md.exact_tail.shape[0], 1, dtype=torch.int32, device=q.device)
        ops.materialize(
            packed,
            ex_bt,
            md.exact_seq_lens,
            *pools,
            md.exact_tail,
            self.layout,
            k_ctx,
            v_ctx,
            md.exact_cu,
        )
        grp = self.num_heads // hkv
        for req in md.prefills:
            qr = q[req.tokens].transpose(0, 1).float()  # [Hq, q, D]
            kr = k_ctx[req.key_rows].float().repeat_interleave(grp, dim=1).transpose(0, 1)
            vr = v_ctx[req.key_rows].float().repeat_interleave(grp, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=req.mask, scale=self.scale)
            out[req.tokens] = o.transpose(0, 1).to(out.dtype)
