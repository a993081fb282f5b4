"""Packaging facts: version, the kvarn-formats pin equals _compat, no kvarn-ops import."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

import kvarn_cutedsl
from kvarn_cutedsl import _compat

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _deps() -> list[str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]


def test_version_is_the_installed_metadata():
    assert kvarn_cutedsl.__version__ == version("kvarn-cutedsl")


def test_formats_pin_equals_compat():
    (pin,) = [d for d in _deps() if d.startswith("kvarn-formats")]
    m = re.fullmatch(r"kvarn-formats>=([0-9.]+),<([0-9.]+)", pin.replace(" ", ""))
    assert m, pin
    assert (m.group(1), m.group(2)) == (_compat.FORMATS_MIN, _compat.FORMATS_MAX)
    assert _compat.FORMAT_API_MIN == 1


def test_dsl_pin_admits_4_8_0():
    (pin,) = [d for d in _deps() if d.startswith("nvidia-cutlass-dsl")]
    assert pin.replace(" ", "") == "nvidia-cutlass-dsl>=4.8.0,<4.9"


def test_no_runtime_dependency_on_kvarn_ops():
    assert not any(d.startswith("kvarn-ops") for d in _deps())
    code = (
        "import sys, kvarn_cutedsl, kvarn_cutedsl.launcher, kvarn_cutedsl.aot; "
        "assert 'kvarn_ops' not in sys.modules; assert 'cutlass' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compat_rejects_out_of_range(monkeypatch):
    monkeypatch.setattr(_compat.metadata, "version", lambda name: "2.0.0")
    with pytest.raises(ImportError, match="kvarn-formats>=1.0,<2"):
        _compat.check_formats()
    monkeypatch.setattr(_compat.metadata, "version", lambda name: "0.9")
    with pytest.raises(ImportError, match="pip install"):
        _compat.check_formats()
