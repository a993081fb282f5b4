"""The ``exact`` debug mode for MLA layers: vLLM's own CPU MLA, unchanged, behind kvarn.

With ``additional_config={"kvarn_kv_cache_dtype": "exact"}`` on an MLA model the plugin's
selection and routing run as usual (kvarn_vllm.mla_backend) but the cache and kernels are
vLLM's, so greedy tokens must equal a run without the plugin. CPU only.
"""

from __future__ import annotations

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl


class ExactCpuMlaImpl(CPUMLAImpl):
    """vLLM's CPU MLA impl, unchanged."""


class ExactCpuMlaBuilder(MLACommonMetadataBuilder):
    """vLLM's MLA metadata builder (the one its CPU MLA backend uses), unchanged."""
