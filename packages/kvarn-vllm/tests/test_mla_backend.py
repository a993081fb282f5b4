"""The kvarn MLA backend without an engine: fail-closed rules, the spec vLLM sizes the cache
from, kernel block sizes per mode, and the test platform's routing of MLA layers."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

import kvarn_formats as kf
from conftest import needs_vllm
from kvarn_vllm import gates, mla_gates
from kvarn_vllm import settings as kv_settings
from kvarn_vllm.settings import Settings

K4 = Settings("kvarn_mla_k4_g64", "bfloat16", "additional_config kvarn_kv_cache_dtype")
EXACT = Settings("exact", "float16", "additional_config kvarn_kv_cache_dtype")
DENSE = Settings("kvarn_k4v2_g64", "float16", "additional_config kvarn_kv_cache_dtype")
MLA_LAYER = dict(head_size=576, dtype="torch.float32", kv_cache_dtype="auto", block_size=64)


def test_good_mla_layer_passes():
    assert mla_gates.mla_layer_problems(K4, **MLA_LAYER) == []
    assert mla_gates.mla_layer_problems(EXACT, **MLA_LAYER) == []
    assert mla_gates.mla_geometry_problems(512, 64) == []


@pytest.mark.parametrize(
    ("settings", "override", "needle"),
    [
        (DENSE, {}, "kvarn_kv_cache_dtype=kvarn_k4v2_g64: a dense format on an MLA model"),
        (K4, {"block_size": 16}, "--block-size 16"),
        (K4, {"block_size": 128}, "set --block-size 64"),
        (K4, {"head_size": 320}, "MLA head size 320"),
        (K4, {"use_mla": False}, "MLA (latent-cache) models only"),
        (K4, {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
        (K4, {"use_kv_connector": True}, "--kv-transfer-config"),
        (K4, {"use_sparse": True}, "sparse attention"),
        (Settings("kvarn_mla_k4_g128", "bfloat16", "src"), {}, "g64"),
        (EXACT, {"block_size": 40}, "--block-size 40: exact mode"),
    ],
)
def test_mla_layer_rejections_name_the_setting(settings, override, needle):
    reasons = mla_gates.mla_layer_problems(settings, **{**MLA_LAYER, **override})
    assert any(needle in r for r in reasons), reasons


def test_mla_geometry_rejection_names_the_model():
    (reason,) = mla_gates.mla_geometry_problems(256, 64)
    assert "kv_lora_rank=256" in reason and "(model)" in reason


def test_mla_format_on_dense_model_is_refused_by_the_dense_gates():
    reasons = gates.layer_problems(
        K4, head_size=128, dtype="torch.float32", kv_cache_dtype="auto", block_size=64
    )
    assert any("kvarn_mla_k4_g64: MLA formats need an MLA" in r for r in reasons), reasons


def test_mla_pool_dtype_setting():
    cfg = NS(
        kv_transfer_config=None,
        cache_config=NS(kv_offloading_size=None, kv_cache_dtype_skip_layers=[], block_size=64),
        parallel_config=NS(enable_dbo=False, ubatch_size=1),
        speculative_config=None,
        model_config=None,
        additional_config={kv_settings.POOL_DTYPE_KEY: "float16"},
    )
    (reason,) = mla_gates.mla_engine_problems(K4, cfg)
    assert "kvarn_pool_dtype='float16'" in reason
    cfg.additional_config = {kv_settings.POOL_DTYPE_KEY: "fp8"}
    assert mla_gates.mla_engine_problems(K4, cfg) == []
    # ngram speculative decoding is served; drafter models are refused, as by the dense gates
    cfg.speculative_config = NS(method="ngram", num_speculative_tokens=3)
    assert mla_gates.mla_engine_problems(K4, cfg) == []
    cfg.speculative_config = NS(method="mtp", num_speculative_tokens=1)
    (reason,) = mla_gates.mla_engine_problems(K4, cfg)
    assert "--speculative-config method 'mtp'" in reason
    cfg.speculative_config = None
    assert mla_gates.mla_pool_dtype(Settings("kvarn_mla_k4_g64", "fp8", "s")) == "fp8"
    assert mla_gates.mla_pool_dtype(Settings("kvarn_mla_k4_g64", "float16", "s")) == "bfloat16"


@pytest.fixture
def active():
    def _activate(settings: Settings) -> None:
        kv_settings.reset_for_tests()
        kv_settings.activate(settings)

    yield _activate
    kv_settings.reset_for_tests()


@needs_vllm
@pytest.mark.parametrize("fmt", ["kvarn_mla_k2_g64", "kvarn_mla_k4_g64", "kvarn_mla_k5_g64"])
def test_page_is_one_tile(active, fmt):
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from kvarn_vllm.mla_backend import KvarnMlaBackend

    active(Settings(fmt, "bfloat16", "test"))
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.float32)
    got = customize_attention_spec(KvarnMlaBackend, spec)
    layout = kf.mla_layout(fmt)
    assert got.page_size_bytes == layout.record_bytes
    assert got.num_states == 1 and got.tokens_per_state == 64
    assert KvarnMlaBackend.get_supported_kernel_block_sizes() == [64]
    one = KvarnMlaBackend.customize_spec(
        MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=576, dtype=torch.float32)
    )
    assert one.page_size_bytes == -(-layout.record_bytes // 64)


@needs_vllm
def test_exact_mode_keeps_vllm_spec_and_16_token_kernel_blocks(active):
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvarn_vllm.mla_backend import KvarnMlaBackend
    from kvarn_vllm.mla_exact_debug import ExactCpuMlaBuilder, ExactCpuMlaImpl

    active(EXACT)
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.float32)
    assert KvarnMlaBackend.customize_spec(spec) == spec
    assert KvarnMlaBackend.get_supported_kernel_block_sizes() == [16]
    assert KvarnMlaBackend.get_impl_cls() is ExactCpuMlaImpl
    assert KvarnMlaBackend.get_builder_cls() is ExactCpuMlaBuilder
    assert KvarnMlaBackend.get_name() == "CUSTOM" and KvarnMlaBackend.is_mla()


@needs_vllm
def test_test_platform_routes_mla_layers_to_the_mla_backend(active, monkeypatch):
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from kvarn_vllm.plugin import BACKEND_PATH, MLA_BACKEND_PATH
    from kvarn_vllm.testing import platform

    cls = platform.KvarnTestCpuPlatform
    custom = AttentionBackendEnum.CUSTOM
    active(K4)
    mla = AttentionSelectorConfig(576, torch.float32, "auto", 64, use_mla=True)
    assert cls.get_attn_backend_cls(custom, mla) == MLA_BACKEND_PATH
    with pytest.raises(ValueError, match="--block-size 16"):
        cls.get_attn_backend_cls(custom, mla._replace(block_size=16))
    dense = AttentionSelectorConfig(64, torch.float32, "auto", 64)
    with pytest.raises(ValueError, match="MLA formats need an MLA"):
        cls.get_attn_backend_cls(custom, dense)
    active(DENSE)
    assert cls.get_attn_backend_cls(custom, dense) == BACKEND_PATH
    with pytest.raises(ValueError, match="a dense format on an MLA model"):
        cls.get_attn_backend_cls(custom, mla)
