"""Checks, at import and before torch is imported, that the installed kvarn-formats is one
this package was tested with. The range below must equal the pin in pyproject.toml (a test
parses it)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

FORMATS_MIN = "1.0"
"""Lowest kvarn-formats release supported (inclusive)."""
FORMATS_MAX = "2"
"""First kvarn-formats release not supported (exclusive)."""
FORMAT_API_MIN = 1
"""Lowest ``kvarn_formats.FORMAT_API`` whose layouts and functions this package uses."""

_FIX = f"pip install 'kvarn-formats>={FORMATS_MIN},<{FORMATS_MAX}'"


def _release(text: str) -> tuple[int, ...]:
    """Numeric release tuple of a version string ("1.2.0rc1" -> (1, 2, 0))."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def _pad(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (4 - len(v))


def check_formats(installed: str | None = None, format_api: int | None = None) -> None:
    """Raise ImportError naming the fix when kvarn-formats is missing or out of range.

    Parameters
    ----------
    installed, format_api
        Override the installed version / FORMAT_API (for tests); by default they are read
        from the installed distribution and module.
    """
    if installed is None:
        try:
            installed = version("kvarn-formats")
        except PackageNotFoundError:
            raise ImportError(
                f"kvarn-ops needs kvarn-formats, which is not installed: {_FIX}"
            ) from None
    rel = _release(installed)
    if not rel or not (_pad(_release(FORMATS_MIN)) <= _pad(rel) < _pad(_release(FORMATS_MAX))):
        raise ImportError(
            f"kvarn-ops needs kvarn-formats >={FORMATS_MIN},<{FORMATS_MAX}, found "
            f"{installed}: {_FIX}"
        )
    if format_api is None:
        import kvarn_formats

        format_api = getattr(kvarn_formats, "FORMAT_API", None)
    if not isinstance(format_api, int) or format_api < FORMAT_API_MIN:
        raise ImportError(
            f"kvarn-ops needs kvarn_formats.FORMAT_API >= {FORMAT_API_MIN}, found "
            f"{format_api!r} (kvarn-formats {installed}): {_FIX}"
        )
