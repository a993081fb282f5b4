"""Exact byte layouts of KVarN records.

A dense record holds one tile (G tokens) of one KV head; an MLA record holds one tile of
the latent cache; the staged fp8 MLA record holds one token. Every field starts on a
16-byte boundary and the record size is exact (no power-of-two rounding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .grammar import DenseFormat, FormatError, MlaFormat, parse_format

ALIGN = 16
"""Every field offset is a multiple of this many bytes."""
DENSE_HEAD_DIMS = (64, 128, 256, 512)
"""head_dim values with a dense layout (powers of two: the Hadamard rotation needs them)."""
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_GROUPS_WITH_LAYOUT = (64,)
SCHEMA_NAME = "kvarn-record-layout"
SCHEMA_VERSION = 1

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
"""Bytes per element of every non-code field dtype."""


class LayoutError(ValueError):
    """A format or head geometry that has no layout, or a layout description that is invalid."""


@dataclass(frozen=True)
class Field:
    """One named part of a record.

    ``dtype`` is ``"codes"`` for bit-packed unsigned codes (then ``bits`` is their width)
    or one of ``ELEMENT_BYTES``. ``shape`` is the logical shape, row-major.
    """

    name: str
    offset: int
    size: int
    dtype: str
    shape: tuple[int, ...]
    bits: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def count(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class RecordLayout:
    """The byte layout of one record.

    Attributes
    ----------
    format_name : str
        ``kvarn_...`` name, or ``"fp8_ds_mla"`` for the staged record.
    kind : str
        ``"dense"``, ``"mla"`` or ``"staged"``.
    head_dim : int
        D for dense; the latent dim (512) for MLA and staged records.
    rope_dim : int
        RoPE dims carried unquantized (MLA and staged), else 0.
    block_size : int
        Tokens per record (G; 1 for the staged record).
    record_bytes : int
        Exact size of one record.
    fields : tuple of Field
        In offset order.
    """

    format_name: str
    kind: str
    head_dim: int
    rope_dim: int
    block_size: int
    record_bytes: int
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        names = ", ".join(f.name for f in self.fields)
        raise KeyError(f"{self.format_name} has no field {name!r}; fields: {names}")

    @property
    def bytes_per_token(self) -> float:
        """Record bytes per token (per KV head for dense records)."""
        return self.record_bytes / self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "format": self.format_name,
            "kind": self.kind,
            "head_dim": self.head_dim,
            "rope_dim": self.rope_dim,
            "block_size": self.block_size,
            "record_bytes": self.record_bytes,
            "fields": [
                {
                    "name": f.name,
                    "offset": f.offset,
                    "size": f.size,
                    "dtype": f.dtype,
                    "shape": list(f.shape),
                    "bits": f.bits,
                }
                for f in self.fields
            ],
        }

    def to_json(self) -> str:
        """A self-describing JSON form; :func:`layout_from_json` loads it back."""
        return json.dumps(self.to_dict(), indent=2)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _build(
    parts: list[tuple[str, str, tuple[int, ...], int | None]],
) -> tuple[tuple[Field, ...], int]:
    """Lay out (name, dtype, shape, bits) parts in order, each on a 16-byte boundary."""
    fields = []
    offset = 0
    for name, dtype, shape, bits in parts:
        count = 1
        for s in shape:
            count *= s
        if dtype == "codes":
            assert bits is not None
            size = -(-count * bits // 8)
        else:
            size = count * ELEMENT_BYTES[dtype]
        offset = _align(offset)
        fields.append(Field(name, offset, size, dtype, shape, bits))
        offset += size
    return tuple(fields), _align(offset)


def _as_format(fmt: str | DenseFormat | MlaFormat) -> DenseFormat | MlaFormat:
    if isinstance(fmt, str):
        return parse_format(fmt)
    if isinstance(fmt, (DenseFormat, MlaFormat)):
        # a format object built by hand is checked as its name would be (bits, group)
        return parse_format(fmt.name)
    raise FormatError(f"expected a format name or a parsed format, got {type(fmt).__name__}")


def dense_layout(fmt: str | DenseFormat, head_dim: int) -> RecordLayout:
    """Layout of one dense record (one block of one KV head).

    Raises
    ------
    LayoutError
        For an MLA format or a head_dim without a layout.
    FormatError
        For an invalid name.
    """
    f = _as_format(fmt)
    if not isinstance(f, DenseFormat):
        raise LayoutError(f"{f.name} is an MLA format; use mla_layout() or layout_for()")
    if head_dim not in DENSE_HEAD_DIMS:
        allowed = ", ".join(map(str, DENSE_HEAD_DIMS))
        raise LayoutError(f"head_dim must be one of {allowed} for {f.name}, got {head_dim!r}")
    return _dense_record(f, int(head_dim))


@lru_cache(maxsize=256)
def _dense_record(f: DenseFormat, head_dim: int) -> RecordLayout:
    """The dense layout, cached after validation (layouts are immutable: frozen dataclasses
    of tuples); kernels' launchers ask for it on every call."""
    d, g = head_dim, f.group
    fields, size = _build(
        [
            ("k_codes", "codes", (d, g), f.k_bits),
            ("k_col_scale", "float16", (d,), None),
            ("k_zero_point", "float16", (d,), None),
            ("k_row_scale", "float16", (g,), None),
            ("v_codes", "codes", (g, d), f.v_bits),
            ("v_col_scale", "float16", (d,), None),
            ("v_row_scale", "float16", (g,), None),
            ("v_zero_point", "float16", (g,), None),
        ]
    )
    return RecordLayout(f.name, "dense", d, 0, g, size, fields)


def mla_layout(
    fmt: str | MlaFormat, latent_dim: int = MLA_LATENT_DIM, rope_dim: int = MLA_ROPE_DIM
) -> RecordLayout:
    """Layout of one MLA tile, byte-identical to the published port's tiles.

    Raises
    ------
    LayoutError
        For a dense format, a group other than 64, or a geometry other than 512 + 64.
    """
    f = _as_format(fmt)
    if not isinstance(f, MlaFormat):
        raise LayoutError(f"{f.name} is a dense format; use dense_layout() or layout_for()")
    if f.group not in MLA_GROUPS_WITH_LAYOUT:
        raise LayoutError(
            f"{f.name}: MLA layouts exist only for g64 (128-token MLA tiles are not "
            f"implemented); use kvarn_mla_k{f.bits}_g64"
        )
    if (latent_dim, rope_dim) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
        raise LayoutError(
            f"MLA layouts need latent_dim={MLA_LATENT_DIM} and rope_dim={MLA_ROPE_DIM}, "
            f"got latent_dim={latent_dim!r}, rope_dim={rope_dim!r}"
        )
    return _mla_record(f)


@lru_cache(maxsize=64)
def _mla_record(f: MlaFormat) -> RecordLayout:
    """The MLA layout (512 + 64), cached after validation like :func:`_dense_record`."""
    latent_dim, rope_dim, g = MLA_LATENT_DIM, MLA_ROPE_DIM, f.group
    fields, size = _build(
        [
            ("codes", "codes", (latent_dim, g), f.bits),
            ("col_scale", "float16", (latent_dim,), None),
            ("zero_point", "float16", (latent_dim,), None),
            ("row_scale", "float16", (g,), None),
            ("rope", "bfloat16", (g, rope_dim), None),
        ]
    )
    return RecordLayout(f.name, "mla", latent_dim, rope_dim, g, size, fields)


def _staged_mla_fp8() -> RecordLayout:
    fields, size = _build(
        [
            ("latent", "float8_e4m3fn", (MLA_LATENT_DIM,), None),
            ("scales", "float32", (MLA_LATENT_DIM // 128,), None),
            ("rope", "bfloat16", (MLA_ROPE_DIM,), None),
        ]
    )
    return RecordLayout("fp8_ds_mla", "staged", MLA_LATENT_DIM, MLA_ROPE_DIM, 1, size, fields)


STAGED_MLA_FP8 = _staged_mla_fp8()
"""The 656-byte per-token fp8 record read by sparse-MLA decode kernels: e4m3 latent (after a
bf16 round, clamped to +-448 after scaling), four fp32 scales (amax/448 per 128 dims, 1.0
when amax is 0), bf16 RoPE."""


def layout_for(fmt: str | DenseFormat | MlaFormat, head_dim: int | None = None) -> RecordLayout:
    """Layout of a dense (``head_dim`` required) or MLA (512 latent + 64 RoPE) format."""
    f = _as_format(fmt)
    if isinstance(f, MlaFormat):
        if head_dim not in (None, MLA_LATENT_DIM):
            raise LayoutError(f"{f.name} has latent dim {MLA_LATENT_DIM}, got head_dim={head_dim}")
        return mla_layout(f)
    if head_dim is None:
        raise LayoutError(f"{f.name} is a dense format: give head_dim (one of {DENSE_HEAD_DIMS})")
    return dense_layout(f, head_dim)


_DOC_KEYS = (
    "schema",
    "schema_version",
    "format",
    "kind",
    "head_dim",
    "rope_dim",
    "block_size",
    "record_bytes",
    "fields",
)
_FIELD_KEYS = ("name", "offset", "size", "dtype", "shape", "bits")
_BAD = "malformed layout description"


def _check_doc(data: Any) -> None:
    """Exact keys and JSON types of a layout description (a float, a string or a bool where
    an integer belongs is refused, not converted)."""

    def integer(where: str, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool):
            raise LayoutError(f"{_BAD} {where}: expected an integer, got {v!r}")

    def keys(where: str, d: Any, want: tuple[str, ...]) -> None:
        if not isinstance(d, dict):
            raise LayoutError(f"{_BAD} {where}: expected an object, got {d!r}")
        extra = sorted(set(map(str, d)) - set(want))
        missing = [k for k in want if k not in d]
        if extra or missing:
            raise LayoutError(f"{_BAD} {where}: unknown keys {extra}, missing keys {missing}")

    keys("", data, _DOC_KEYS)
    for k in ("schema_version", "head_dim", "rope_dim", "block_size", "record_bytes"):
        integer(k, data[k])
    for k in ("schema", "format", "kind"):
        if not isinstance(data[k], str):
            raise LayoutError(f"{_BAD} {k}: expected a string, got {data[k]!r}")
    if not isinstance(data["fields"], list):
        raise LayoutError(f"{_BAD} fields: expected a list, got {data['fields']!r}")
    for i, f in enumerate(data["fields"]):
        keys(f"fields[{i}]", f, _FIELD_KEYS)
        for k in ("offset", "size"):
            integer(f"fields[{i}].{k}", f[k])
        if f["bits"] is not None:
            integer(f"fields[{i}].bits", f["bits"])
        if not isinstance(f["shape"], list):
            raise LayoutError(f"{_BAD} fields[{i}].shape: expected a list")
        for s in f["shape"]:
            integer(f"fields[{i}].shape", s)
        for k in ("name", "dtype"):
            if not isinstance(f[k], str):
                raise LayoutError(f"{_BAD} fields[{i}].{k}: expected a string")


def layout_from_dict(data: dict[str, Any]) -> RecordLayout:
    """Load a layout description, checking it equals the layout this library computes.

    Raises
    ------
    LayoutError
        An unknown or missing key, a value of the wrong JSON type, another schema or version,
        or a layout other than the one computed for its format.
    """
    _check_doc(data)
    try:
        if data["schema"] != SCHEMA_NAME:
            raise LayoutError(f"not a {SCHEMA_NAME} document: schema={data['schema']!r}")
        if data["schema_version"] != SCHEMA_VERSION:
            raise LayoutError(
                f"schema_version {data['schema_version']!r} is not supported "
                f"(this kvarn-formats reads version {SCHEMA_VERSION})"
            )
        fields = tuple(
            Field(
                str(f["name"]),
                int(f["offset"]),
                int(f["size"]),
                str(f["dtype"]),
                tuple(int(s) for s in f["shape"]),
                None if f["bits"] is None else int(f["bits"]),
            )
            for f in data["fields"]
        )
        loaded = RecordLayout(
            str(data["format"]),
            str(data["kind"]),
            int(data["head_dim"]),
            int(data["rope_dim"]),
            int(data["block_size"]),
            int(data["record_bytes"]),
            fields,
        )
    except (KeyError, TypeError) as exc:
        raise LayoutError(f"malformed layout description: missing or bad {exc}") from exc
    if loaded.kind == "staged":
        expected = STAGED_MLA_FP8
    else:
        try:
            expected = layout_for(loaded.format_name, loaded.head_dim)
        except FormatError as exc:
            raise LayoutError(f"layout description names an invalid format: {exc}") from exc
    if loaded != expected:
        raise LayoutError(
            f"layout description of {loaded.format_name} (head_dim {loaded.head_dim}) does not "
            "match the layout this kvarn-formats computes; the record was written by an "
            "incompatible version"
        )
    return loaded


def layout_from_json(text: str) -> RecordLayout:
    """Inverse of :meth:`RecordLayout.to_json`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutError(f"layout description is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LayoutError("layout description must be a JSON object")
    return layout_from_dict(data)
