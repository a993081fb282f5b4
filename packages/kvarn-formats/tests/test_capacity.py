"""Byte maths: ratios, exact-pool bytes and tokens that fit."""

import pytest

import kvarn_formats as kf


def test_ratios_against_bf16_and_fp8():
    layout = kf.dense_layout("kvarn_k4v2_g64", 128)
    assert kf.compression_ratio(layout, "bfloat16") == pytest.approx(512 / 114)
    assert kf.compression_ratio(layout, "float8") == pytest.approx(256 / 114)
    mla = kf.mla_layout("kvarn_mla_k5_g64")
    assert kf.compression_ratio(mla, "bfloat16") == pytest.approx(1152 / 482)
    assert kf.compression_ratio(mla, "float8") == pytest.approx(576 / 482)
    with pytest.raises(ValueError, match="baseline must be"):
        kf.compression_ratio(layout, "int4")


def test_exact_pool_bytes():
    layout = kf.dense_layout("kvarn_k4v2_g64", 128)
    # 64 tokens x 8 heads x (K + V) x 128 x 2 bytes x 32 layers
    assert kf.exact_pool_bytes_per_request(layout, 32, 8) == 64 * 8 * 2 * 128 * 2 * 32
    fp8 = kf.exact_pool_bytes_per_request(layout, 32, 8, "float8_e4m3fn", exact_blocks=2)
    assert fp8 == 2 * 64 * 8 * 2 * (128 + 4) * 32
    mla = kf.mla_layout("kvarn_mla_k4_g64")
    assert kf.exact_pool_bytes_per_request(mla, 2, 1, "float8_e4m3fn") == 64 * (512 + 128 + 4) * 2
    with pytest.raises(ValueError, match="pool_dtype must be one of"):
        kf.exact_pool_bytes_per_request(layout, 32, 8, "int8")
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        kf.exact_pool_bytes_per_request(layout, 0, 8)


def test_tokens_that_fit():
    layout = kf.dense_layout("kvarn_k4v2_g64", 128)
    gib = 1 << 30
    per_block = 7296 * 8 * 32
    pools = 16 * kf.exact_pool_bytes_per_request(layout, 32, 8)
    tokens = kf.tokens_that_fit(8 * gib, layout, 32, 8, max_requests=16)
    assert tokens == (8 * gib - pools) // per_block * 64
    assert tokens % 64 == 0
    # bf16 needs 128 KiB per token for this model; KVarN holds 512/114 = 4.5x more tokens in
    # the memory left after the exact pools (whole blocks only).
    left = 1 - pools / (8 * gib)
    assert tokens / (8 * gib // (512 * 8 * 32)) == pytest.approx(512 / 114 * left, rel=1e-3)
    with pytest.raises(ValueError, match="max_requests=100000"):
        kf.tokens_that_fit(gib, layout, 32, 8, max_requests=100_000)
    exact = 4 * kf.exact_pool_bytes_per_request(layout, 32, 8)
    with pytest.raises(ValueError, match="leaving nothing"):  # the pools fill memory exactly
        kf.tokens_that_fit(exact, layout, 32, 8, max_requests=4)
