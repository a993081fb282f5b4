"""The ``exact`` debug mode: vLLM's own CPU attention, unchanged, behind the kvarn backend.

With ``additional_config={"kvarn_kv_cache_dtype": "exact"}`` the plugin's registration,
selection and routing run as usual but the cache and kernels are vLLM's, so greedy tokens and
logprobs must equal a run without the plugin. CPU only.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)


class ExactCpuImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, unchanged."""


class ExactCpuBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU attention metadata builder, unchanged."""
