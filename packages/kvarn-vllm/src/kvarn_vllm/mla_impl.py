"""The MLA attention impl of the KVarN latent cache (``kvarn_mla_k{2,4,5}_g64``).

Per layer and step (kvarn_vllm.mla_metadata.MlaStep says what):

1. ``do_kv_cache_update``: rehydrate blocks re-entering the pool, scatter the new tokens'
   latents (rotated by H_512) and RoPE into the exact pool, pack the blocks that filled.
2. decode tokens (``forward_mqa``): ``mla_decode`` over the whole context with absorbed
   queries, full blocks read from their tiles, the block still filling from the pool.
3. prefill tokens (``forward_mha``): ``mla_materialize`` gathers each request's keys (tiles of
   full blocks, exact rows of its own blocks), vLLM's ``kv_b_proj`` up-projects them as in its
   MLA prefill, then masked attention (kvarn_vllm.mla_metadata gives the mask).

Everything else (q projections, weight absorption, output up-projection) is vLLM's MLA layer.
The exact pool is allocated here, while the model is built, so vLLM's memory profiling counts
it before the KV cache is sized. The ops come from kvarn_ops (kvarn_vllm.mla_ops); nothing here
is a kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

import kvarn_formats as kf
from kvarn_vllm import gates, mla_gates
from kvarn_vllm import settings as kv_settings
from kvarn_vllm.kernel_choice import choose_kernel
from kvarn_vllm.mla_metadata import KvarnMlaMetadata, MlaStep
from kvarn_vllm.mla_ops import MlaOpSet
from kvarn_vllm.mla_pool import GROUP, mla_pool_slots_needed

POOL_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class KvarnMlaImpl(CPUMLAImpl):
    """MLA over KVarN-packed latent tiles plus an exact pool (vLLM's MLA layer around it)."""

    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args: Any,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        vllm_config = get_current_vllm_config()
        self.vllm_config = vllm_config
        self.settings = kv_settings.active()
        reasons = mla_gates.mla_layer_problems(
            self.settings,
            head_size=head_size,
            dtype=vllm_config.model_config.dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=vllm_config.cache_config.block_size,
        )
        reasons += mla_gates.mla_geometry_problems(self.kv_lora_rank, self.qk_rope_head_dim)
        reasons += mla_gates.mla_engine_problems(self.settings, vllm_config)
        if reasons:
            raise gates.ConfigurationRejected(reasons)
        self.layout = kf.mla_layout(self.settings.format_name)
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.ops = MlaOpSet(choose_kernel(device.type, device.index or 0), str(device))
        sched = vllm_config.scheduler_config
        slots = mla_pool_slots_needed(sched.max_num_seqs, sched.max_num_batched_tokens)
        latent_dtype = POOL_TORCH_DTYPES[mla_gates.mla_pool_dtype(self.settings)]
        self.pool_latent = torch.zeros(
            slots, GROUP, mla_gates.LATENT_DIM, dtype=latent_dtype, device=device
        )
        self.pool_rope = torch.zeros(
            slots, GROUP, mla_gates.ROPE_DIM, dtype=torch.bfloat16, device=device
        )
        self.pool_scale = None
        if latent_dtype == torch.float8_e4m3fn:
            self.pool_scale = torch.ones(slots, GROUP, dtype=torch.float32, device=device)
        self._layer_name: str | None = None

    # ------------------------------------------------------------------------------------------
    # helpers

    @property
    def pools(self) -> tuple[Any, Any, Any]:
        """``(pool_latent, pool_scale, pool_rope)`` in the argument order of the MLA ops."""
        return self.pool_latent, self.pool_scale, self.pool_rope

    def packed_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as uint8 ``[num_blocks, R]`` (no copy)."""
        raw = kv_cache.view(torch.uint8)
        return raw.view(raw.shape[0], self.layout.record_bytes)

    def _step(self) -> MlaStep | None:
        """This step's kvarn plan, from the forward context (None while profiling)."""
        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            md = md[0]
        if isinstance(md, dict):
            if self._layer_name is None:
                ctx = self.vllm_config.compilation_config.static_forward_context
                names = [n for n, m in ctx.items() if getattr(m, "impl", None) is self]
                if len(names) != 1:
                    raise RuntimeError("kvarn MLA: this impl is not one registered layer's impl")
                self._layer_name = names[0]
            md = md.get(self._layer_name)
        return md.kvarn if isinstance(md, KvarnMlaMetadata) else None

    # ------------------------------------------------------------------------------------------
    # the three entry points of vLLM's MLA layer

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        """Rehydrate, scatter the new tokens into the pool, pack the blocks that filled (the
        pool rows come from the step's plan, not from vLLM's slot mapping)."""
        if kv_cache.numel() == 0:
            return
        step = self._step()
        if step is None:
            return
        ops, lay = self.ops, self.layout
        packed = self.packed_view(kv_cache)
        lat, scale, rope = self.pools
        if step.rehydrate_blocks.numel():
            ops.mla_rehydrate(
                packed, step.rehydrate_blocks, step.rehydrate_slots, lat, scale, rope, lay
            )
        n = step.token_rows.shape[0]
        latent = kv_c_normed[:n].contiguous()
        rope_new = k_pe[:n].reshape(n, mla_gates.ROPE_DIM).contiguous()
        ops.mla_exact_scatter(latent, rope_new, step.token_rows, lat, rope, scale)
        if step.pack_slots.numel():
            ops.mla_pack(lat, scale, rope, step.pack_slots, step.pack_blocks, packed, lay)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode: absorbed queries ``[B, H, 576]`` -> latent outputs ``[B, H, 512]``."""
        step = attn_metadata.kvarn
        assert step is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        q = q.contiguous()
        b, h, _ = q.shape
        out = torch.empty(b, h, self.kv_lora_rank, dtype=q.dtype, device=q.device)
        workspace = None
        if self.ops.name != "reference":
            workspace = step.decode_workspace(self.ops.mla_decode_workspace, b, h, q.device)
        self.ops.mla_decode(
            q,
            self.packed_view(kv_c_and_k_pe_cache),
            step.decode_block_table,
            step.decode_seq_lens,
            step.map_after,
            *self.pools,
            self.layout,
            self.scale,
            out,
            workspace,
        )
        return out, None

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """Prefill: each request's keys gathered from the cache, up-projected by ``kv_b_proj``
        and attended with the step's mask (new tokens are read back from the pool, like every
        other exact row, so a prompt gives the same result however it is split)."""
        if output_scale is not None:
            raise NotImplementedError("kvarn MLA: fused output quantization is not supported")
        step = attn_metadata.kvarn
        assert step is not None and step.context_full_slots is not None
        assert step.context_exact_slots is not None
        packed = self.packed_view(kv_c_and_k_pe_cache)
        keys = step.context_full_slots.shape[0]
        ctx = torch.zeros(keys, mla_gates.MLA_HEAD_SIZE, dtype=torch.bfloat16, device=q.device)
        self.ops.mla_materialize(
            packed, step.map_after, *self.pools, step.context_full_slots, self.layout, ctx
        )
        self.ops.mla_materialize(
            packed, step.map_exact, *self.pools, step.context_exact_slots, self.layout, ctx
        )
        dtype = kv_c_normed.dtype
        latent = ctx[:, : self.kv_lora_rank].to(dtype)
        kv_nope = self.kv_b_proj(latent)[0].view(
            -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = self._concat_k_nope_k_pe(k_nope, ctx[:, None, self.kv_lora_rank :].to(dtype))
        out = output.view(-1, self.num_heads, self.v_head_dim)
        for req in step.prefills:
            qr = q[req.tokens].transpose(0, 1).float()  # [H, q, D]
            kr = k[req.key_rows].transpose(0, 1).float()
            vr = v[req.key_rows].transpose(0, 1).float()
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=req.mask, scale=self.scale)
            out[req.tokens] = o.transpose(0, 1).to(out.dtype)
