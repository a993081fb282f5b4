"""The KV-cache spec vLLM sizes the cache from: packed record bytes, not padded ones."""

from __future__ import annotations

import pytest

import kvarn_formats as kf
from conftest import needs_vllm
from kvarn_vllm import settings as kv_settings

pytestmark = needs_vllm


@pytest.fixture
def active_k4v2():
    kv_settings.reset_for_tests()
    kv_settings.activate(kv_settings.Settings("kvarn_k4v2_g64", "float16", "test"))
    yield
    kv_settings.reset_for_tests()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_page_is_exact_record_bytes(active_k4v2, head_dim, dtype_name):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from kvarn_vllm.backend import KvarnAttentionBackend

    spec = FullAttentionSpec(
        block_size=64, num_kv_heads=3, head_size=head_dim, dtype=getattr(torch, dtype_name)
    )
    got = customize_attention_spec(KvarnAttentionBackend, spec)
    layout = kf.dense_layout("kvarn_k4v2_g64", head_dim=head_dim)
    assert got.page_size_bytes == 3 * layout.record_bytes
    assert got.page_size_bytes == kf.packed_bytes_per_block(layout, 1, 3)
    assert got.num_states == 1 and got.state_content_bytes == layout.record_bytes


def test_one_token_spec_gets_per_token_share(active_k4v2):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvarn_vllm.backend import KvarnAttentionBackend

    spec = FullAttentionSpec(block_size=1, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    got = KvarnAttentionBackend.customize_spec(spec)
    assert got.page_size_bytes == 2 * -(-7296 // 64)


def test_backend_identity_and_hooks(active_k4v2):
    from vllm.v1.attention.backend import MultipleOf

    from kvarn_vllm.backend import KvarnAttentionBackend

    assert KvarnAttentionBackend.get_name() == "CUSTOM"
    assert KvarnAttentionBackend.get_supported_kernel_block_sizes() == [64]
    assert KvarnAttentionBackend.get_preferred_block_size(16) == 64
    assert not KvarnAttentionBackend.supports_kv_connector()
    kv_settings.reset_for_tests()
    kv_settings.activate(kv_settings.Settings("exact", "float16", "test"))
    assert KvarnAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(32)]


def test_validate_configuration_through_vllm_signature(active_k4v2):
    import torch

    from kvarn_vllm.backend import KvarnAttentionBackend

    ok = KvarnAttentionBackend.validate_configuration(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=64,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type="decoder",
        has_sliding_window=False,
        use_kv_connector=False,
    )
    assert ok == []
    bad = KvarnAttentionBackend.validate_configuration(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type="decoder",
        has_sliding_window=True,
        use_kv_connector=True,
    )
    assert len(bad) == 3 and any("--block-size 16" in r for r in bad)
