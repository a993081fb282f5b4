"""Pooling kvarn-eval runs over several texts (no model needed): the pooled paired statistics
are those of all chunks together, not an average of per-text figures."""

from __future__ import annotations

import math
import random

import pytest

from kvarn_ops.evaluation.harness import (
    code_text_set,
    default_token_ids,
    paired_stats,
    pool_exact,
    pool_texts,
    pydoc_text_set,
)


def _runs(seed: int, n_texts: int = 3, chunks: int = 32, g: int = 64):
    rng = random.Random(seed)
    exact, rows = [], []
    for t in range(n_texts):
        ex = [rng.uniform(100, 200) for _ in range(chunks)]
        # the last chunk holds g - 1 predictions: tokens = chunks * g - 1
        tokens = chunks * g - 1
        var = [c + rng.gauss(0.5 * (t + 1), 2.0) for c in ex]
        exact.append({"chunk_nll_sums": ex, "tokens": tokens, "nll": sum(ex) / tokens})
        rows.append(
            {
                "name": "m/kvarn_k4v2_g64",
                "chunk_nll_sums": var,
                "nll": sum(var) / tokens,
                "vs_exact": paired_stats(var, ex, tokens),
                "attn_error_accumulated": [0.1 * (t + 1), 0.2 * (t + 1)],
                "seconds": 1.0,
            }
        )
    return exact, rows


def test_pooled_statistics_are_those_of_all_chunks():
    exact, rows = _runs(3)
    row = pool_texts(exact, rows)
    ex_all = [c for e in exact for c in e["chunk_nll_sums"]]
    var_all = [c for r in rows for c in r["chunk_nll_sums"]]
    n = sum(e["tokens"] for e in exact)
    want = paired_stats(var_all, ex_all, n)
    assert row["vs_exact"] == want
    assert row["chunk_nll_sums"] == var_all and len(row["per_text"]) == 3
    assert math.isclose(row["nll"], sum(var_all) / n)
    assert row["attn_error_accumulated"] == pytest.approx([0.2, 0.4])
    # three texts of the same spread: the pooled standard error is about 1/sqrt(3) of one's
    one = rows[0]["vs_exact"]["dnll_se"]
    assert 0.35 * one < row["vs_exact"]["dnll_se"] < 0.85 * one
    pe = pool_exact(exact)
    assert pe["chunk_nll_sums"] == ex_all and pe["tokens"] == n and pe["texts"] == 3
    assert math.isclose(pe["ppl"], math.exp(sum(ex_all) / n))


def test_pooling_refuses_mismatched_runs():
    exact, rows = _runs(4)
    with pytest.raises(ValueError, match="one run per text"):
        pool_texts(exact, rows[:2])
    other = dict(rows[1], name="other/kvarn_k4v2_g64")
    with pytest.raises(ValueError, match="runs of one variant"):
        pool_texts(exact, [rows[0], other, rows[2]])
    short = dict(rows[2], chunk_nll_sums=rows[2]["chunk_nll_sums"][:-1])
    with pytest.raises(ValueError, match="chunk counts"):
        pool_texts(exact, [rows[0], rows[1], short])
    with pytest.raises(ValueError, match="at least one text"):
        pool_exact([])


def test_shipped_text_sets():
    ids, source = default_token_ids()
    texts, pydoc_source = pydoc_text_set()
    code, code_source = code_text_set()
    assert len(ids) == 2048 and "LICENSE" in source
    for group in (texts, code):
        assert len(group) == 6 and all(len(t) == 2048 for t in group)
    assert "pydoc_data.topics" in pydoc_source
    assert "argparse" in code_source and "tokens 1024-3071" in code_source
    # independent windows: no two texts (in any set, nor the license text) share a 64-token tile
    tiles = [tuple(t[i : i + 64]) for t in [ids, *texts, *code] for i in range(0, 2048, 64)]
    assert len(set(tiles)) == len(tiles)
    assert all(0 <= x < 49152 for t in [*texts, *code] for x in t)  # SmolLM2's vocabulary
