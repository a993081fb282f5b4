"""The normalized Sylvester Hadamard rotation H_D (H = H^T = H^-1, no random signs).

Memory traffic of ``rotate``: read ``numel(x) * itemsize(x)``, write
``numel(out) * itemsize(out)``.
"""

from __future__ import annotations

import math

import torch

from kvarn_ops._validate import (
    DENSE_HEAD_DIMS,
    check_head_dim,
    check_not_partly_aliased,
    check_tensor,
)

__all__ = ["hadamard", "hadamard_matrix", "rotate"]


def hadamard_matrix(
    dim: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """The explicit normalized Sylvester matrix ``H_D`` (``[dim, dim]``).

    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``, scaled by ``dim ** -0.5``.
    Entry ``(i, j)`` is ``(-1) ** popcount(i & j) / sqrt(dim)``.
    """
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"dim: must be a power of two, got {dim}")
    idx = torch.arange(dim, device=device)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype) / math.sqrt(dim)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_D`` over the last dim by the fast Walsh-Hadamard transform.

    Parameters
    ----------
    x : Tensor [..., D], D in 64, 128, 256, 512 (any floating dtype)

    Returns
    -------
    Tensor [..., D], float64 for float64 input, else float32 (computed in that precision).
    """
    d = x.shape[-1]
    check_head_dim("x", d)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work).reshape(-1, d)
    h = 1
    while h < d:
        # Butterfly on pairs (i, i + h) inside blocks of 2h: (a, b) -> (a + b, a - b).
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(d))).to(work)


def rotate(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ H_D`` over the last dim; writes ``out`` (cast to its dtype).

    Parameters
    ----------
    x : Tensor [..., D], float16, bfloat16 or float32, contiguous; D in 64, 128, 256, 512
    out : Tensor, same shape as ``x``, float16, bfloat16 or float32, contiguous, same device.
        May be ``x`` itself; any other overlap with ``x`` is refused (as the kernel does).
    """
    check_tensor("x", x, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if x.dim() < 1 or x.shape[-1] not in DENSE_HEAD_DIMS:
        check_head_dim("x", x.shape[-1] if x.dim() else 0)
    check_tensor(
        "out",
        out,
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        shape=tuple(x.shape),
        device=x.device,
    )
    check_not_partly_aliased("out", out, "x", x)
    out.copy_(hadamard(x))
