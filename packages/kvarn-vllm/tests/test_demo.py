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
    stats = demo.ppl_stats([-2.0] * 128, [-2.01] * 128)
    text = demo.report("kvarn_k4v2_g64", exact, kv, stats)
    assert "Hello there" in text and "Hello you" in text
    assert "75% tokens equal, first divergence at token 2" in text
    assert "exact (float32) 6,400" in text and "54,400 tokens" in text and "8.50x" in text
    assert "+1.01%" in text
