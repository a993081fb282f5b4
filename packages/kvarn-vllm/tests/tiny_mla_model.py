"""A tiny random DeepSeek-V2-style (MLA) checkpoint written at test time (no model hub)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_deepseek_v2(
    path: Path,
    *,
    num_heads: int = 4,
    num_layers: int = 2,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    hidden_size: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Save a random ``DeepseekV2ForCausalLM`` (float32, MLA, dense MLPs) to ``path``.

    The latent cache is ``kv_lora_rank`` (512) + ``qk_rope_head_dim`` (64) per token, the
    geometry of DeepSeek-V2/V3. Every layer uses a dense MLP (``first_k_dense_replace`` =
    ``num_layers``), so no MoE kernels run. Weights are scaled up from the default init so
    attention is far from uniform and the cache matters for the next token.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        head_dim=qk_rope_head_dim,
        first_k_dense_replace=num_layers,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path
