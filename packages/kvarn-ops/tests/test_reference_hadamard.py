"""Hadamard rotation against the explicit Sylvester matrix.

Tolerances (max abs error, inputs ~N(0, 1) or larger):
- FWHT fp32 vs matrix fp64: 2e-6 * max|x|; why: log2(D) <= 9 butterfly stages, each one fp32
  rounding of values that stay about |x| (the normalized transform preserves norms)
- FWHT fp64 vs matrix fp64: 1e-12 * max|x|; why: the same in fp64
- rotate into fp16 / bf16 out: rtol 2**-11 / 2**-8 of the exact value; why: one rounding of the
  output (half an ulp)
"""

from __future__ import annotations

import pytest
import torch

from kvarn_ops import reference as ref

DIMS = (64, 128, 256, 512)


@pytest.mark.parametrize("d", DIMS)
def test_matrix_is_symmetric_orthogonal_sylvester(d):
    h = ref.hadamard_matrix(d)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    # Sylvester recursion H_2n = [[H_n, H_n], [H_n, -H_n]] (entries scaled by 1/sqrt(2)).
    half = ref.hadamard_matrix(d // 2) / 2**0.5
    assert torch.allclose(h[: d // 2, : d // 2], half, atol=1e-15)
    assert torch.allclose(h[d // 2 :, d // 2 :], -half, atol=1e-15)


@pytest.mark.parametrize("d", DIMS)
def test_fwht_equals_matrix_product(gen, d):
    x = torch.randn(3, 5, d, generator=gen) * 4
    want = x.double() @ ref.hadamard_matrix(d)
    got = ref.hadamard(x)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 2e-6 * x.abs().max()
    got64 = ref.hadamard(x.double())
    assert got64.dtype == torch.float64
    assert (got64 - want).abs().max() <= 1e-12 * x.abs().max()
    # H is its own inverse.
    assert (ref.hadamard(got64) - x.double()).abs().max() <= 1e-12 * x.abs().max()


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize(
    "out_dtype,rtol", [(torch.float32, 0), (torch.float16, 2**-11), (torch.bfloat16, 2**-8)]
)
def test_rotate_writes_every_element(gen, d, out_dtype, rtol):
    x = torch.randn(7, 3, d, generator=gen)
    out = torch.full(x.shape, float("nan"), dtype=out_dtype)
    ref.rotate(x, out)
    want = x.double() @ ref.hadamard_matrix(d)
    assert torch.isfinite(out).all()
    assert ((out.double() - want).abs() <= rtol * want.abs() + 2e-6 * x.abs().max()).all()


def test_rotate_in_place_and_half_inputs(gen):
    x = torch.randn(4, 128, generator=gen).to(torch.bfloat16)
    want = x.double() @ ref.hadamard_matrix(128)
    ref.rotate(x, x)
    assert ((x.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()


@pytest.mark.parametrize(
    "make, arg, match",
    [
        (lambda: (torch.randn(2, 96), torch.empty(2, 96)), "x", "head_dim must be one of"),
        (lambda: (torch.randn(2, 64).double(), torch.empty(2, 64)), "x", "dtype"),
        (lambda: (torch.randn(64, 2).T, torch.empty(2, 64)), "x", "contiguous"),
        (lambda: (torch.randn(2, 64), torch.empty(3, 64)), "out", "shape"),
        (lambda: (torch.randn(2, 64), torch.empty(2, 64, dtype=torch.int32)), "out", "dtype"),
        (lambda: (torch.randn(2, 64), torch.empty(64, 2).T), "out", "contiguous"),
        (lambda: (torch.randn(2, 64), torch.empty(2, 64, device="meta")), "out", "meta"),
    ],
)
def test_rotate_rejects_bad_input(make, arg, match):
    x, out = make()
    with pytest.raises(ValueError, match=rf"^{arg}:.*{match}"):
        ref.rotate(x, out)
