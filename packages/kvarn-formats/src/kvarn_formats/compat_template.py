"""The import-time compatibility check that every consumer of kvarn-formats copies.

kvarn-ops, kvarn-cutedsl and kvarn-vllm each keep a copy of :func:`check_formats` in their
own ``_compat.py`` (a copy, not an import: the check must work, and say something useful,
even when the installed kvarn-formats is too old to have this module). Each copy declares
``FORMATS_MIN``, ``FORMATS_MAX`` and ``FORMAT_API_MIN`` equal to its pyproject pin
``kvarn-formats>=FORMATS_MIN,<FORMATS_MAX``; a test in each consumer parses the pyproject and
checks that they agree. It runs before any heavy import (torch, triton, vllm).
"""

from __future__ import annotations

import re
from importlib import metadata


def version_tuple(text: str) -> tuple[int, ...]:
    """``"1.2.3rc1"`` -> ``(1, 2, 3)``: the leading numeric release segment."""
    parts = []
    for piece in text.split("."):
        m = re.match(r"[0-9]+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def check_formats(consumer: str, minimum: str, maximum: str, api_minimum: int) -> None:
    """Raise ImportError naming the fix unless minimum <= kvarn-formats < maximum.

    Parameters
    ----------
    consumer : str
        The distribution doing the check, for the message (e.g. ``"kvarn-ops"``).
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
    have = version_tuple(installed)
    if not version_tuple(minimum) <= have < version_tuple(maximum):
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
