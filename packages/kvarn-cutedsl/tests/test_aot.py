"""Offline compile for sm_90a and sm_120a, the AOT build, and the loader's argument checks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvarn_cutedsl import _capability as cap
from kvarn_cutedsl import aot
from kvarn_cutedsl._spec import make_spec

SPEC = make_spec("kvarn_k4v2_g64", 128, 4, 1, torch.bfloat16, torch.bfloat16)


def _dsl():
    return pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("arch", sorted(cap.BUILDABLE_ARCHS))
def test_offline_compile(arch):
    _dsl()
    from kvarn_cutedsl.compile import compile_spec

    assert compile_spec(SPEC, arch) is not None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    _dsl()
    out = tmp_path_factory.mktemp("aot")
    specs = [SPEC, make_spec("kvarn_k4v4_g128", 64, 3, 2, torch.float16, torch.float16)]
    lib = aot.build(specs, "sm_90a", out, log=lambda *_: None)
    return out, lib, specs


def test_build_writes_module_and_manifest(built):
    out, lib, specs = built
    data = json.loads((out / aot.MANIFEST).read_text())
    assert data["arch"] == "sm_90a" and data["library"] == lib.name
    assert [s["k_bits"] for s in data["specs"]] == [4, 4]
    assert lib.stat().st_size > 10_000


def test_loader_returns_every_function(built):
    pytest.importorskip("tvm_ffi")
    out, _, specs = built
    fns = aot.load_artifacts(out, "sm_90a")
    assert set(fns) == set(specs)


def test_loader_refuses_other_arch(built):
    out, _, _ = built
    with pytest.raises(aot.ArtifactError, match="holds kernels for sm_90a.*--arch sm_120a"):
        aot.load_artifacts(out, "sm_120a")


def test_loader_argument_checks(tmp_path):
    with pytest.raises(aot.ArtifactError, match="does not exist: build it"):
        aot.load_artifacts(tmp_path, "sm_90a")
    (tmp_path / aot.MANIFEST).write_text("{not json")
    with pytest.raises(aot.ArtifactError, match="not valid JSON"):
        aot.load_artifacts(tmp_path, "sm_90a")
    (tmp_path / aot.MANIFEST).write_text(json.dumps({"manifest_version": 1, "arch": "sm_90a"}))
    with pytest.raises(aot.ArtifactError, match="missing key 'library'"):
        aot.load_artifacts(tmp_path, "sm_90a")
    m = {"manifest_version": 99, "arch": "sm_90a", "library": "x.so", "specs": []}
    (tmp_path / aot.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(aot.ArtifactError, match="manifest_version 99"):
        aot.load_artifacts(tmp_path, "sm_90a")
    m["manifest_version"] = aot.MANIFEST_VERSION
    (tmp_path / aot.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(aot.ArtifactError, match="x.so .*does not exist"):
        aot.load_artifacts(tmp_path, "sm_90a")
    (tmp_path / "x.so").write_bytes(b"")
    spec = dataclasses.asdict(SPEC)
    for specs, needle in (
        (None, "'specs' must be a list"),
        ({"a": 1}, "'specs' must be a list"),
        ([{**spec, "new_field": 1}], r"specs\[0\] must be an object with the keys"),
        ([1], r"specs\[0\] must be an object"),
    ):
        (tmp_path / aot.MANIFEST).write_text(json.dumps({**m, "specs": specs}))
        with pytest.raises(aot.ArtifactError, match=needle):
            aot.load_artifacts(tmp_path, "sm_90a")


def test_get_function_without_artifact_or_compiler(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_cutlass(name, *a, **k):
        if name == "cutlass" or name.startswith("cutlass."):
            raise ImportError("No module named 'cutlass'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_cutlass)
    monkeypatch.setattr(aot, "_functions", {})
    with pytest.raises(aot.ArtifactError, match="python -m kvarn_cutedsl.aot --arch sm_90a"):
        aot.get_function(SPEC, "sm_90a")


def test_build_refuses_before_compiling(tmp_path):
    with pytest.raises(NotImplementedError, match="sm_80a"):
        aot.build([SPEC], "sm_80a", tmp_path)
    bad = make_spec("kvarn_k5v5_g64", 128, 4, 1, torch.bfloat16, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="K bits 5"):
        aot.build([bad], "sm_90a", tmp_path)
    assert not any(tmp_path.iterdir())


def test_cli_rejects_bad_spec(capsys):
    with pytest.raises(SystemExit):
        aot.main(["--arch", "sm_90a", "--out", "x", "--spec", "kvarn_k4v2_g64:128"])
    assert "FORMAT:HEAD_DIM:GQA:T:QDTYPE:POOLDTYPE" in capsys.readouterr().err
    assert aot.main(["--arch", "sm_80a", "--out", "x"]) == 2
    with pytest.raises(SystemExit):
        aot.main(
            ["--arch", "sm_90a", "--out", "x", "--spec", "kvarn_k4v2_g64:96:4:1:bfloat16:bfloat16"]
        )
    assert "head_dim must be one of" in capsys.readouterr().err  # the reason, not the option only
    spec0 = "kvarn_k4v2_g64:128:0:1:bfloat16:bfloat16"  # GQA 0: refused before compiling
    assert aot.main(["--arch", "sm_90a", "--out", "x", "--spec", spec0]) == 2
    assert "gqa: must be a positive integer" in capsys.readouterr().err


def test_cli_without_the_dsl_is_a_clean_error(monkeypatch, tmp_path, capsys):
    def no_dsl(*a, **k):
        raise ModuleNotFoundError("No module named 'cutlass'")

    monkeypatch.setattr(aot, "_compile_one", no_dsl, raising=False)
    monkeypatch.setattr(aot, "build", no_dsl)
    assert aot.main(["--arch", "sm_90a", "--out", str(tmp_path)]) == 2
    assert "needs the CuTe DSL" in capsys.readouterr().err
