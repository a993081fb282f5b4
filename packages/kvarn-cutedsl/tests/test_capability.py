"""Refusal paths of the capability gate, with mocked devices; all before any compile."""

from __future__ import annotations

import pytest
import torch

from kvarn_cutedsl import _capability as cap


def _mock_device(monkeypatch, major, minor):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, minor))
    cap.clear_cache()


@pytest.mark.parametrize(
    ("cc", "arch"), [((8, 0), "sm_80a"), ((10, 0), "sm_100a"), ((12, 1), "sm_121a")]
)
def test_unsupported_devices_are_refused(monkeypatch, cc, arch):
    _mock_device(monkeypatch, *cc)
    assert cap.device_arch() == arch
    with pytest.raises(NotImplementedError, match=rf"{arch}.*supported: \['sm_90a'\]"):
        cap.check_arch(cap.device_arch())
    assert not cap.is_supported(arch, 4, 2, 64, 128)


def test_h200_is_validated(monkeypatch):
    _mock_device(monkeypatch, 9, 0)
    assert cap.device_arch() == "sm_90a"
    cap.check_arch("sm_90a")
    assert cap.is_supported("sm_90a", 4, 2, 64, 128, gqa=4)


def test_sm90_refused_when_not_validated(monkeypatch):
    _mock_device(monkeypatch, 9, 0)
    monkeypatch.setattr(cap, "VALIDATED_ARCHS", frozenset())
    with pytest.raises(NotImplementedError, match="not validated on sm_90a"):
        cap.check_arch(cap.device_arch())


def test_sm120_compiles_but_is_not_run(monkeypatch):
    _mock_device(monkeypatch, 12, 0)
    with pytest.raises(NotImplementedError, match="compiles for this arch but has never been"):
        cap.check_arch(cap.device_arch())
    cap.check_arch("sm_120a", for_build=True)
    with pytest.raises(NotImplementedError, match="sm_121a"):
        cap.check_arch("sm_121a", for_build=True)


def test_env_names_the_arch_only_without_a_gpu(monkeypatch):
    """The variable is for offline compiles: with a visible GPU it cannot let a kernel run on
    an arch it was not validated on (an A100 posing as sm_90a passed the gate before)."""
    monkeypatch.setenv(cap.ARCH_ENV, "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cap.device_arch() == "sm_90a"
    _mock_device(monkeypatch, 8, 0)
    with pytest.raises(ValueError, match=f"^{cap.ARCH_ENV}=sm_90a: the visible GPU is sm_80a"):
        cap.device_arch()
    cap.clear_cache()
    _mock_device(monkeypatch, 9, 0)
    assert cap.device_arch() == "sm_90a"


@pytest.mark.parametrize(
    ("gqa", "query_len"), [(0, 1), (-1, 1), (1, 0), (-2, -4), (2.5, 1), (True, 1)]
)
def test_impossible_geometry_is_an_error(gqa, query_len):
    with pytest.raises(ValueError, match="^(gqa|query_len): must be a positive integer"):
        cap.is_supported("sm_90a", 4, 2, 64, 128, gqa=gqa, query_len=query_len)
    with pytest.raises(ValueError, match="^head_dim"):
        cap.is_supported("sm_90a", 4, 2, 64, 128.0)


def test_no_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        cap.device_arch()


def test_device_arch_is_cached(monkeypatch):
    calls = []

    def cc(index=None):
        calls.append(index)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", cc)
    cap.clear_cache()
    for _ in range(3):
        cap.device_arch()
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("kb", "vb", "g", "d", "what"),
    [
        (5, 5, 64, 128, "K bits 5"),
        (2, 2, 128, 128, "K bits 2"),
        (4, 3, 64, 128, "V bits 3"),
        (4, 8, 64, 128, "V bits 8"),
        (4, 2, 32, 128, "group 32"),
        (4, 2, 64, 256, "head_dim 256"),
    ],
)
def test_unimplemented_formats_are_refused(kb, vb, g, d, what):
    with pytest.raises(NotImplementedError, match=what):
        cap.check_format(kb, vb, g, d)
    assert not cap.is_supported("sm_90a", kb, vb, g, d)


def test_geometry_and_dtypes_refused():
    with pytest.raises(NotImplementedError, match="T=4, GQA=8"):
        cap.check_geometry(8, 4, "float16", "float16", "float16")
    with pytest.raises(NotImplementedError, match="fp8 pools"):
        cap.check_geometry(4, 1, "bfloat16", "float8_e4m3fn", "bfloat16")
    with pytest.raises(NotImplementedError, match="out of float32"):
        cap.check_geometry(4, 1, "bfloat16", "bfloat16", "float32")
    cap.check_geometry(8, 1, "bfloat16", "bfloat16", "bfloat16")
    cap.check_geometry(4, 2, "float16", "bfloat16", "float16")
