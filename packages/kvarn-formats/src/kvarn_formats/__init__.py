"""KVarN KV-cache formats: the dtype grammar, exact record layouts and capacity maths.

Pure Python with no dependencies; importing it loads neither torch nor numpy.
"""

from importlib.metadata import PackageNotFoundError, version

from .bitpack import pack_codes, packed_size, unpack_codes
from .capacity import (
    baseline_bytes_per_token,
    compression_ratio,
    exact_pool_bytes_per_request,
    packed_bytes_per_block,
    tokens_that_fit,
)
from .grammar import (
    BITS,
    DENSE_GROUPS,
    MLA_GROUPS,
    DenseFormat,
    Format,
    FormatError,
    MlaFormat,
    all_format_names,
    nearest_format_name,
    parse_format,
)
from .layouts import (
    DENSE_HEAD_DIMS,
    STAGED_MLA_FP8,
    Field,
    LayoutError,
    RecordLayout,
    dense_layout,
    layout_for,
    layout_from_dict,
    layout_from_json,
    mla_layout,
)

FORMAT_API = 1
"""Bumped on any change a consumer can see: a field's name, offset, dtype or meaning, the
grammar, or a public function's signature. Consumers check it in their ``_compat.py``."""

try:
    __version__ = version("kvarn-formats")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"

__all__ = [
    "BITS",
    "DENSE_GROUPS",
    "DENSE_HEAD_DIMS",
    "FORMAT_API",
    "MLA_GROUPS",
    "STAGED_MLA_FP8",
    "DenseFormat",
    "Field",
    "Format",
    "FormatError",
    "LayoutError",
    "MlaFormat",
    "RecordLayout",
    "__version__",
    "all_format_names",
    "baseline_bytes_per_token",
    "compression_ratio",
    "dense_layout",
    "exact_pool_bytes_per_request",
    "layout_for",
    "layout_from_dict",
    "layout_from_json",
    "mla_layout",
    "nearest_format_name",
    "pack_codes",
    "packed_bytes_per_block",
    "packed_size",
    "parse_format",
    "tokens_that_fit",
    "unpack_codes",
]
