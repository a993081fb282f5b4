"""Kernel choice: explicit, overridable by KVARN_DECODE_KERNEL, never a silent downgrade."""

from __future__ import annotations

import logging

import pytest

from kvarn_vllm import kernel_choice as kc

ADMIT = lambda device_type, index, geometry: None  # noqa: E731
REFUSE = lambda device_type, index, geometry: "sm_80 is not validated (validated: sm_90a)"  # noqa: E731


def choose(device, env=None, probe=ADMIT):
    return kc.choose_kernel(device, 0, env=env or {}, cutedsl_probe=probe)


def test_auto_cpu_is_reference():
    assert choose("cpu").name == "reference"


def test_auto_cuda_is_triton_even_where_cutedsl_admits():
    """kvarn-ops's decode is the faster one wherever both serve (H200: 44-62% of the copy
    bandwidth against 6-15%), so auto never picks kvarn-cutedsl, installed or not."""
    for probe in (ADMIT, REFUSE):
        choice = choose("cuda", probe=probe)
        assert choice.name == "triton" and f"{kc.ENV_VAR}=cutedsl" in choice.reason


def test_override_cutedsl_where_gate_admits():
    assert choose("cuda", {kc.ENV_VAR: "cutedsl"}, probe=ADMIT).name == "cutedsl"


@pytest.mark.parametrize("value", ["reference", "REFERENCE", " reference "])
def test_override_reference_anywhere(value):
    assert choose("cuda", {kc.ENV_VAR: value}).name == "reference"


def test_override_triton_on_cuda():
    assert choose("cuda", {kc.ENV_VAR: "triton"}, probe=ADMIT).name == "triton"


def test_override_cutedsl_refused_names_reason():
    with pytest.raises(ValueError, match="sm_80.*KVARN_DECODE_KERNEL=triton"):
        choose("cuda", {kc.ENV_VAR: "cutedsl"}, probe=REFUSE)


@pytest.mark.parametrize("value", ["triton", "cutedsl"])
def test_gpu_kernels_refused_on_cpu(value):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose("cpu", {kc.ENV_VAR: value})


def test_unknown_value_refused():
    with pytest.raises(ValueError, match="not one of auto, triton, cutedsl, reference"):
        choose("cpu", {kc.ENV_VAR: "fast"})


def test_cutedsl_probe_without_cuda():
    assert "CUDA devices only" in kc.cutedsl_problem("cpu")


def test_cutedsl_probe_without_package():
    import importlib.util

    if importlib.util.find_spec("kvarn_cutedsl") is not None:
        pytest.skip("kvarn-cutedsl is installed here")
    assert "kvarn-cutedsl is not importable" in kc.cutedsl_problem("cuda")


def test_cutedsl_probe_asks_for_the_longest_verify_run(monkeypatch):
    """Speculative verify runs go through decode with T = 1 + drafts: the CuTe DSL gate is
    asked for that T, and a refusal names the geometry (an explicit cutedsl choice raises)."""
    import sys
    import types

    asked = []

    def is_supported(arch, k_bits, v_bits, group, head_dim, gqa, query_len, q_dtype, pool):
        asked.append(query_len)
        return gqa * query_len <= 16

    fake = types.SimpleNamespace(device_arch=lambda index: "sm_90a", is_supported=is_supported)
    monkeypatch.setitem(sys.modules, "kvarn_cutedsl", fake)
    geo = kc.DecodeGeometry(4, 2, 64, 128, gqa=8, max_query_len=4)
    assert "does not support" in kc.cutedsl_problem("cuda", 0, geo)
    assert kc.cutedsl_problem("cuda", 0, kc.DecodeGeometry(4, 2, 64, 128, gqa=8)) is None
    assert asked == [4, 1]
    with pytest.raises(ValueError, match="max_query_len=4"):
        kc.choose_kernel("cuda", 0, geometry=geo, env={kc.ENV_VAR: "cutedsl"})


def test_logged_once_per_process(caplog):
    kc._LOGGED.clear()
    choice = kc.KernelChoice("reference", "test")
    with caplog.at_level(logging.INFO, logger="vllm.kvarn"):
        for _ in range(3):
            kc.log_choice_once(choice, "cpu")
    lines = [r for r in caplog.records if "run on reference" in r.getMessage()]
    assert len(lines) == 1


def test_opset_reference_binds_reference_ops():
    import kvarn_ops

    ops = kc.OpSet(kc.KernelChoice("reference", "test"))
    assert ops.decode is kvarn_ops.reference.decode
    assert ops.store is kvarn_ops.reference.store
    assert ops.decode_workspace is None


def test_opset_passes_projection_views_to_store_when_kvarn_ops_reads_them(monkeypatch):
    """With a kvarn-ops whose store reads strided token rows, K/V go to store as views of
    the fused projection; with one that lacks the feature (1.0.0), as contiguous copies."""
    import kvarn_ops

    assert kc.OpSet(kc.KernelChoice("reference", "test")).strided_store
    monkeypatch.delattr(kvarn_ops, "STRIDED_STORE_TOKENS")
    assert not kc.OpSet(kc.KernelChoice("reference", "test")).strided_store


def test_opset_passes_sink_rows_when_kvarn_ops_takes_them(monkeypatch):
    """With a kvarn-ops whose flush takes ``sink_rows``, the impl passes each request's first
    block's sink; with one that lacks it (1.0.0), flush is called as before."""
    import kvarn_ops

    assert kc.OpSet(kc.KernelChoice("reference", "test")).flush_sink_rows
    monkeypatch.delattr(kvarn_ops, "FLUSH_SINK_ROWS")
    assert not kc.OpSet(kc.KernelChoice("reference", "test")).flush_sink_rows
