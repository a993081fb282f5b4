"""Pure-Python bit packing, the convention every KVarN codes field uses.

Codes form one little-endian bit stream: code ``i`` of width ``b`` occupies stream bits
``[i*b, (i+1)*b)``, least significant bit first, and stream bit ``j`` is bit ``j % 8`` of byte
``j // 8``. This covers every width from 1 to 8. These functions are for test vectors and
small dumps; kvarn-ops has the vectorized ones.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` codes of ``bits`` bits."""
    _check_bits(bits)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    return -(-count * bits // 8)


def pack_codes(codes: Sequence[int], bits: int) -> bytes:
    """Pack unsigned codes into the little-endian bit stream.

    >>> list(pack_codes([0, 1, 2, 3, 0, 1, 2, 3], 2))
    [228, 228]
    """
    _check_bits(bits)
    limit = 1 << bits
    stream = 0
    for i, code in enumerate(codes):
        if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code < limit:
            raise ValueError(f"codes[{i}] = {code!r} does not fit in {bits} bits")
        stream |= code << (i * bits)
    return stream.to_bytes(packed_size(len(codes), bits), "little")


def unpack_codes(data: bytes | bytearray | memoryview, bits: int, count: int) -> list[int]:
    """Inverse of :func:`pack_codes`: the first ``count`` codes of ``data``."""
    need = packed_size(count, bits)
    if len(data) < need:
        raise ValueError(f"data has {len(data)} bytes; {count} codes of {bits} bits need {need}")
    stream = int.from_bytes(bytes(data[:need]), "little")
    mask = (1 << bits) - 1
    return [(stream >> (i * bits)) & mask for i in range(count)]
