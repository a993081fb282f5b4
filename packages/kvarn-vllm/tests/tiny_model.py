"""A tiny random Llama-architecture checkpoint written at test time (no model hub)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_llama(
    path: Path,
    *,
    head_dim: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Save a random ``LlamaForCausalLM`` (float32, GQA) to ``path``; returns ``path``.

    Weights are scaled up from transformers' default init so that attention is far from
    uniform and the KV cache matters for the next token.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path
