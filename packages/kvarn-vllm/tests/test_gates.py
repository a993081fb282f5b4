"""Every fail-closed rule of issue 7, each with a reason that names the setting."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvarn_vllm import gates
from kvarn_vllm.settings import Settings

K4V2 = Settings("kvarn_k4v2_g64", "float16", "test")
LAYER_OK = dict(head_size=128, dtype="torch.bfloat16", kv_cache_dtype="auto", block_size=64)


def _engine(**over):
    cfg = NS(
        kv_transfer_config=None,
        cache_config=NS(kv_offloading_size=None, kv_cache_dtype_skip_layers=[], block_size=64),
        parallel_config=NS(
            enable_dbo=False,
            ubatch_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        speculative_config=None,
        model_config=NS(hf_text_config=NS(sliding_window=None, layer_types=None)),
    )
    for path, value in over.items():
        obj = cfg
        *parents, last = path.split("__")
        for name in parents:
            obj = getattr(obj, name)
        setattr(obj, last, value)
    return cfg


def test_good_layer_and_engine_pass():
    assert gates.layer_problems(K4V2, **LAYER_OK) == []
    assert gates.engine_problems(K4V2, _engine()) == []


def test_speculative_ngram_is_served_and_drafter_models_are_refused():
    ngram = _engine(speculative_config=NS(method="ngram", num_speculative_tokens=3))
    assert gates.engine_problems(K4V2, ngram) == []
    for method in ("eagle", "eagle3", "draft_model", "mtp", "medusa"):
        (reason,) = gates.engine_problems(K4V2, _engine(speculative_config=NS(method=method)))
        assert f"method {method!r}" in reason and "ngram" in reason


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"head_size": 96}, "head_dim 96 not supported"),
        ({"block_size": 32}, "--block-size 32"),
        ({"block_size": 128}, "set --block-size 64"),
        ({"attn_type": "encoder_decoder"}, "attention type 'encoder_decoder'"),
        ({"attn_type": "encoder_only"}, "decoder self-attention only"),
        ({"use_mla": True}, "MLA models"),
        ({"has_sliding_window": True}, "sliding-window layers"),
        ({"has_alibi": True}, "ALiBi"),
        ({"use_kv_connector": True}, "--kv-transfer-config"),
        ({"use_dcp": True}, "--decode-context-parallel-size"),
        ({"use_pcp": True}, "--prefill-context-parallel-size"),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
        ({"dtype": "torch.float64"}, "--dtype float64"),
        ({"has_sink": True}, "attention sinks"),
        ({"use_sparse": True}, "sparse attention"),
        ({"use_non_causal": True}, "non-causal"),
        ({"use_batch_invariant": True}, "VLLM_BATCH_INVARIANT"),
        ({"use_adaptive_verification": True}, "--speculative-config"),
        ({"some_future_flag": True}, "some_future_flag"),
    ],
)
def test_layer_rejections(override, needle):
    reasons = gates.layer_problems(K4V2, **{**LAYER_OK, **override})
    assert len(reasons) == 1, reasons
    assert needle in reasons[0]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"kv_transfer_config": NS(kv_connector="NixlConnector")}, "--kv-transfer-config"),
        ({"cache_config__kv_offloading_size": 4.0}, "--kv-offloading-size"),
        ({"parallel_config__enable_dbo": True}, "--enable-dbo"),
        ({"parallel_config__ubatch_size": 2}, "micro-batching"),
        ({"parallel_config__decode_context_parallel_size": 2}, "--decode-context-parallel"),
        ({"parallel_config__prefill_context_parallel_size": 2}, "--prefill-context-parallel"),
        ({"cache_config__kv_cache_dtype_skip_layers": ["0"]}, "--kv-cache-dtype-skip-layers"),
        ({"speculative_config": NS(method="eagle")}, "--speculative-config"),
        ({"cache_config__block_size": 16}, "--block-size 16"),
        (
            {"model_config": NS(hf_text_config=NS(sliding_window=4096, layer_types=None))},
            "sliding-window",
        ),
        (
            {
                "model_config": NS(
                    hf_text_config=NS(
                        sliding_window=None, layer_types=["full_attention", "sliding_attention"]
                    )
                )
            },
            "sliding-window",
        ),
        ({"model_config": NS(hf_text_config=NS(alibi=True))}, "ALiBi"),
    ],
)
def test_engine_rejections(override, needle):
    reasons = gates.engine_problems(K4V2, _engine(**override))
    assert len(reasons) == 1, reasons
    assert needle in reasons[0]


def test_rejection_error_lists_all_reasons():
    err = gates.ConfigurationRejected(["a (x)", "b (y)"])
    assert "a (x)" in str(err) and "b (y)" in str(err) and err.reasons == ["a (x)", "b (y)"]


def test_exact_mode_has_no_block_size_rule():
    exact = Settings("exact", "float16", "test")
    assert gates.layer_problems(exact, **{**LAYER_OK, "block_size": 128}) == []


def test_layer_cache_dtype_must_be_the_engine_format():
    other = {**LAYER_OK, "kv_cache_dtype": "kvarn_k2v2_g64"}
    (reason,) = gates.layer_problems(K4V2, **other)
    assert "--kv-cache-dtype kvarn_k2v2_g64" in reason and "kvarn_k4v2_g64" in reason
    assert gates.layer_problems(K4V2, **{**LAYER_OK, "kv_cache_dtype": "kvarn_k4v2_g64"}) == []
