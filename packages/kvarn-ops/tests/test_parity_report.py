"""The GPU parity runner's report (``gpu/parity.py``), exercised on the CPU with a stand-in
suite: one record per test, a skip counted as a failure, and the JSON rewritten after every
test, so a run stopped by a time limit keeps what it finished."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import parity  # noqa: E402

SUITE = """
import json, os
from pathlib import Path

def test_a_passes():
    assert 1 + 1 == 2

def test_b_sees_a_reported():
    report = json.loads(Path(os.environ["PARITY_OUT"]).read_text())
    assert report["complete"] is False
    assert report["passed"] == 1
    assert [k.split("::")[1] for k in report["tests"]] == ["test_a_passes"]

def test_c_fails():
    assert 1 + 1 == 3

def test_d_skips():
    import pytest
    pytest.skip("no device")
"""


def test_report_is_written_as_tests_finish(tmp_path, monkeypatch):
    (tmp_path / "test_standin.py").write_text(SUITE)
    out = tmp_path / "out" / "parity.json"
    monkeypatch.setenv("PARITY_OUT", str(out))
    monkeypatch.setattr(parity, "_environment", lambda: {"gpu": "stand-in"})
    collector = parity._Collector(out, 0.0)
    code = pytest.main(
        [str(tmp_path / "test_standin.py"), "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path)],
        plugins=[collector],
    )  # fmt: skip
    assert int(code) == 1
    partial = json.loads(out.read_text())
    assert partial["complete"] is False
    outcomes = {k.split("::")[1]: v["outcome"] for k, v in partial["tests"].items()}
    assert outcomes == {
        "test_a_passes": "passed",
        "test_b_sees_a_reported": "passed",
        "test_c_fails": "failed",
        "test_d_skips": "skipped",
    }
    counts = parity._write_report(out, collector.results, 1.0, int(code), True)
    final = json.loads(out.read_text())
    assert final["complete"] is True and final["pytest_exit_code"] == 1
    assert counts == {"passed": 2, "failed": 1, "skipped": 1}
    assert final["skipped_counted_as_failed"] == 1
    assert not list(out.parent.glob("*.tmp"))
