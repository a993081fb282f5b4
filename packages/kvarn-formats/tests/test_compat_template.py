"""The compatibility check consumers copy: it fires on a too-old or too-new kvarn-formats."""

from importlib import metadata

import pytest

import kvarn_formats
from kvarn_formats.compat_template import check_formats, version_tuple


def test_version_tuple():
    assert version_tuple("1.2.3") == (1, 2, 3)
    assert version_tuple("1.2.3rc1") == (1, 2, 3)
    assert version_tuple("2") == (2,)
    assert version_tuple("1.0.0+local") == (1, 0, 0)


def test_installed_version_passes():
    check_formats("kvarn-ops", "1.0", "2", kvarn_formats.FORMAT_API)


def test_too_old_version_names_the_fix(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "0.9.0")
    with pytest.raises(
        ImportError, match=r"0\.9\.0 is installed: pip install 'kvarn-formats>=1.0,<2'"
    ):
        check_formats("kvarn-ops", "1.0", "2", 1)


def test_too_new_version_names_the_fix(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "2.0.1")
    with pytest.raises(ImportError, match="tested with kvarn-formats>=1.0,<2"):
        check_formats("kvarn-vllm", "1.0", "2", 1)


def test_too_old_api_names_the_fix():
    with pytest.raises(ImportError, match="FORMAT_API >= 99"):
        check_formats("kvarn-ops", "1.0", "2", 99)


def test_missing_distribution(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ImportError, match="not installed"):
        check_formats("kvarn-ops", "1.0", "2", 1)
