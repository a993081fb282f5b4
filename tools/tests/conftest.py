"""Fixtures: an empty git repository in tmp_path, and a committer for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fakerepo import git


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """An empty git repository."""
    git(tmp_path, "init", "-q", "-b", "main")
    return tmp_path


@pytest.fixture
def commit(repo: Path) -> Callable[..., None]:
    """commit(message, tag=None): commit everything, optionally tag the commit."""

    def _commit(message: str, tag: str | None = None) -> None:
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--allow-empty", "-m", message)
        if tag:
            git(repo, "tag", "-a", tag, "-m", tag)

    return _commit
