"""The attention backend registered in vLLM's CUSTOM slot.

``get_name()`` returns "CUSTOM" (a new enum name breaks when the engine core is spawned: the
config is unpickled before plugins load). The backend serves the format resolved by
kvarn_vllm.settings; in the ``exact`` debug mode it hands vLLM's own CPU attention classes
back unchanged, so an end-to-end run can be compared token for token with vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvarn_vllm import gates
from kvarn_vllm import settings as kv_settings

BACKEND_NAME = "CUSTOM"


def settings_or_none() -> kv_settings.Settings | None:
    """The active settings, or None before they can be resolved (vLLM probes backends early)."""
    try:
        return kv_settings.active()
    except (kv_settings.SettingsError, AssertionError, RuntimeError):
        return None


def packed_spec(spec: Any, settings: kv_settings.Settings) -> Any:
    """The layer's KV-cache spec with pages of packed records.

    One state per block per KV head, ``tokens_per_state = G`` and ``state_content_bytes =
    record_bytes``, so a page is exactly ``num_kv_heads * record_bytes`` bytes and vLLM's
    block count reflects the real bytes. Specs vLLM builds with fewer tokens per block than
    G (one-token specs used to compare page sizes of hybrid models) get the per-token share
    of a record, rounded up.
    """
    if settings.exact or spec.state_content_bytes is not None:
        return spec
    layout = settings.layout(spec.head_size)
    group = layout.block_size
    if spec.block_size % group == 0:
        return replace(spec, state_content_bytes=layout.record_bytes, tokens_per_state=group)
    per_token = -(-layout.record_bytes // group)
    return replace(spec, state_content_bytes=per_token, tokens_per_state=1)


class KvarnAttentionBackend(AttentionBackend):
    """Dense KVarN KV cache (packed records plus an exact pool) for decoder self-attention."""

    # The exact-mode delegate (vLLM's CPU attention) stores in do_kv_cache_update; the kvarn
    # impl stores in forward and keeps do_kv_cache_update a no-op.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type:
        if kv_settings.active().exact:
            from kvarn_vllm.exact_debug import ExactCpuImpl

            return ExactCpuImpl
        from kvarn_vllm.impl import KvarnAttentionImpl

        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls() -> type:
        if kv_settings.active().exact:
            from kvarn_vllm.exact_debug import ExactCpuBuilder

            return ExactCpuBuilder
        from kvarn_vllm.impl import KvarnMetadataBuilder

        return KvarnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        settings = settings_or_none()
        if settings is None or settings.exact:
            return [MultipleOf(32)]  # what vLLM's CPU attention needs
        group = settings.group
        assert group is not None
        return [group]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        settings = settings_or_none()
        if settings is None or settings.group is None:
            return super().get_preferred_block_size(default_block_size)
        return settings.group

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(gates.SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype in (None, "auto") or str(kv_cache_dtype).startswith("kvarn_")

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Records of one block are contiguous per layer: [num_blocks, Hkv, R].
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        settings = settings_or_none()
        if settings is None:
            return spec
        return packed_spec(spec, settings)

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool = False,
        has_sink: bool = False,
        use_sparse: bool = False,
        use_mm_prefix: bool = False,
        use_per_head_quant_scales: bool = False,
        device_capability: Any = None,
        attn_type: str = "decoder",
        **flags: Any,
    ) -> list[str]:
        """Reasons (each naming the setting) this layer cannot use kvarn; [] when it can."""
        try:
            settings = kv_settings.active()
        except kv_settings.SettingsError as exc:
            return [str(exc)]
        return gates.layer_problems(
            settings,
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            use_mla=use_mla,
            has_sink=has_sink,
            use_sparse=use_sparse,
            use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales,
            attn_type=str(getattr(attn_type, "value", attn_type)),
            **flags,
        )
