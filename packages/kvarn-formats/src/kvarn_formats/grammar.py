"""The KV-cache dtype grammar.

Dense formats are ``kvarn_k{K}v{V}_g{G}``; MLA (latent cache) formats are
``kvarn_mla_k{B}_g{G}``. Only canonical spellings parse, so
``parse_format(s).name == s`` for every accepted ``s``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

BITS = tuple(range(2, 9))
"""Code widths accepted for K, V and MLA latents."""
DENSE_GROUPS = (32, 64, 128)
"""Tokens per tile (the paged-cache block size) for dense formats."""
MLA_GROUPS = (64, 128)
"""Tokens per tile accepted by the MLA grammar (only 64 has a layout)."""

_MAX_NAME = 64
_DENSE_RE = re.compile(r"kvarn_k(?P<k>[0-9]+)v(?P<v>[0-9]+)_g(?P<g>[0-9]+)")
_MLA_RE = re.compile(r"kvarn_mla_k(?P<b>[0-9]+)_g(?P<g>[0-9]+)")


class FormatError(ValueError):
    """An invalid KV-cache format name. The only exception :func:`parse_format` raises."""


@dataclass(frozen=True)
class DenseFormat:
    """A dense (per KV head) KVarN format: K bits, V bits, tokens per tile."""

    k_bits: int
    v_bits: int
    group: int
    kind = "dense"

    @property
    def name(self) -> str:
        return f"kvarn_k{self.k_bits}v{self.v_bits}_g{self.group}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class MlaFormat:
    """An MLA (latent cache) KVarN format: latent code bits, tokens per tile."""

    bits: int
    group: int
    kind = "mla"

    @property
    def name(self) -> str:
        return f"kvarn_mla_k{self.bits}_g{self.group}"

    def __str__(self) -> str:
        return self.name


Format = DenseFormat | MlaFormat


@lru_cache(maxsize=1)
def all_format_names() -> tuple[str, ...]:
    """Every valid format name, sorted."""
    dense = [DenseFormat(k, v, g).name for k in BITS for v in BITS for g in DENSE_GROUPS]
    mla = [MlaFormat(b, g).name for b in BITS for g in MLA_GROUPS]
    return tuple(sorted(dense + mla))


def _number_after(text: str, letter: str) -> int | None:
    m = re.search(letter + r"0*([0-9]{1,6})", text)
    return int(m.group(1)) if m else None


def _nearest(value: int | None, allowed: tuple[int, ...], default: int) -> int:
    if value is None:
        return default
    return min(allowed, key=lambda a: (abs(a - value), a))


def nearest_format_name(text: str) -> str:
    """The valid name closest to ``text``.

    Reads the numbers after ``k``, ``v`` and ``g`` (case-insensitively) and moves each to the
    nearest allowed value; missing parts default to k4, v2 (dense) and g64.
    """
    probe = text.lower()[:_MAX_NAME]
    if "mla" in probe:
        rest = probe[probe.index("mla") + 3 :]
        bits = _nearest(_number_after(rest, "k"), BITS, 5)
        return MlaFormat(bits, _nearest(_number_after(rest, "g"), MLA_GROUPS, 64)).name
    rest = probe[probe.index("kvarn") + 5 :] if "kvarn" in probe else probe
    k_bits = _nearest(_number_after(rest, "k"), BITS, 4)
    v_bits = _nearest(_number_after(rest, "v"), BITS, 2)
    return DenseFormat(k_bits, v_bits, _nearest(_number_after(rest, "g"), DENSE_GROUPS, 64)).name


def _fail(text: str, problem: str) -> FormatError:
    shown = text if len(text) <= _MAX_NAME else text[:_MAX_NAME] + "..."
    return FormatError(
        f"unknown KV-cache dtype {shown!r}: {problem} (did you mean {nearest_format_name(text)!r}?)"
    )


def _check_bits(text: str, what: str, digits: str) -> int:
    allowed = ", ".join(map(str, BITS))
    if len(digits) > 1 and digits.startswith("0"):
        raise _fail(text, f"{what} bits must be written without leading zeros")
    if len(digits) > 3 or int(digits) not in BITS:
        raise _fail(text, f"{what} bits must be one of {allowed}, got {digits[:8]}")
    return int(digits)


def _check_group(text: str, digits: str, allowed: tuple[int, ...]) -> int:
    listed = ", ".join(map(str, allowed))
    if len(digits) > 1 and digits.startswith("0"):
        raise _fail(text, "group size must be written without leading zeros")
    if len(digits) > 4 or int(digits) not in allowed:
        raise _fail(text, f"group size (tokens per tile) must be one of {listed}, got {digits[:8]}")
    return int(digits)


def parse_format(text: object) -> Format:
    """Parse a KV-cache dtype name.

    Parameters
    ----------
    text : str
        ``kvarn_k{K}v{V}_g{G}`` (K, V in 2..8; G in 32, 64, 128) or
        ``kvarn_mla_k{B}_g{G}`` (B in 2..8; G in 64, 128).

    Returns
    -------
    DenseFormat or MlaFormat

    Raises
    ------
    FormatError
        For anything else, naming the wrong part, what is allowed and the nearest valid name.
    """
    if not isinstance(text, str):
        raise FormatError(f"a KV-cache dtype must be a string, got {type(text).__name__}")
    return _parse_name(text)


@lru_cache(maxsize=256)
def _parse_name(text: str) -> Format:
    """:func:`parse_format` of a string, cached: kernels' launchers parse their format on every
    call (formats are immutable; a name that fails raises every time, nothing is cached)."""
    if len(text) > _MAX_NAME:
        raise _fail(text, f"name is longer than {_MAX_NAME} characters")
    if not text.isascii() or not text.isprintable() or text != text.strip():
        raise _fail(text, "names are plain ASCII with no spaces or control characters")
    if text != text.lower():
        raise _fail(text, "names are lower case")
    if not text.startswith("kvarn_"):
        raise _fail(text, "names start with 'kvarn_'")
    if text.startswith("kvarn_mla"):
        m = _MLA_RE.fullmatch(text)
        if m is None:
            raise _fail(text, "MLA names have the form kvarn_mla_k{B}_g{G}")
        bits = _check_bits(text, "latent", m["b"])
        return MlaFormat(bits, _check_group(text, m["g"], MLA_GROUPS))
    m = _DENSE_RE.fullmatch(text)
    if m is None:
        raise _fail(text, "dense names have the form kvarn_k{K}v{V}_g{G}")
    k_bits = _check_bits(text, "K", m["k"])
    v_bits = _check_bits(text, "V", m["v"])
    return DenseFormat(k_bits, v_bits, _check_group(text, m["g"], DENSE_GROUPS))
