"""The record-order 4-bit K unpack of the transposed MMA decode kernel
(``decode_mma_rec._nibbles4``), on the CPU: its PTX block executed by the emulator of
``test_mla_wgmma_unpack`` on every 16-bit value a register half can hold.

``ldmatrix.trans`` hands each lane 32-bit registers whose halves hold four consecutive tokens'
nibbles of one channel (bits 0-3, 4-7, 8-11, 12-15). The unpack must return them as the exact
fp16 values ``c``, ``16 c``, ``c``, ``16 c`` (the kernel's odd token rows take 1/16 of the row
scale and 16 times the zero-point start): every nibble of every value, in both halves,
without leaking into its neighbours."""

from __future__ import annotations

import numpy as np
import pytest

from kvarn_ops.kernels import decode_mma_rec as RK
from test_mla_wgmma_unpack import instructions, run_ptx

_HALF = np.arange(1 << 16, dtype=np.uint64)


def _registers(seed: int) -> np.ndarray:
    """Every 16-bit value in the low half, a shuffled copy of them in the high half."""
    hi = np.random.default_rng(seed).permutation(_HALF)
    return _HALF | (hi << np.uint64(16))


def _halves(out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = (out & np.uint64(0xFFFF)).astype(np.uint16)
    hi = (out >> np.uint64(16)).astype(np.uint16)
    return lo, hi


@pytest.mark.parametrize("seed", [0, 1])
def test_nibbles4_is_every_code_exactly(seed):
    x = _registers(seed)
    outs = run_ptx(RK.NIBBLES4_ASM, [x], outputs=4)
    for half, word in enumerate(_halves(x)):
        for k, out in enumerate(outs):
            value = _halves(out)[half].view(np.float16).astype(np.float64)
            code = (word.astype(np.int64) >> (4 * k)) & 15
            np.testing.assert_array_equal(value, code * (16 if k % 2 else 1))


def test_nibbles4_uses_only_known_instructions():
    """The emulator knows every instruction of the block (it fails on any other): one shift,
    four masks into the mantissa of 1024.0, four exact subtractions of 1024."""
    ops = [op for op, _ in instructions(RK.NIBBLES4_ASM)]
    assert ops.count("shr.b32") == 1 and ops.count("lop3.b32") == 4
    assert ops.count("sub.f16x2") == 4 and set(ops) == {
        "mov.b32",
        "shr.b32",
        "lop3.b32",
        "sub.f16x2",
    }
