"""Packaging: version source, the kvarn-formats pin and its import-time check."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

import kvarn_ops
from kvarn_ops import _compat

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_is_the_installed_metadata():
    assert kvarn_ops.__version__ == version("kvarn-ops")
    assert kvarn_ops.__version__ == tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_formats_pin_equals_compat_constants():
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = [d for d in deps if d.replace(" ", "").startswith("kvarn-formats")]
    assert pins == [f"kvarn-formats>={_compat.FORMATS_MIN},<{_compat.FORMATS_MAX}"]


@pytest.mark.parametrize("installed", ["0.9.3", "2.0.0", "2.1", "0.1.dev3"])
def test_out_of_range_formats_is_refused_with_the_fix(installed):
    with pytest.raises(ImportError, match=r"pip install 'kvarn-formats>=1\.0,<2'"):
        _compat.check_formats(installed=installed, format_api=_compat.FORMAT_API_MIN)


@pytest.mark.parametrize("installed", ["1.0.0", "1.0", "1.7.2", "1.9.0rc1", "1.2.0+local"])
def test_in_range_formats_is_accepted(installed):
    _compat.check_formats(installed=installed, format_api=_compat.FORMAT_API_MIN)


def test_old_format_api_is_refused():
    with pytest.raises(ImportError, match="FORMAT_API >= 1.*pip install"):
        _compat.check_formats(installed="1.3.0", format_api=0)


def test_check_runs_before_torch_is_imported():
    # A kvarn_formats whose FORMAT_API is too old must stop the import before torch loads.
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('kvarn_formats'); fake.FORMAT_API = 0\n"
        "sys.modules['kvarn_formats'] = fake\n"
        "try:\n"
        "    import kvarn_ops\n"
        "except ImportError as exc:\n"
        "    assert 'torch' not in sys.modules, 'torch imported before the check'\n"
        "    assert \"pip install 'kvarn-formats>=1.0,<2'\" in str(exc), exc\n"
        "    print('refused')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "refused"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        kvarn_ops.nonexistent  # noqa: B018
