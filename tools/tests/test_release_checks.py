"""The release checks fire, each with a message that names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

import release
from fakerepo import CONSUMER_COMPAT, git, write_package
from kvrepo import RepoError, WorkTree, read_package


def consistent_tree(root: Path) -> None:
    write_package(root, "formats", "1.2.0", format_api=3)
    write_package(root, "ops", "1.0.0", deps=["kvarn-formats>=1.0,<2", "torch>=2.9"],
                  compat=CONSUMER_COMPAT)  # fmt: skip


def test_consistent_tree_has_no_problem(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    assert release.release_problems(tmp_path, "formats") == []
    assert release.release_problems(tmp_path, "ops") == []
    assert release.main(["--root", str(tmp_path), "check", "--all"]) == 0


# ----------------------------------------------------------------------- pins vs _compat


def test_mismatched_pin_fails_naming_both_files_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    consistent_tree(tmp_path)
    write_package(tmp_path, "ops", "1.0.0", deps=["kvarn-formats>=1.1,<2"], compat=CONSUMER_COMPAT)
    problems = release.release_problems(tmp_path, "ops")
    assert len(problems) == 1, problems
    message = problems[0]
    assert "pin mismatch" in message
    assert "packages/kvarn-ops/pyproject.toml pins 'kvarn-formats<2,>=1.1'" in message
    assert 'src/kvarn_ops/_compat.py has FORMATS_MIN = "1.0"' in message
    assert 'set FORMATS_MIN = "1.1"' in message
    assert "change the pin to kvarn-formats>=1.0,<2" in message
    # The command line (what the `tools` and `release` sessions run) fails with it.
    assert release.main(["--root", str(tmp_path), "check", "kvarn-ops"]) == 1
    assert 'set FORMATS_MIN = "1.1"' in capsys.readouterr().out


def test_mismatched_upper_bound(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    write_package(tmp_path, "ops", deps=["kvarn-formats>=1.0,<3"], compat=CONSUMER_COMPAT)
    (message,) = release.release_problems(tmp_path, "ops")
    assert 'FORMATS_MAX = "2"' in message and 'set FORMATS_MAX = "3"' in message


def test_equal_versions_written_differently_agree(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    write_package(tmp_path, "ops", deps=["kvarn-formats>=1.0.0,<2.0"], compat=CONSUMER_COMPAT)
    assert release.release_problems(tmp_path, "ops") == []


def test_pin_must_be_a_range(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    write_package(tmp_path, "ops", deps=["kvarn-formats==1.2.0"], compat=CONSUMER_COMPAT)
    (message,) = release.release_problems(tmp_path, "ops")
    assert "must be a range like kvarn-formats>=1.0,<2" in message
    assert "write kvarn-formats>=1.0,<2" in message


def test_missing_compat_file_names_the_template_and_values(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    (tmp_path / "packages/kvarn-ops/src/kvarn_ops/_compat.py").unlink()
    (message,) = release.release_problems(tmp_path, "ops")
    assert "_compat.py is missing" in message
    assert 'FORMATS_MIN = "1.0", FORMATS_MAX = "2", FORMAT_API_MIN = <int>' in message


def test_missing_constant_and_format_api_min(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    write_package(tmp_path, "ops", deps=["kvarn-formats>=1.0,<2"], compat={"FORMATS_MIN": "1.0"})
    problems = release.release_problems(tmp_path, "ops")
    assert any('add FORMATS_MAX = "2"' in p for p in problems), problems
    assert any("needs an integer FORMAT_API_MIN" in p for p in problems), problems


def test_compat_constant_without_a_pin(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    write_package(tmp_path, "ops", deps=["kvarn-formats>=1.0,<2"],
                  compat={**CONSUMER_COMPAT, "OPS_MIN": "1.0"})  # fmt: skip
    (message,) = release.release_problems(tmp_path, "ops")
    assert "has OPS_MIN but" in message and "no kvarn-ops requirement" in message


def test_vllm_checks_every_sibling_pin(tmp_path: Path) -> None:
    consistent_tree(tmp_path)
    compat = {**CONSUMER_COMPAT, "OPS_MIN": "1.0", "OPS_MAX": "2"}
    deps = ["kvarn-formats>=1.0,<2", "kvarn-ops>=1.1,<2"]
    write_package(tmp_path, "vllm", deps=deps, compat=compat)
    (message,) = release.release_problems(tmp_path, "vllm")
    assert 'OPS_MIN = "1.0"' in message and 'set OPS_MIN = "1.1"' in message


# ----------------------------------------------------------------------- changelog


def test_missing_changelog_entry_names_the_heading_to_add(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = "# Changelog\n\n## 1.0.0 - 2026-11-01\n\n- First release.\n"
    write_package(tmp_path, "formats", "1.1.0", format_api=1, changelog=old)
    (message,) = release.release_problems(tmp_path, "formats")
    assert "CHANGELOG.md has no entry for version 1.1.0" in message
    assert "add '## 1.1.0 - " in message
    assert release.main(["--root", str(tmp_path), "check", "formats"]) == 1
    assert "no entry for version 1.1.0" in capsys.readouterr().out


def test_missing_changelog_file(tmp_path: Path) -> None:
    write_package(tmp_path, "formats", format_api=1)
    (tmp_path / "packages/kvarn-formats/CHANGELOG.md").unlink()
    (message,) = release.release_problems(tmp_path, "formats")
    assert "CHANGELOG.md is missing: create it with an entry '## 1.0.0 - " in message


@pytest.mark.parametrize("heading", ["## 1.1.0", "## [1.1.0] - 2026-11-30", "## v1.1.0 (soon)"])
def test_changelog_heading_in_the_wrong_form(tmp_path: Path, heading: str) -> None:
    write_package(tmp_path, "formats", "1.1.0", changelog=f"# Changelog\n\n{heading}\n\n- x\n")
    (message,) = release.release_problems(tmp_path, "formats")
    assert f"heading '{heading}' is not in the form '## X.Y.Z - YYYY-MM-DD'" in message


def test_changelog_entry_must_say_something(tmp_path: Path) -> None:
    text = "# Changelog\n\n## 1.1.0 - 2026-11-30\n\n## 1.0.0 - 2026-11-01\n\n- First.\n"
    write_package(tmp_path, "formats", "1.1.0", changelog=text)
    (message,) = release.release_problems(tmp_path, "formats")
    assert "entry '## 1.1.0 - 2026-11-30' is empty" in message


def test_changelog_ahead_of_the_version(tmp_path: Path) -> None:
    text = "# Changelog\n\n## 1.1.0 - 2026-11-30\n\n- New.\n\n## 1.0.0 - 2026-11-01\n\n- First.\n"
    write_package(tmp_path, "formats", "1.0.0", changelog=text)
    (message,) = release.release_problems(tmp_path, "formats")
    assert "newer than the version 1.0.0" in message and 'set version = "1.1.0"' in message


def test_bad_changelog_date(tmp_path: Path) -> None:
    write_package(tmp_path, "formats", changelog="## 1.0.0 - 2026-13-45\n\n- x\n")
    problems = release.release_problems(tmp_path, "formats")
    assert any("bad version or date" in p for p in problems), problems


# ----------------------------------------------------------------------- release only


def test_existing_tag_blocks_a_release(repo: Path) -> None:
    consistent_tree(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "x")
    git(repo, "tag", "kvarn-formats-v1.2.0")
    assert release.release_problems(repo, "formats") == []
    (message,) = release.release_problems(repo, "formats", releasing=True)
    assert "tag kvarn-formats-v1.2.0 already exists" in message
    assert "bump version in packages/kvarn-formats/pyproject.toml" in message
    assert release.release_problems(repo, "ops", releasing=True) == []


def test_unknown_package(tmp_path: Path) -> None:
    (message,) = release.release_problems(tmp_path, "nope")
    assert "packages/kvarn-nope/pyproject.toml does not exist" in message


def test_dynamic_version_is_refused(tmp_path: Path) -> None:
    pkg = write_package(tmp_path, "formats")
    text = (
        (pkg / "pyproject.toml").read_text().replace('version = "1.0.0"', 'dynamic = ["version"]')
    )
    (pkg / "pyproject.toml").write_text(text)
    with pytest.raises(RepoError, match="static version"):
        read_package(WorkTree(tmp_path), "formats")
    (message,) = release.release_problems(tmp_path, "formats")
    assert "needs a static version" in message
