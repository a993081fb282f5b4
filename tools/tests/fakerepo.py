"""Fake monorepos in tmp_path: the release, skew and changed checks are tested on these, never
on the state of the real packages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))


def write_package(
    root: Path,
    short: str,
    version: str = "1.0.0",
    *,
    deps: Sequence[str] = (),
    compat: dict[str, object] | None = None,
    changelog: str | None = None,
    format_api: int | None = None,
    test_extra: bool = True,
) -> Path:
    """packages/kvarn-<short> with a pyproject, src/, a test, a changelog and maybe _compat."""
    pkg = root / "packages" / f"kvarn-{short}"
    src = pkg / "src" / f"kvarn_{short}"
    (pkg / "tests").mkdir(parents=True, exist_ok=True)
    src.mkdir(parents=True, exist_ok=True)
    dep_lines = ", ".join(f'"{d}"' for d in deps)
    extra = '\n[project.optional-dependencies]\ntest = ["pytest>=8"]\n' if test_extra else ""
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["hatchling>=1.24"]
            build-backend = "hatchling.build"

            [project]
            name = "kvarn-{short}"
            version = "{version}"
            requires-python = ">=3.11"
            dependencies = [{dep_lines}]
            """
        )
        + extra
    )
    init = "" if format_api is None else f"FORMAT_API = {format_api}\n"
    (src / "__init__.py").write_text(init)
    if compat is not None:
        lines = [f"{name} = {value!r}" for name, value in compat.items()]
        (src / "_compat.py").write_text("\n".join(lines) + "\n")
    if changelog is None:
        changelog = f"# Changelog\n\n## {version} - 2026-11-30\n\n- Something changed.\n"
    (pkg / "CHANGELOG.md").write_text(changelog)
    (pkg / "tests" / "test_it.py").write_text("def test_it():\n    assert True\n")
    return pkg


def git(root: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=kvarn", "-c", "user.email=kvarn@example.invalid",
         "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false", *args],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stdout


CONSUMER_COMPAT: dict[str, object] = {
    "FORMATS_MIN": "1.0",
    "FORMATS_MAX": "2",
    "FORMAT_API_MIN": 1,
}
