"""CuTe DSL decode against kvarn_ops.reference.decode and the Triton decode, on a CUDA GPU.

Run on the GPU machine (no DSL compiler needed there, only the AOT artifacts)::

    KVARN_CUTEDSL_AOT_DIR=packages/kvarn-cutedsl/build/aot/sm_90a \
    PYTHONPATH=packages/kvarn-formats/src:packages/kvarn-ops/src:packages/kvarn-cutedsl/src \
    python -m pytest -q packages/kvarn-cutedsl/gpu/test_cutedsl_parity.py

Tolerance (the flash-attention rule, as the dense gpu_parity suite): err(kernel vs fp64
oracle) <= 2 * err(fp32 reference rounded to the output dtype vs fp64 oracle) + 2e-3. The
kernel accumulates in fp32 and scales q by fp16 scales in fp32; its only extra error source
is ``ex2.approx`` (2 ulp) in the softmax.
Every output is poisoned (0xFF bytes, NaN) before the call; every input is fresh random.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # pragma: no cover
    pytest.fail("the CuTe DSL parity suite needs a CUDA GPU", pytrace=False)

import kvarn_cutedsl
import kvarn_formats as kf
from kvarn_cutedsl import _capability as cap
from kvarn_ops import kernels, reference

DEVICE = torch.device("cuda")
DECODE_ATOL = 2e-3

GEOMETRIES = [  # (Hq, Hkv, D): the dense gpu_parity suite's
    (32, 8, 128),
    (64, 8, 128),
    (9, 3, 64),
    (16, 4, 256),
    (8, 8, 64),
]
# (format, geometry, seq_lens, T, q dtype, pool dtype): the dense gpu_parity cases the kernel
# implements, then the same geometries with the dtypes / T it implements.
SUPPORTED = [
    ("kvarn_k4v2_g64", 0, [1, 63, 64, 65, 1000, 4113], 1, torch.bfloat16, torch.bfloat16),
    ("kvarn_k4v2_g64", 0, [32768], 1, torch.bfloat16, torch.bfloat16),
    ("kvarn_k4v2_g64", 0, [4096 + 7] * 64, 1, torch.bfloat16, torch.bfloat16),
    ("kvarn_k4v4_g64", 0, [131072 + 5], 1, torch.bfloat16, torch.bfloat16),
    ("kvarn_k4v4_g128", 1, [700, 128, 129, 9000], 1, torch.float16, torch.float16),
    ("kvarn_k4v4_g64", 2, [3, 64, 200, 2049], 1, torch.float16, torch.float16),
    ("kvarn_k4v2_g128", 4, [130, 5000, 1], 1, torch.bfloat16, torch.float16),
    ("kvarn_k4v2_g64", 0, [2, 64, 65, 66, 3000], 2, torch.bfloat16, torch.bfloat16),
]
# Dense gpu_parity cases the kernel refuses, and why.
REFUSED = [
    ("kvarn_k4v2_g64", 0, [131072 + 5], 1, torch.bfloat16, torch.float8_e4m3fn),  # fp8 pool
    ("kvarn_k4v4_g128", 1, [700, 128], 4, torch.float16, torch.float16),  # T*GQA = 32 > 8
    ("kvarn_k4v4_g64", 2, [3, 64], 1, torch.float16, torch.float8_e4m3fn),  # fp8 pool
    ("kvarn_k2v2_g128", 3, [130], 8, torch.bfloat16, torch.bfloat16),  # K bits 2, D 256
    ("kvarn_k5v3_g64", 4, [65], 2, torch.bfloat16, torch.float16),  # K 5 / V 3 bits
    ("kvarn_k8v8_g32", 0, [31], 1, torch.float16, torch.bfloat16),  # 8 bits, g32
]


@pytest.fixture
def gen(request) -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    return g


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("nan")
    return float((x64 - r64).norm() / r64.norm().clamp_min(1e-300))


def poison_(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF)
    return t


def realistic_kv(gen, shape):
    d = shape[-1]
    x = torch.randn(shape, generator=gen, device=DEVICE)
    chan = torch.exp(torch.randn(d, generator=gen, device=DEVICE) * 1.2)
    chan[torch.randperm(d, generator=gen, device=DEVICE)[: max(1, d // 32)]] *= 8
    return x * chan


def build_cache(gen, fmt, d, hkv, lens, pool_dtype):
    """Random records (random codes, valid random fp16 scale fields: decode must compute the
    record formula for any record), the partial block of each request in the exact pool;
    physical and pool blocks shuffled; unused table entries point at a real block."""
    layout = kf.dense_layout(fmt, d)
    g = layout.block_size
    b = len(lens)
    n_full = [n // g for n in lens]
    max_blocks = max(1, max(-(-n // g) for n in lens))
    num_blocks = sum(n_full) + 3
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    packed = torch.randint(
        0,
        256,
        (num_blocks, hkv, layout.record_bytes),
        generator=gen,
        device=DEVICE,
        dtype=torch.uint8,
    )
    half = packed.view(torch.float16)
    ranges = {
        "k_col_scale": (0.02, 0.3),
        "k_row_scale": (0.5, 2.0),
        "v_col_scale": (0.02, 0.3),
        "v_row_scale": (0.5, 2.0),
        "k_zero_point": (-1.0, 1.0),
        "v_zero_point": (-1.0, 1.0),
    }
    for name, (lo, hi) in ranges.items():
        f = layout.field(name)
        n = f.size // 2
        vals = lo + (hi - lo) * torch.rand(num_blocks, hkv, n, generator=gen, device=DEVICE)
        half[..., f.offset // 2 : f.offset // 2 + n] = vals.half()
    shape = (b + 3, g, hkv, d)
    ek = realistic_kv(gen, shape).to(pool_dtype)
    ev = realistic_kv(gen, shape).to(pool_dtype)
    fp8 = pool_dtype == torch.float8_e4m3fn
    ks = torch.ones(shape[:3], device=DEVICE) if fp8 else None
    vs = torch.ones(shape[:3], device=DEVICE) if fp8 else None
    table = torch.full((b, max_blocks), int(perm[0]), dtype=torch.int32, device=DEVICE)
    tail = torch.randperm(b + 3, generator=gen, device=DEVICE).to(torch.int32)[:b].contiguous()
    used = 0
    for r, nf in enumerate(n_full):
        table[r, :nf] = perm[used : used + nf]
        used += nf
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return (packed, table, seq, ek, ev, ks, vs, tail, layout)


def run_cutedsl(q, args, scale):
    b, t, hq, d = q.shape
    ws = kvarn_cutedsl.decode_workspace(
        b, t, hq, args[0].shape[1], d, int(args[2].max()), args[8].block_size, device=DEVICE
    )
    out = poison_(torch.empty_like(q))
    kvarn_cutedsl.decode(q, *args, scale, out, ws)
    torch.cuda.synchronize()
    return out


def test_device_is_validated():
    assert cap.device_arch() in cap.VALIDATED_ARCHS, cap.device_arch()


@pytest.mark.parametrize("case", range(len(SUPPORTED)))
def test_decode_parity(gen, case):
    fmt, geo, lens, t, q_dtype, pool_dtype = SUPPORTED[case]
    hq, hkv, d = GEOMETRIES[geo]
    args = build_cache(gen, fmt, d, hkv, lens, pool_dtype)
    q = torch.randn(len(lens), t, hq, d, generator=gen, device=DEVICE).to(q_dtype)
    scale = 1 / math.sqrt(d)
    out = run_cutedsl(q, args, scale)
    assert torch.isfinite(out.float()).all(), "unwritten (poisoned) or non-finite outputs"
    # computed in float64, stored in float32 (the reference's out accepts model dtypes only)
    oracle = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.decode(q, *args, scale, oracle, None, compute_dtype=torch.float64)
    ref32 = torch.empty_like(q)
    reference.decode(q, *args, scale, ref32, None)
    err = rel_err(out, oracle)
    bound = 2 * rel_err(ref32, oracle) + DECODE_ATOL
    # The Triton decode on the same inputs, held to the same bound.
    ws = kernels.decode_workspace(
        len(lens), t, hq, hkv, d, int(max(lens)), args[8].block_size, device=DEVICE
    )
    tri = poison_(torch.empty_like(q))
    kernels.decode(q, *args, scale, tri, ws)
    tri_err = rel_err(tri, oracle)
    print(
        f"{fmt} geo={geo} T={t}: cutedsl err {err:.2e}, triton err {tri_err:.2e}, bound {bound:.2e}"
    )
    assert err <= bound, f"decode error {err:.2e} > bound {bound:.2e} (triton {tri_err:.2e})"
    assert rel_err(out, tri) <= 2 * bound


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_refused_before_compile(gen, case):
    fmt, geo, lens, t, q_dtype, pool_dtype = REFUSED[case]
    hq, hkv, d = GEOMETRIES[geo]
    args = build_cache(gen, fmt, d, hkv, lens, pool_dtype)
    q = torch.randn(len(lens), t, hq, d, generator=gen, device=DEVICE).to(q_dtype)
    out = poison_(torch.empty_like(q))
    ws = torch.empty(64 * q.numel() + 64 * len(lens) * t * hq, device=DEVICE)
    with pytest.raises(NotImplementedError, match="supported|serves at most"):
        kvarn_cutedsl.decode(q, *args, 1 / math.sqrt(d), out, ws)
    assert torch.isnan(out.float()).all(), "a refused call wrote its output"


def test_cuda_graph_replay(gen):
    """Captured once, replayed with new queries and longer contexts: equal to eager calls."""
    hq, hkv, d = 32, 8, 128
    lens = [5000, 70, 20000, 640]
    args = build_cache(gen, "kvarn_k4v2_g64", d, hkv, [n + 40 for n in lens], torch.bfloat16)
    seq = args[2]
    seq.copy_(torch.tensor(lens, dtype=torch.int32))
    q = torch.randn(len(lens), 1, hq, d, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    ws = kvarn_cutedsl.decode_workspace(len(lens), 1, hq, hkv, d, 20100, 64, device=DEVICE)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(d)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            kvarn_cutedsl.decode(q, *args, scale, out, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvarn_cutedsl.decode(q, *args, scale, out, ws)
    for step in range(1, 4):
        q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE))
        seq.add_(step * 13)
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        eager = poison_(torch.empty_like(q))
        kvarn_cutedsl.decode(q, *args, scale, eager, ws)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {step} differs from an eager call"
        ref = torch.empty_like(q, dtype=torch.float32)
        reference.decode(q, *args, scale, ref, None, compute_dtype=torch.float64)
        assert rel_err(out, ref) < 2e-2
