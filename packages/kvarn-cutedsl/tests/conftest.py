"""Fixtures of the CPU tests: a clean capability cache and environment for every test."""

from __future__ import annotations

import pytest

from kvarn_cutedsl import _capability as cap


@pytest.fixture(autouse=True)
def _clean_capability(monkeypatch):
    monkeypatch.delenv(cap.ARCH_ENV, raising=False)
    monkeypatch.delenv("KVARN_CUTEDSL_AOT_DIR", raising=False)
    cap.clear_cache()
    yield
    cap.clear_cache()
