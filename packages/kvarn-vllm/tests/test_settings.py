"""Where the format comes from: --kv-cache-dtype (vLLM 0.33) or additional_config (0.32)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvarn_vllm import settings as s


def cfg(cache_dtype="auto", extra=None, dtype="torch.float32"):
    return NS(
        additional_config=extra or {},
        cache_config=NS(cache_dtype=cache_dtype),
        model_config=NS(dtype=dtype),
    )


def test_not_asked_for():
    assert s.resolve(cfg()) is None


def test_from_additional_config():
    got = s.resolve(cfg(extra={s.FORMAT_KEY: "kvarn_k4v2_g64"}))
    assert got.format_name == "kvarn_k4v2_g64" and got.group == 64
    assert got.pool_dtype == "float16" and "additional_config" in got.source


def test_from_kv_cache_dtype():
    got = s.resolve(cfg(cache_dtype="kvarn_k4v4_g128", dtype="torch.bfloat16"))
    assert got.format_name == "kvarn_k4v4_g128" and got.group == 128
    assert got.pool_dtype == "bfloat16" and got.source == "--kv-cache-dtype"


def test_both_must_agree():
    with pytest.raises(s.SettingsError, match="disagree"):
        s.resolve(cfg(cache_dtype="kvarn_k4v4_g64", extra={s.FORMAT_KEY: "kvarn_k4v2_g64"}))


def test_unknown_format_suggests():
    with pytest.raises(s.SettingsError, match="kvarn_k4v2_g64|did you mean"):
        s.resolve(cfg(extra={s.FORMAT_KEY: "kvarn_k4v2_g63"}))


def test_mla_format_resolves_for_the_mla_backend():
    # Accepted here; kvarn_vllm.gates refuses it on a non-MLA model (test_mla_gates.py).
    got = s.resolve(cfg(extra={s.FORMAT_KEY: "kvarn_mla_k4_g64"}))
    assert got.is_mla and got.group == 64
    assert got.layout(576).record_bytes == 26752


def test_pool_dtype_setting():
    got = s.resolve(cfg(extra={s.FORMAT_KEY: "kvarn_k4v2_g64", s.POOL_DTYPE_KEY: "fp8"}))
    assert got.pool_dtype == "fp8"
    with pytest.raises(s.SettingsError, match=s.POOL_DTYPE_KEY):
        s.resolve(cfg(extra={s.FORMAT_KEY: "kvarn_k4v2_g64", s.POOL_DTYPE_KEY: "int8"}))


def test_exact_mode():
    got = s.resolve(cfg(extra={s.FORMAT_KEY: "exact"}))
    assert got.exact and got.group is None


def test_one_format_per_process():
    s.reset_for_tests()
    try:
        a = s.Settings("kvarn_k4v2_g64", "float16", "x")
        assert s.activate(a) is a and s.active() is a
        s.activate(a)  # idempotent
        with pytest.raises(s.SettingsError, match="one kvarn format per process"):
            s.activate(s.Settings("kvarn_k4v4_g64", "float16", "x"))
    finally:
        s.reset_for_tests()


def test_unknown_kvarn_keys_are_refused_not_ignored():
    """A misspelled setting must not silently fall back (here: fp8 asked, float16 served)."""
    extra = {s.FORMAT_KEY: "kvarn_k4v2_g64", "kvarn_pool_dtyp": "fp8"}
    with pytest.raises(s.SettingsError, match="'kvarn_pool_dtyp': not a kvarn setting"):
        s.resolve(cfg(extra=extra))
    # other plugins' keys are not ours to judge
    got = s.resolve(cfg(extra={s.FORMAT_KEY: "kvarn_k4v2_g64", "other_plugin_flag": 1}))
    assert got.format_name == "kvarn_k4v2_g64"


def test_pool_dtype_without_a_format_is_refused():
    with pytest.raises(s.SettingsError, match="kvarn_pool_dtype is set but no kvarn format"):
        s.resolve(cfg(extra={s.POOL_DTYPE_KEY: "fp8"}))


def test_additional_config_any_mapping_is_read():
    from types import MappingProxyType

    extra = MappingProxyType({s.FORMAT_KEY: "kvarn_k4v2_g64"})
    got = s.resolve(
        NS(
            additional_config=extra,
            cache_config=NS(cache_dtype="auto"),
            model_config=NS(dtype="torch.float16"),
        )
    )
    assert got is not None and got.format_name == "kvarn_k4v2_g64"


def test_additional_config_object_with_kvarn_attributes_is_refused():
    conf = NS(
        additional_config=NS(kvarn_kv_cache_dtype="kvarn_k4v2_g64"),
        cache_config=NS(cache_dtype="auto"),
        model_config=NS(dtype="torch.float16"),
    )
    with pytest.raises(s.SettingsError, match="not a dict"):
        s.resolve(conf)
    other = NS(
        additional_config=NS(some_plugin=1),
        cache_config=NS(cache_dtype="auto"),
        model_config=NS(dtype="torch.float16"),
    )
    assert s.resolve(other) is None
