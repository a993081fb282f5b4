"""Bit packing of unsigned codes, vectorized over leading dims.

Convention (docs/contracts.md): one little-endian bit stream per codes field; code ``i`` of
width ``b`` occupies stream bits ``[i*b, (i+1)*b)``, least significant bit first; stream bit
``j`` is bit ``j % 8`` of byte ``j // 8``. A field of ``n`` codes takes ``ceil(n*b/8)`` bytes;
unused high bits of the last byte are zero.

Memory traffic: ``pack_codes`` reads ``n`` code bytes and writes ``ceil(n*b/8)`` bytes per
row; ``unpack_codes`` the reverse.
"""

from __future__ import annotations

import torch

from kvarn_ops._validate import check_tensor

__all__ = ["pack_codes", "packed_bytes", "unpack_codes"]

_INT_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits: must be an integer from 2 to 8, got {bits!r}")


def packed_bytes(count: int, bits: int) -> int:
    """Bytes taken by ``count`` codes of ``bits`` bits."""
    _check_bits(bits)
    return -(-count * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``[..., n]`` (integer dtype, values in ``[0, 2**bits)``) to uint8
    ``[..., ceil(n*bits/8)]``.

    Values are not range-checked here (callers produce clamped codes); bits above ``bits`` are
    dropped.
    """
    _check_bits(bits)
    check_tensor("codes", codes, dtypes=_INT_DTYPES, contiguous=False)
    if codes.dim() == 0:
        raise ValueError("codes: expected at least one dimension, got a scalar")
    n = codes.shape[-1]
    nbytes = packed_bytes(n, bits)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    # [..., n, bits] stream bits, LSB first, then flattened into the stream.
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    stream = stream.reshape(*codes.shape[:-1], n * bits)
    pad = nbytes * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    packed = (stream.reshape(*codes.shape[:-1], nbytes, 8) * weights).sum(-1)
    return packed.to(torch.uint8)


def unpack_codes(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``count`` codes of uint8 ``data [..., nbytes]``
    as uint8 ``[..., count]``."""
    _check_bits(bits)
    check_tensor("data", data, dtypes=torch.uint8, contiguous=False)
    need = packed_bytes(count, bits)
    if data.dim() == 0 or data.shape[-1] < need:
        raise ValueError(
            f"data: {count} codes of {bits} bits need {need} bytes in the last dim, got shape "
            f"{list(data.shape)}"
        )
    lead = data.shape[:-1]
    if 8 % bits == 0:
        # 2, 4, 8 bits: whole codes in each byte, code ``i`` of byte ``j`` is stream code
        # ``j * 8 / bits + i`` (the same stream, without expanding it into bits)
        shifts = torch.arange(0, 8, bits, device=data.device, dtype=torch.uint8)
        codes = (data[..., :need].unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*lead, need * (8 // bits))[..., :count].contiguous()
    shifts8 = torch.arange(8, device=data.device, dtype=torch.int32)
    stream = (data[..., :need].to(torch.int32).unsqueeze(-1) >> shifts8) & 1
    stream = stream.reshape(*lead, need * 8)[..., : count * bits].reshape(*lead, count, bits)
    weights = 1 << torch.arange(bits, device=data.device, dtype=torch.int32)
    return (stream * weights).sum(-1).to(torch.uint8)
