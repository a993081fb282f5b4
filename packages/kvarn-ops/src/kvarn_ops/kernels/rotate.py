"""rotate: ``out = x @ H_D`` over the last dim (normalized Sylvester Hadamard, no signs).

Memory traffic: read ``numel(x) * itemsize(x)``, write ``numel(out) * itemsize(out)``.
The matrix is generated in registers (never read from memory); see ``_common.rotate_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_ops._validate import (
    DENSE_HEAD_DIMS,
    check_head_dim,
    check_not_partly_aliased,
    check_tensor,
)
from kvarn_ops.kernels._common import (
    cast_rne,
    check_device,
    exact_in_tf32,
    launch_or_op,
    rotate_rows,
)

__all__ = ["rotate"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rows_per_program(head_dim: int) -> int:
    """Rows of ``x`` per program: 16 is the smallest ``tl.dot`` M; more rows amortize building
    the sign matrix. Chosen so a program holds at most 4096 fp32 values of ``x`` (32 regs/thread
    at 4 warps). Not tuned on hardware yet."""
    return max(16, 4096 // head_dim)


@triton.jit
def _rotate_kernel(
    x_ptr, out_ptr, rows, D: tl.constexpr, BLOCK_M: tl.constexpr, EXACT_TF32: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = row < rows
    offs = row[:, None] * D + tl.arange(0, D)[None, :]
    # Upcast right after the load (bf16 arithmetic is wrong in the interpreter).
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    y = rotate_rows(x, BLOCK_M, D, EXACT_TF32)
    tl.store(out_ptr + offs, cast_rne(y, out_ptr.dtype.element_ty), mask=ok[:, None])


def _launch(x: torch.Tensor, out: torch.Tensor) -> None:
    # here, not in the launcher: under torch.compile only the op's body sees real memory
    check_not_partly_aliased("out", out, "x", x)
    d = x.shape[-1]
    rows = x.numel() // d
    if rows == 0:
        return
    block_m = rows_per_program(d)
    grid = (triton.cdiv(rows, block_m),)
    _rotate_kernel[grid](
        x, out, rows, D=d, BLOCK_M=block_m, EXACT_TF32=exact_in_tf32(x.dtype), num_warps=4
    )


@torch.library.custom_op("kvarn::rotate", mutates_args=("out",))
def _rotate_op(x: torch.Tensor, out: torch.Tensor) -> None:
    _launch(x, out)


@_rotate_op.register_fake
def _rotate_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def rotate(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ H_D`` over the last dim (Triton), cast to ``out``'s dtype.

    Parameters
    ----------
    x : Tensor [..., D], float16, bfloat16 or float32, contiguous; D in 64, 128, 256, 512.
    out : Tensor, same shape and device as ``x``, float16, bfloat16 or float32, contiguous.
        May be ``x`` itself (each program reads its rows before writing them); any other
        overlap with ``x`` is refused.

    Raises
    ------
    ValueError
        Naming the bad argument (dtype, shape, device, contiguity, head_dim).
    """
    check_tensor("x", x, dtypes=_FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] not in DENSE_HEAD_DIMS:
        check_head_dim("x", x.shape[-1] if x.dim() else 0)
    check_tensor("out", out, dtypes=_FLOAT_DTYPES, shape=tuple(x.shape), device=x.device)
    check_device(x)
    launch_or_op(_rotate_op, _launch, x, out)
