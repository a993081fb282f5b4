"""Runs the offline-compile tests (sm_90a and sm_120a, no GPU) in a separate pytest process
with the Triton interpreter off; see conftest.py for why they cannot share a process with the
interpreter tests. A failure there fails this test, with the child's output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Keep equal to OFFLINE_COMPILE_FILES in conftest.py (conftest is not importable by name).
OFFLINE_COMPILE_FILES = (
    "test_compile_decode.py",
    "test_compile_kernels.py",
    "test_compile_materialize.py",
)


@pytest.mark.slow
def test_offline_compiles_in_their_own_process(request):
    env = dict(os.environ, TRITON_INTERPRET="0", KVARN_OFFLINE_COMPILE_PROCESS="1")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"]
    if request.config.inipath is not None:
        args += ["-c", str(request.config.inipath), "--rootdir", str(HERE)]
    args += [str(HERE / name) for name in OFFLINE_COMPILE_FILES]
    proc = subprocess.run(args, cwd=HERE, env=env, capture_output=True, text=True, check=False)
    summary = proc.stdout.strip().splitlines()[-1:]
    print("\n".join(summary))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_opt_in_subnormal_decode_operands_compile(request):
    """``KVARN_DECODE_SUBNORMAL=1`` (read at import, so in its own process): the transposed
    dense decode kernel with subnormal code operands compiles for sm_90a and sm_120a with the
    instruction mix its compile test checks for that mode (no offset subtraction)."""
    env = dict(os.environ, TRITON_INTERPRET="0", KVARN_OFFLINE_COMPILE_PROCESS="1")
    env["KVARN_DECODE_SUBNORMAL"] = "1"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"]
    if request.config.inipath is not None:
        args += ["-c", str(request.config.inipath), "--rootdir", str(HERE)]
    args += [str(HERE / "test_compile_decode.py"), "-k", "transposed", "-s"]
    proc = subprocess.run(args, cwd=HERE, env=env, capture_output=True, text=True, check=False)
    print("\n".join(proc.stdout.strip().splitlines()[-1:]))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # the switch reached the kernels: every compiled case says so
    assert proc.stdout.count("subnormal code operands") == 10, proc.stdout[-3000:]
    assert "offset code operands" not in proc.stdout
