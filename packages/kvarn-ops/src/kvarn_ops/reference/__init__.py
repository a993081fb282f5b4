"""Plain-torch reference of every kvarn op: the source of truth for the Triton kernels and the
CPU fallback. fp32 maths (fp64 where it is an oracle), written for clarity.

Ops with the signatures of docs/contracts.md (write into the caller's outputs):
``rotate``, ``store``, ``flush``, ``decode``, ``materialize``. Building blocks: Hadamard
(``hadamard``, ``hadamard_matrix``), bit packing (``pack_codes``, ``unpack_codes``), tile
quantization (``quantize_tiles`` and friends, ``NormalizeConfig``), whole records
(``encode_records``, ``decode_records``, ``record_fields``, ``field_bytes``), the dense
attention oracle (``attention_oracle``) and ``gather_context``.
"""

from kvarn_ops.reference.bitpack import pack_codes, packed_bytes, unpack_codes
from kvarn_ops.reference.cache import (
    flush,
    gather_context,
    materialize,
    quantize_pool_tokens,
    read_pool_blocks,
    store,
)
from kvarn_ops.reference.decode import (
    MAX_GQA,
    MAX_QUERY_ROWS,
    MAX_QUERY_TOKENS,
    OPERAND_PRECISIONS,
    attention_oracle,
    decode,
)
from kvarn_ops.reference.hadamard import hadamard, hadamard_matrix, rotate
from kvarn_ops.reference.quantize import (
    DEFAULT_CONFIG,
    PUBLISHED_CONFIG,
    NormalizeConfig,
    QuantizedTiles,
    dequantize_k,
    dequantize_tiles,
    dequantize_v,
    normalize_tiles,
    quantize_k,
    quantize_rows,
    quantize_tiles,
    quantize_v,
    zero_nonfinite_tokens,
)
from kvarn_ops.reference.records import (
    FIELD_NAMES,
    decode_records,
    encode_records,
    field_bytes,
    fields_to_records,
    record_fields,
)

__all__ = [
    "DEFAULT_CONFIG",
    "FIELD_NAMES",
    "MAX_GQA",
    "MAX_QUERY_ROWS",
    "MAX_QUERY_TOKENS",
    "OPERAND_PRECISIONS",
    "PUBLISHED_CONFIG",
    "NormalizeConfig",
    "QuantizedTiles",
    "attention_oracle",
    "decode",
    "decode_records",
    "dequantize_k",
    "dequantize_tiles",
    "dequantize_v",
    "encode_records",
    "field_bytes",
    "fields_to_records",
    "flush",
    "gather_context",
    "hadamard",
    "hadamard_matrix",
    "materialize",
    "normalize_tiles",
    "pack_codes",
    "packed_bytes",
    "quantize_k",
    "quantize_pool_tokens",
    "quantize_rows",
    "quantize_tiles",
    "quantize_v",
    "read_pool_blocks",
    "record_fields",
    "rotate",
    "store",
    "unpack_codes",
    "zero_nonfinite_tokens",
]
