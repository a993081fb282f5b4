"""Import-time check that the installed kvarn-formats is one this package was tested with.

A copy of ``kvarn_formats/compat_template.py`` (a copy, not an import: it must work, and say
something useful, even when the installed kvarn-formats is too old to have that module). The
range below must equal the pin in pyproject.toml (a test parses it). Runs before torch or
the CuTe DSL is imported.
"""

from __future__ import annotations

import re
from importlib import metadata

FORMATS_MIN = "1.0"
"""Lowest kvarn-formats release supported (inclusive)."""
FORMATS_MAX = "2"
"""First kvarn-formats release not supported (exclusive)."""
FORMAT_API_MIN = 1
"""Lowest ``kvarn_formats.FORMAT_API`` whose layouts this package uses."""
CONSUMER = "kvarn-cutedsl"


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


def check_formats(
    consumer: str = CONSUMER,
    minimum: str = FORMATS_MIN,
    maximum: str = FORMATS_MAX,
    api_minimum: int = FORMAT_API_MIN,
) -> None:
    """Raise ImportError naming the fix unless minimum <= kvarn-formats < maximum."""
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
