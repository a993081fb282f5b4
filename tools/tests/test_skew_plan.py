"""The skew plan picks the oldest admitted providers and fires when they are too old."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import release
from fakerepo import CONSUMER_COMPAT, write_package


def picks(run: release.SkewRun) -> list[tuple[str, str, str | None]]:
    return [(p.short, p.version, p.tag) for p in run.providers]


def test_without_tags_the_oldest_is_the_working_tree(
    repo: Path, commit: Callable[..., None]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    commit("first")
    (run,) = release.plan_skew(repo)
    assert run.kind == "oldest" and run.problems == [] and run.skip is None
    assert picks(run) == [("formats", "1.0.0", None)]
    assert run.consumer.tag is None


def test_formats_is_not_a_consumer(repo: Path, commit: Callable[..., None]) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    commit("first")
    assert release.plan_skew(repo) == []


def test_oldest_admitted_release_comes_from_its_tag(
    repo: Path, commit: Callable[..., None]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    commit("formats 1.0.0", tag="kvarn-formats-v1.0.0")
    write_package(repo, "formats", "1.1.0", format_api=2)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    commit("formats 1.1.0, ops")
    (run,) = release.plan_skew(repo)
    assert run.problems == []
    assert picks(run) == [("formats", "1.0.0", "kvarn-formats-v1.0.0")]


def test_too_old_format_api_fails_and_names_the_pin_to_raise(
    repo: Path, commit: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    commit("formats 1.0.0", tag="kvarn-formats-v1.0.0")
    write_package(repo, "formats", "1.1.0", format_api=2)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"],
                  compat={**CONSUMER_COMPAT, "FORMAT_API_MIN": 2})  # fmt: skip
    commit("ops needs FORMAT_API 2 but still pins >=1.0")
    (run,) = release.plan_skew(repo)
    (message,) = run.problems
    assert "kvarn-ops needs FORMAT_API >= 2" in message
    assert "kvarn-formats 1.0.0 (kvarn-formats-v1.0.0)" in message
    assert "has FORMAT_API 1: kvarn-formats too old for the pin" in message
    assert 'raise the pin to kvarn-formats>=1.1.0 (and FORMATS_MIN = "1.1.0"' in message
    assert release.main(["--root", str(repo), "skew"]) == 1
    assert "too old for the pin" in capsys.readouterr().out


def test_too_old_format_api_without_any_good_release(
    repo: Path, commit: Callable[..., None]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"],
                  compat={**CONSUMER_COMPAT, "FORMAT_API_MIN": 2})  # fmt: skip
    commit("x")
    (run,) = release.plan_skew(repo)
    (message,) = run.problems
    assert "release a kvarn-formats with FORMAT_API >= 2 and raise the pin to it" in message


def test_version_below_the_pin_fails(repo: Path, commit: Callable[..., None]) -> None:
    write_package(repo, "formats", "0.9.0", format_api=1)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    commit("x")
    (run,) = release.plan_skew(repo)
    (message,) = run.problems
    assert (
        "no kvarn-formats satisfies the pins (kvarn-ops 1.0.0 pins kvarn-formats<2,>=1.0)"
        in message
    )
    assert "known versions: 0.9.0 (working tree)" in message
    assert "too old (or too new) for the pin" in message
    assert "change the pin and the FORMATS_MIN/FORMATS_MAX in _compat.py" in message


def test_missing_format_api(repo: Path, commit: Callable[..., None]) -> None:
    write_package(repo, "formats", "1.0.0")
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    commit("x")
    (run,) = release.plan_skew(repo)
    assert any("no module-level FORMAT_API" in p for p in run.problems), run.problems


def test_vllm_gets_the_oldest_ops_and_a_formats_both_admit(
    repo: Path, commit: Callable[..., None]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    commit("f1", tag="kvarn-formats-v1.0.0")
    write_package(repo, "formats", "1.1.0", format_api=2)
    write_package(repo, "ops", "1.0.0", deps=["kvarn-formats>=1.1,<2"],
                  compat={**CONSUMER_COMPAT, "FORMATS_MIN": "1.1"})  # fmt: skip
    commit("f1.1 + ops 1.0", tag="kvarn-ops-v1.0.0")
    write_package(repo, "ops", "1.1.0", deps=["kvarn-formats>=1.1,<2"],
                  compat={**CONSUMER_COMPAT, "FORMATS_MIN": "1.1"})  # fmt: skip
    vllm_compat = {**CONSUMER_COMPAT, "OPS_MIN": "1.0", "OPS_MAX": "2"}
    write_package(repo, "vllm", deps=["kvarn-formats>=1.0,<2", "kvarn-ops>=1.0,<2"],
                  compat=vllm_compat)  # fmt: skip
    commit("ops 1.1, vllm")
    runs = {(r.consumer.short, r.kind): r for r in release.plan_skew(repo)}
    vllm = runs[("vllm", "oldest")]
    assert vllm.problems == []
    # ops 1.0.0 from its tag; formats 1.0.0 is admitted by vllm but not by that ops: 1.1.0.
    assert picks(vllm) == [("formats", "1.1.0", None), ("ops", "1.0.0", "kvarn-ops-v1.0.0")]
    ops = runs[("ops", "oldest")]
    assert picks(ops) == [("formats", "1.1.0", None)]


def test_forward_last_tagged_consumer_with_newest_providers(
    repo: Path, commit: Callable[..., None]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    commit("1.0", tag="kvarn-ops-v1.0.0")
    write_package(repo, "formats", "1.3.0", format_api=2)
    commit("formats 1.3")
    runs = {r.kind: r for r in release.plan_skew(repo)}
    forward = runs["forward"]
    assert forward.consumer.tag == "kvarn-ops-v1.0.0"
    assert picks(forward) == [("formats", "1.3.0", None)]
    assert forward.problems == [] and forward.skip is None


def test_forward_outside_the_old_pin_is_said_not_tested(
    repo: Path, commit: Callable[..., None]
) -> None:
    write_package(repo, "formats", "1.0.0", format_api=1)
    write_package(repo, "ops", deps=["kvarn-formats>=1.0,<2"], compat=CONSUMER_COMPAT)
    commit("1.0", tag="kvarn-ops-v1.0.0")
    write_package(repo, "formats", "2.0.0", format_api=5)
    write_package(repo, "ops", "2.0.0", deps=["kvarn-formats>=2.0,<3"],
                  compat={**CONSUMER_COMPAT, "FORMATS_MIN": "2.0", "FORMATS_MAX": "3"})  # fmt: skip
    commit("2.0")
    forward = next(r for r in release.plan_skew(repo) if r.kind == "forward")
    assert forward.skip is not None
    assert "kvarn-formats 2.0.0 in the working tree is outside the pin" in forward.skip
