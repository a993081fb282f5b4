"""`changed`: only the packages a git range touched, plus everything that depends on them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import release
from fakerepo import CONSUMER_COMPAT, write_package
from kvrepo import (
    WorkTree,
    changed_files,
    dependants,
    dependency_graph,
    discover,
    packages_for_changes,
    parse_tag,
    providers_closure,
    runtime_graph,
)


def four_packages(root: Path) -> None:
    write_package(root, "formats", format_api=1)
    write_package(root, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    write_package(root, "cutedsl", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    write_package(root, "vllm", deps=["kvarn-formats>=1.0,<2", "kvarn-ops>=1.0,<2"],
                  compat={**CONSUMER_COMPAT, "OPS_MIN": "1.0", "OPS_MAX": "2"})  # fmt: skip


def test_graph_and_closure(tmp_path: Path) -> None:
    four_packages(tmp_path)
    graph = dependency_graph(discover(WorkTree(tmp_path)))
    assert graph == {
        "formats": set(),
        "ops": {"formats"},
        "cutedsl": {"formats"},
        "vllm": {"formats", "ops", "cutedsl"},  # cutedsl: an extra in the design
    }
    assert providers_closure(graph, "vllm") == ["formats", "ops", "cutedsl"]
    # What an install of kvarn-vllm pulls in: its runtime pins only (cutedsl is an extra).
    runtime = runtime_graph(discover(WorkTree(tmp_path)))
    assert runtime["vllm"] == {"formats", "ops"}
    assert providers_closure(runtime, "vllm") == ["formats", "ops"]
    assert dependants(graph, {"ops"}) == {"ops", "vllm"}
    assert dependants(graph, {"formats"}) == {"formats", "ops", "cutedsl", "vllm"}


def test_graph_ignores_packages_not_there_yet(tmp_path: Path) -> None:
    write_package(tmp_path, "formats", format_api=1)
    write_package(tmp_path, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    assert dependency_graph(discover(WorkTree(tmp_path))) == {"formats": set(), "ops": {"formats"}}


@pytest.mark.parametrize(
    ("files", "expected", "root_tests"),
    [
        (["packages/kvarn-formats/src/kvarn_formats/grammar.py"],
         {"formats", "ops", "cutedsl", "vllm"}, False),
        (["packages/kvarn-ops/tests/test_decode.py"], {"ops", "vllm"}, False),
        (["packages/kvarn-cutedsl/README.md"], {"cutedsl", "vllm"}, False),
        (["packages/kvarn-vllm/pyproject.toml"], {"vllm"}, False),
        (["docs/contracts.md", "README.md"], set(), False),
        (["tests/test_end_to_end.py"], set(), True),
        (["noxfile.py"], {"formats", "ops", "cutedsl", "vllm"}, True),
        (["tools/release.py"], {"formats", "ops", "cutedsl", "vllm"}, True),
        (["packages/kvarn-unknown/x.py"], set(), False),
    ],
)  # fmt: skip
def test_packages_for_changes(
    tmp_path: Path, files: list[str], expected: set[str], root_tests: bool
) -> None:
    four_packages(tmp_path)
    assert packages_for_changes(files, discover(WorkTree(tmp_path))) == (expected, root_tests)


def test_changed_reads_a_git_range(
    repo: Path, commit: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    four_packages(repo)
    commit("all four")
    (repo / "packages/kvarn-ops/src/kvarn_ops/new.py").write_text("X = 1\n")
    commit("ops change")
    assert changed_files(repo, "HEAD~1..HEAD") == ["packages/kvarn-ops/src/kvarn_ops/new.py"]
    assert changed_files(repo, "HEAD~1") == ["packages/kvarn-ops/src/kvarn_ops/new.py"]
    assert release.main(["--root", str(repo), "changed", "HEAD~1..HEAD"]) == 0
    assert capsys.readouterr().out.split() == ["ops", "vllm"]


def test_bad_range_is_an_error(repo: Path, commit: Callable[..., None]) -> None:
    four_packages(repo)
    commit("x")
    assert release.main(["--root", str(repo), "changed", "nope..HEAD"]) == 1


@pytest.mark.parametrize(
    ("tag", "parsed"),
    [
        ("kvarn-formats-v1.0.0", ("formats", "1.0.0")),
        ("kvarn-ops-v1.2.3rc1", ("ops", "1.2.3rc1")),
        ("kvarn-vllm-v2", ("vllm", "2")),
        ("v1.0.0", None),
        ("kvarn-formats-1.0.0", None),
        ("kvarn-formats-vbanana", None),
    ],
)
def test_parse_tag(tag: str, parsed: tuple[str, str] | None) -> None:
    result = parse_tag(tag)
    assert (None if result is None else (result[0], str(result[1]))) == parsed
