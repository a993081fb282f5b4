"""GPU parity: every kvarn-ops kernel against its reference on a CUDA GPU.

Usage (with kvarn-formats and kvarn-ops installed, e.g. from wheels)::

    python packages/kvarn-ops/gpu/parity.py --out parity.json [-k EXPR]

Runs the ``test_*.py`` files beside this script with pytest. It refuses to run without a
CUDA device (exit status 2), counts a skipped test as a failure (a parity run must never pass
by skipping), writes a JSON report (device, versions, one entry per test) and ends with one
line ``gpu_parity: N passed, N failed``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class _Collector:
    """pytest plugin that keeps one record per test and, with ``out``, rewrites the JSON
    report after every test (``"complete": false``), so a run stopped by a time limit still
    leaves what it finished."""

    def __init__(self, out: Path | None = None, start: float = 0.0) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self.out = out
        self.start = start

    def pytest_runtest_logreport(self, report: Any) -> None:
        self._record(report)
        if self.out is not None and report.when == "teardown":
            _write_report(self.out, self.results, time.time() - self.start, None, False)

    def _record(self, report: Any) -> None:
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] += report.duration
        for key, value in getattr(report, "user_properties", []):
            entry[str(key)] = value
        if report.skipped:
            entry["outcome"] = "skipped"
            entry["detail"] = str(report.longrepr)[-2000:]
        elif report.failed:
            entry["outcome"] = "failed"
            entry["detail"] = str(report.longrepr)[-4000:]

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.results[report.nodeid or "collection"] = {
                "outcome": "failed",
                "seconds": 0.0,
                "detail": str(report.longrepr)[-4000:],
            }


def _environment() -> dict[str, Any]:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def _counts(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for entry in results.values():
        counts[entry["outcome"]] += 1
    return counts


def _write_report(
    out: Path, results: dict[str, dict[str, Any]], elapsed: float, code: int | None, done: bool
) -> dict[str, int]:
    """The JSON report: environment, counts (a skip counted as a failure), one entry per
    test; ``complete`` false while the run is in progress."""
    counts = _counts(results)
    report = {
        "environment": _environment(),
        "complete": done,
        "seconds": round(elapsed, 1),
        "passed": counts["passed"],
        "failed": counts["failed"],
        "skipped_counted_as_failed": counts["skipped"],
        "pytest_exit_code": code,
        "tests": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_parity.json"), help="JSON report")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("-x", dest="exitfirst", action="store_true", help="stop at first failure")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_parity: no CUDA GPU is visible to torch; this suite proves the kernels on a "
            "real GPU and never passes by skipping. Run it on a machine with a CUDA GPU.",
            file=sys.stderr,
        )
        return 2
    import pytest

    start = time.time()
    collector = _Collector(args.out, start)
    pytest_args = [str(HERE), "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfEs"]
    pytest_args += ["--rootdir", str(HERE)]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    if args.exitfirst:
        pytest_args.append("-x")
    code = pytest.main(pytest_args, plugins=[collector])
    counts = _write_report(args.out, collector.results, time.time() - start, int(code), True)
    failed = counts["failed"] + counts["skipped"]
    ok = counts["passed"] > 0 and failed == 0 and int(code) == 0
    print(f"gpu_parity: {counts['passed']} passed, {failed} failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
