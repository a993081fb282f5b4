"""Fail-closed rules of the kvarn MLA backend. Every rejection is a reason naming the setting.

- :func:`mla_layer_problems`: what ``validate_configuration`` knows about one MLA layer.
- :func:`mla_geometry_problems`: the latent geometry (only the impl sees ``kv_lora_rank``).
- :func:`mla_engine_problems`: the engine-wide rules of kvarn_vllm.gates plus the MLA pool
  dtype.

Rules shared with the dense backend (KV transfer, speculative decoding, context parallel, ...)
come from kvarn_vllm.gates, so both backends refuse the same settings with the same words.
"""

from __future__ import annotations

from typing import Any

import kvarn_formats as kf
from kvarn_vllm import gates
from kvarn_vllm.settings import POOL_DTYPE_KEY, Settings

LATENT_DIM = 512
ROPE_DIM = 64
MLA_HEAD_SIZE = LATENT_DIM + ROPE_DIM
MLA_POOL_DTYPES = ("bfloat16", "fp8")
CPU_MLA_KERNEL_BLOCK = 16  # the only block size vLLM's CPU MLA decode kernel compiles for
EXACT_FOR_RULES = "exact"
"""The format the shared dense rules are asked about (block-size and format rules are MLA's)."""


def mla_layer_problems(
    settings: Settings,
    *,
    head_size: int,
    dtype: Any,
    kv_cache_dtype: str | None,
    block_size: int | None,
    use_mla: bool = True,
    **flags: Any,
) -> list[str]:
    """Reasons this MLA layer cannot run with the active kvarn setting (empty when it can).

    Keyword arguments are those of vLLM's ``validate_configuration``; flags the dense rules
    know (sinks, sparse, KV connectors, ...) are checked by :func:`kvarn_vllm.gates.
    layer_problems`, whose dense-only rules (MLA, head_dim) are left out here.
    """
    reasons: list[str] = []
    if not use_mla:
        reasons.append("the kvarn MLA backend serves MLA (latent-cache) models only (model)")
    if not settings.exact and not settings.is_mla:
        reasons.append(
            f"{settings.source}={settings.format_name}: a dense format on an MLA model; use "
            "kvarn_mla_k{2,4,5}_g64 (or 'exact')"
        )
    if settings.is_mla:
        try:
            kf.mla_layout(settings.format_name)
        except kf.LayoutError as exc:
            reasons.append(f"{settings.source}={settings.format_name}: {exc}")
        if block_size is not None and block_size != kf.parse_format(settings.format_name).group:
            reasons.append(
                f"--block-size {block_size}: {settings.format_name} packs blocks of 64 tokens, "
                "set --block-size 64"
            )
    if settings.exact and block_size is not None and block_size % CPU_MLA_KERNEL_BLOCK:
        reasons.append(
            f"--block-size {block_size}: exact mode runs vLLM's CPU MLA kernel on "
            f"{CPU_MLA_KERNEL_BLOCK}-token kernel blocks; use a multiple of "
            f"{CPU_MLA_KERNEL_BLOCK} (64)"
        )
    if head_size != MLA_HEAD_SIZE:
        reasons.append(
            f"MLA head size {head_size} (kv_lora_rank + qk_rope_head_dim) not supported: kvarn "
            f"MLA needs {LATENT_DIM} + {ROPE_DIM} = {MLA_HEAD_SIZE} (model)"
        )
    # The dense rules for everything else; drop the ones that do not apply to MLA layers.
    dense_settings = Settings(EXACT_FOR_RULES, settings.pool_dtype, settings.source)
    shared = gates.layer_problems(
        dense_settings,
        head_size=gates.SUPPORTED_HEAD_DIMS[0],
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_mla=False,
        **flags,
    )
    return reasons + shared


def mla_geometry_problems(kv_lora_rank: int, qk_rope_head_dim: int) -> list[str]:
    """Reasons the model's latent geometry cannot be stored (empty for 512 + 64)."""
    if (kv_lora_rank, qk_rope_head_dim) == (LATENT_DIM, ROPE_DIM):
        return []
    return [
        f"MLA geometry kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim} not "
        f"supported: kvarn MLA tiles hold a {LATENT_DIM} latent + {ROPE_DIM} RoPE (model)"
    ]


def mla_engine_problems(settings: Settings, vllm_config: Any) -> list[str]:
    """Engine-wide reasons (kvarn_vllm.gates.engine_problems: ngram speculative decoding is
    served, its verify runs take the prefill path) plus the MLA pool dtype."""
    reasons = gates.engine_problems(settings, vllm_config)
    extra = getattr(vllm_config, "additional_config", None) or {}
    asked = extra.get(POOL_DTYPE_KEY) if isinstance(extra, dict) else None
    if settings.is_mla and asked is not None and asked not in MLA_POOL_DTYPES:
        reasons.append(
            f"additional_config {POOL_DTYPE_KEY}={asked!r}: the MLA exact pool holds "
            f"{' or '.join(MLA_POOL_DTYPES)} latents"
        )
    return reasons


def mla_pool_dtype(settings: Settings) -> str:
    """The MLA pool's latent dtype: ``fp8`` when asked for, else ``bfloat16``."""
    return "fp8" if settings.pool_dtype == "fp8" else "bfloat16"
