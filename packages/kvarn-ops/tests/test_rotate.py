"""Triton rotate vs ``kvarn_ops.reference.rotate`` under the Triton interpreter.

Tolerances (kernel output vs the reference's output in the same dtype):

- float16, bfloat16: at most 1 ulp apart, on at most 2% of elements (ULP_FRACTION). The
  kernel sums in another order (matrix product, Kronecker split for D >= 256) than the
  reference's butterflies; the fp32 results differ by a few fp32 ulps, which flips the final
  rounding only near a tie. Results that cancel to near zero have ulps far below that fp32
  noise, so an element may also differ by up to FP32_RTOL * max abs (the fp32 bound below).
- float32: 4e-6 * max abs (FP32_RTOL): fp32 accumulation of up to 512 terms in another order
  (3-pass tf32 on the GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from kvarn_ops import reference as ref  # noqa: E402
from kvarn_ops.kernels import rotate  # noqa: E402

ULP_FRACTION = 0.02
FP32_RTOL = 4e-6


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers that are consecutive for adjacent representable values."""
    bits = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_close_to_reference(out: torch.Tensor, expect: torch.Tensor) -> None:
    assert out.dtype == expect.dtype
    if out.dtype == torch.float32:
        scale = expect.abs().max().clamp_min(1e-30)
        assert float((out - expect).abs().max() / scale) <= FP32_RTOL
        return
    diff = (ordered_bits(out) - ordered_bits(expect)).abs()
    scale = float(expect.float().abs().max())
    near_zero = (out.float() - expect.float()).abs() <= FP32_RTOL * scale
    bad = (diff > 1) & ~near_zero
    assert not bool(bad.any()), f"{int(bad.sum())} elements > 1 ulp (max {int(diff.max())})"
    assert float((diff > 0).float().mean()) <= ULP_FRACTION


CASES = [
    # (leading shape, D, x dtype, out dtype): irregular row counts, every D and dtype.
    ((3, 13), 64, torch.float16, torch.float16),
    ((37,), 64, torch.float32, torch.bfloat16),
    ((5, 7), 128, torch.bfloat16, torch.bfloat16),
    ((19,), 128, torch.float32, torch.float32),
    ((2, 3, 5), 256, torch.float16, torch.float32),
    ((41,), 256, torch.bfloat16, torch.float16),
    ((23,), 512, torch.bfloat16, torch.bfloat16),
    ((1, 17), 512, torch.float32, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{c[2]}-{c[3]}")
def test_rotate_matches_reference(case, gen):
    lead, d, xdt, odt = case
    x = (torch.randn(*lead, d, generator=gen) * torch.exp(torch.randn(d, generator=gen))).to(xdt)
    n = x.numel()
    # Output inside a NaN-poisoned buffer with guard bands on both sides.
    buf = torch.full((n + 2 * d,), float("nan"), dtype=odt)
    out = buf[d : d + n].view(x.shape)
    rotate(x, out)
    assert not bool(out.isnan().any()), "an output element was not written"
    assert bool(buf[:d].isnan().all()) and bool(buf[d + n :].isnan().all()), "guard band written"
    expect = torch.empty_like(out)
    ref.rotate(x, expect)
    assert_close_to_reference(out, expect)


def test_rotate_in_place_and_involution(gen):
    x = torch.randn(29, 128, generator=gen)
    y = x.clone()
    rotate(y, y)
    expect = torch.empty_like(x)
    ref.rotate(x, expect)
    assert_close_to_reference(y, expect)
    rotate(y, y)  # H is its own inverse
    assert float((y - x).abs().max()) < 1e-5


def test_rotate_nonfinite_rows_stay_in_their_row(gen):
    x = torch.randn(20, 64, generator=gen).to(torch.float16)
    x[3, 5] = float("inf")
    x[11, 0] = float("nan")
    out = torch.empty_like(x)
    rotate(x, out)
    bad_rows = out.isnan().any(1) | out.isinf().any(1)
    assert bad_rows.nonzero().flatten().tolist() == [3, 11]


def test_rotate_empty_is_a_no_op():
    rotate(torch.empty(0, 64), torch.empty(0, 64))


def test_rotate_is_a_registered_custom_op_with_fake_impl():
    with FakeTensorMode():
        x = torch.empty(4, 128, dtype=torch.bfloat16)
        torch.ops.kvarn.rotate(x, torch.empty_like(x))


@pytest.mark.parametrize(
    ("x", "out", "name"),
    [
        (torch.zeros(4, 64, dtype=torch.int32), torch.zeros(4, 64), "x"),
        (torch.zeros(4, 96), torch.zeros(4, 96), "x"),
        (torch.zeros(64, 4).t(), torch.zeros(4, 64), "x"),
        (torch.zeros(4, 64), torch.zeros(4, 128), "out"),
        (torch.zeros(4, 64), torch.zeros(4, 64, dtype=torch.float64), "out"),
        (torch.zeros(4, 64), torch.zeros(64, 4).t(), "out"),
        (torch.zeros(4, 64), torch.zeros(4, 64, device="meta"), "out"),
    ],
    ids=["dtype", "head_dim", "x-contiguity", "out-shape", "out-dtype", "out-contiguity", "device"],
)
def test_rotate_rejects_bad_input(x, out, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        rotate(x, out)
