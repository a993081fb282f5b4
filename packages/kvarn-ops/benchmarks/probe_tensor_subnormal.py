"""How exactly the tensor cores take fp16 subnormal code operands.

The dense MMA decode kernels turn 4-bit codes into exact fp16 operands by masking them into
the mantissa of 1024.0 and subtracting 1024 (``decode_mma._nibble_pairs``). Masked with a zero
exponent instead, a code field at bits ``s .. s + 3`` is the exact subnormal ``c * 2^(s - 24)``
and needs no subtraction. This probe asks whether a matrix product takes such operands as it
takes the same codes as normal numbers: for fresh random codes ``c`` (0..15) at each field
position ``s``, partners ``b`` of three kinds (``normal``: N(0, 1); ``wide``: log-uniform
magnitudes 2^-26 .. 2^4 with random signs, subnormals included; ``lo``: the low fp16 parts of
split fp32 values, like the kernels' score operand) and fp32 accumulators ``c0``, it computes
``D = A B + C`` with Triton's ``tl.dot`` twice, from ``A = c 2^s`` (normal) and from ``A = c
2^(s - 24)`` with ``C`` scaled alike (``mma.sync`` at one warp, ``wgmma`` at four), and
reports for both the largest error against float64, relative to each product's largest
magnitude, and how many results differ bit for bit after the exact rescaling by ``2^24``.

Measured on an H100 (BENCHMARKS.md "2026-12-07, night"): never bit-identical, and at ``s = 0``
(``c * 2^-24``) up to 2.5-10x the normal operands' error; the excess halves with each bit the
field moves up and is gone from ``s = 4`` (``c * 2^-20``).

    python benchmarks/probe_tensor_subnormal.py --out results/tensor_subnormal.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, d_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + pid * M * K + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + pid * K * N + k[:, None] * N + n[None, :])
    c = tl.load(c_ptr + pid * M * N + m[:, None] * N + n[None, :])
    tl.store(d_ptr + pid * M * N + m[:, None] * N + n[None, :], tl.dot(a, b, acc=c))


def partners(p: int, k: int, n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """fp16 B operands [p, k, n] of one kind (see the module docstring)."""
    if kind == "normal":
        x = torch.randn(p, k, n, generator=g)
    elif kind == "wide":
        e = torch.rand(p, k, n, generator=g) * 30 - 26
        x = torch.sign(torch.randn(p, k, n, generator=g)) * torch.exp2(e)
    elif kind == "lo":
        mag = torch.exp2(torch.randint(-8, 3, (p, 1, n), generator=g).float())
        hi = torch.randn(p, k, n, generator=g) * mag
        x = hi - hi.half().float()
    else:
        raise ValueError(f"kind: unknown partner kind {kind!r}")
    return x.half()


def case(m: int, n: int, k: int, warps: int, kind: str, shift: int, p: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (p, m, k), generator=g).float() * 2.0**shift
    a_norm = codes.half()
    a_sub = (codes * 2.0**-24).half()
    if not torch.equal(a_sub.float() * 2.0**24, a_norm.float()):
        raise AssertionError("subnormal codes not exact in fp16")
    b = partners(p, k, n, kind, g)
    scale = torch.exp2(torch.randint(-10, 10, (p, 1, 1), generator=g).float())
    c = torch.randn(p, m, n, generator=g) * scale
    dev = [t.cuda().contiguous() for t in (a_norm, a_sub, b, c, c * 2.0**-24)]
    d_norm = torch.empty(p, m, n, device="cuda")
    d_sub = torch.empty_like(d_norm)
    _dot[(p,)](dev[0], dev[2], dev[3], d_norm, m, n, k, num_warps=warps)
    _dot[(p,)](dev[1], dev[2], dev[4], d_sub, m, n, k, num_warps=warps)
    d_sub = d_sub * 2.0**24
    exact = torch.einsum("pmk,pkn->pmn", a_norm.double(), b.double()) + c.double()
    top = exact.abs().amax(dim=(1, 2), keepdim=True) + 1e-300

    def err(d):
        return ((d.double().cpu() - exact) / top).abs().max().item()

    return dict(
        m=m, n=n, k=k, warps=warps, partners=kind, field_bit=shift, products=p,
        differ=int((d_norm != d_sub).sum().item()), of=d_norm.numel(),
        err_normal=err(d_norm), err_subnormal=err(d_sub),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--products", type=int, default=2048, help="independent products per case")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_tensor_subnormal: needs a CUDA GPU")
    rows = []
    for m, n, k, warps in ((16, 16, 128, 1), (64, 32, 128, 4)):  # mma.sync, wgmma
        for kind in ("normal", "wide", "lo"):
            for shift in range(7):
                rows.append(case(m, n, k, warps, kind, shift, a.products, len(rows) + 1))
                r = rows[-1]
                print(
                    f"m{m}n{n}k{k} w{warps} {kind:6s} field bit {shift}: "
                    f"differ {r['differ']:8d}/{r['of']}  err normal {r['err_normal']:.2e} "
                    f"subnormal {r['err_subnormal']:.2e}",
                    flush=True,
                )
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
