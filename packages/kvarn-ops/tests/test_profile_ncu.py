"""The Nsight Compute summary of ``benchmarks/profile_ncu.py`` on a real report: the raw page
of the decode kernel profiled on the H200 (``results/ncu_h200_2026-11-30_csv.tar.gz``) must
give the committed summary's numbers, with units converted (us, GB/s) and the stall reasons
sorted."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import profile_ncu  # noqa: E402

RESULTS = BENCH / "results"


def _raw_page(op: str) -> str:
    with tarfile.open(RESULTS / "ncu_h200_2026-11-30_csv.tar.gz") as tar:
        member = tar.extractfile(f"ncu_{op}_raw.csv")
        assert member is not None
        return member.read().decode()


@pytest.mark.parametrize("op", ["decode_b32", "store", "flush"])
def test_summary_matches_committed_report(op):
    s = profile_ncu.summarize(profile_ncu._raw_metrics(_raw_page(op)))
    want = json.loads((RESULTS / "ncu_h200_2026-11-30.json").read_text())[op]
    for key, value in want.items():
        if key in ("what", "kernel"):
            continue
        assert s[key] == pytest.approx(value, rel=1e-12), key


def test_units_and_stall_order():
    s = profile_ncu.summarize(profile_ncu._raw_metrics(_raw_page("store")))
    # the raw page gives the duration in us and the DRAM rate in Tbyte/s for this kernel
    assert 80.0 < s["duration_us"] < 95.0
    assert 2000.0 < s["dram_gbps"] < 4000.0
    stalls = list(s["stalls_per_issue"].values())
    assert stalls == sorted(stalls, reverse=True) and len(stalls) > 10


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="--ops"):
        profile_ncu.main(["profile", "--out", "/nonexistent", "--ops", "decode_b32,bogus"])


def test_sass_mix_of_the_decode_source_page():
    with tarfile.open(RESULTS / "ncu_h200_2026-11-30_deep_csv.tar.gz") as tar:
        member = tar.extractfile("ncu_decode_b32_source.csv")
        assert member is not None
        mix = profile_ncu.sass_mix(member.read().decode(), top=1000)
    want = json.loads((RESULTS / "ncu_h200_2026-11-30_deep.json").read_text())["decode_b32"]
    for opcode, entry in want["sass_mix"].items():
        assert mix[opcode] == pytest.approx(entry, rel=1e-12), opcode
    shares = [e["stall_share"] for e in mix.values()]
    assert sum(shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True)
    # what BENCHMARKS.md reads off this page: the transposed ldmatrix of the code tiles has
    # half of its shared-memory wavefronts in excess (2-way bank conflicts)
    ldsm = mix["LDSM.16.MT88.4"]
    assert 0.45 < ldsm["shared_wavefronts_excessive"] / ldsm["shared_wavefronts"] < 0.55
