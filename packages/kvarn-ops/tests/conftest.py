"""Shared fixtures: a fresh random seed per test (printed, so a failure can be replayed with
KVARN_TEST_SEED=<seed>), and a builder of random paged caches through the reference ops."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvarn_formats as kf
from kvarn_ops import reference as ref

# Every kernel test here runs on the CPU through the Triton interpreter; set it before any
# module imports triton (the offline compiles run in their own process, see below).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The tensors here are small: intra-op threads cost more than they give, and on a busy
# 2-core machine they spin (measured: normalizing 6 tiles took 0.87 s with 2 threads under
# load, 0.024 s with 1). Override with KVARN_TEST_THREADS.
torch.set_num_threads(int(os.environ.get("KVARN_TEST_THREADS", "1")))

# The offline-compile tests import kernel modules with the interpreter off. In the same
# process as the interpreter tests, whichever mode imports a shared helper module first wins,
# and the other mode then fails ("Cannot call @triton.jit'd outside of the scope of a
# kernel"). So those files run in their own process (test_compile_offline.py), and are
# collected directly only there.
OFFLINE_COMPILE_FILES = (
    "test_compile_decode.py",
    "test_compile_kernels.py",
    "test_compile_materialize.py",
)


# Tests of the repository's tools beside tests/ (benchmarks/, gpu/), by the folder each needs:
# collected where the tools are, i.e. not where only tests/ is copied next to an installed
# wheel (`nox -s wheels`).
TOOL_TEST_FILES = {
    "test_profile_ncu.py": "benchmarks",
    "test_parity_report.py": "gpu",
    "test_probe_flush_columns.py": "benchmarks",
    "test_probe_decode_levers.py": "benchmarks",
    "test_probe_decode_fixed.py": "benchmarks",
    "test_probe_decode_compute.py": "benchmarks",
}
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def pytest_ignore_collect(collection_path, config):
    if collection_path.name in OFFLINE_COMPILE_FILES:
        return os.environ.get("KVARN_OFFLINE_COMPILE_PROCESS") != "1"
    if collection_path.name in TOOL_TEST_FILES:
        return not (_PACKAGE_DIR / TOOL_TEST_FILES[collection_path.name]).is_dir()
    return None


@pytest.fixture
def seed(request) -> int:
    env = os.environ.get("KVARN_TEST_SEED")
    value = int(env) if env else int.from_bytes(os.urandom(4), "little")
    # Captured output is shown for failing tests only.
    print(f"\n[{request.node.name}] seed={value} (replay: KVARN_TEST_SEED={value})")
    torch.manual_seed(value)
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A torch.Generator seeded from os.urandom (or KVARN_TEST_SEED)."""
    return torch.Generator().manual_seed(seed)


def realistic_kv(gen: torch.Generator, *shape_and_d: int) -> torch.Tensor:
    """Random K/V-like values ``[..., D]``: gaussian with log-normal per-channel scales, a few
    channel offsets and occasional large tokens (what keys and values look like before the
    rotation), float32."""
    *lead, d = shape_and_d
    x = torch.randn(*lead, d, generator=gen)
    chan = torch.exp(0.7 * torch.randn(d, generator=gen))
    offset = torch.where(
        torch.rand(d, generator=gen) < 0.05, 3.0 * torch.randn(d, generator=gen), torch.zeros(d)
    )
    tok = torch.exp(0.3 * torch.randn(*lead, 1, generator=gen))
    return (x * chan + offset) * tok


def assert_power_of_two_scaled(f1: dict, f2: dict, x1, x2, c: float, side: str) -> None:
    """``x2`` (decoded from fields ``f2``, the input times the power of two ``c``) equals
    ``x1 * c`` (decoded from ``f1``) exactly when no stored scale or zero point is subnormal.

    A zero point far below its row's step can be subnormal in fp16 (the rebalance keeps the
    row scales normal, not every zero point), and where the split puts it moves with the
    tile's magnitude: it then rounds on a different grid. Each value is then off by at most
    half a subnormal ulp (2^-25) of that zero point times its column-side scale, plus the
    decode's fp32 rounding. ``side`` "k" or "v"; fields as ``reference.record_fields`` or
    ``quantize_k`` / ``quantize_v`` name them."""
    subnormal = any(
        bool(((f[n].float().abs() < 2.0**-14) & (f[n] != 0)).any())
        for f in (f1, f2)
        for n in f
        if n.startswith(side + "_") and "codes" not in n
    )
    if not subnormal:
        assert torch.equal(x2, x1 * c), side
        return
    eps = torch.finfo(torch.float32).eps
    (code, s1, z1, w1), (_, s2, z2, w2) = _factors(f1, side), _factors(f2, side)
    mag1, mag2 = (code * s1 + z1) * w1, (code * s2 + z2) * w2
    bound = 2.0**-25 * (w2 + c * w1) + 2 * eps * (mag2 + c * mag1)
    assert bool(((x2 - x1 * c).abs() <= bound).all()), side


def _factors(f: dict, side: str):
    """|codes|, |row-side scale|, |zero point|, |column-side scale| of K or V, each broadcast
    to the token-major ``[N, G, D]`` of the decoded tile."""
    if side == "k":  # RTN rows are channels: codes [N, D, G]
        parts = (
            f["k_codes"].transpose(1, 2),
            f["k_col_scale"][:, None, :],
            f["k_zero_point"][:, None, :],
            f["k_row_scale"][:, :, None],
        )
    else:  # RTN rows are tokens
        parts = (
            f["v_codes"],
            f["v_row_scale"][:, :, None],
            f["v_zero_point"][:, :, None],
            f["v_col_scale"][:, None, :],
        )
    return tuple(t.float().abs() for t in parts)


@dataclass
class PagedCache:
    layout: object
    k: list  # per request, model frame float32 [L, Hkv, D]
    v: list
    packed: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    exact_k: torch.Tensor
    exact_v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    tail_pool_block: torch.Tensor

    def context_args(self):
        return (
            self.packed,
            self.block_table,
            self.seq_lens,
            self.exact_k,
            self.exact_v,
            self.k_scale,
            self.v_scale,
            self.tail_pool_block,
            self.layout,
        )


def build_cache(
    gen,
    fmt: str,
    head_dim: int,
    seq_lens,
    num_kv_heads: int,
    pool_dtype=torch.float16,
    spare_blocks: int = 3,
) -> PagedCache:
    """Store every token of each request in the exact pool (reference.store), flush the full
    blocks into randomly chosen physical blocks (reference.flush) and keep the tail in the
    pool. Unused packed bytes and block-table entries are poison (0xFF, -7)."""
    lay = kf.dense_layout(fmt, head_dim)
    g, d, hkv = lay.block_size, head_dim, num_kv_heads
    blocks_per = [-(-n // g) for n in seq_lens]
    p = sum(blocks_per) + 1
    exact_k = torch.empty(p, g, hkv, d, dtype=pool_dtype)
    exact_v = torch.empty_like(exact_k)
    fp8 = pool_dtype == torch.float8_e4m3fn
    k_scale = torch.full((p, g, hkv), float("nan")) if fp8 else None
    v_scale = torch.full((p, g, hkv), float("nan")) if fp8 else None
    n_full_total = sum(n // g for n in seq_lens)
    nb = n_full_total + spare_blocks
    packed = torch.full((nb, hkv, lay.record_bytes), 0xFF, dtype=torch.uint8)
    phys = torch.randperm(nb, generator=gen)
    max_blocks = max(max(n // g for n in seq_lens), 1) + 1
    block_table = torch.full((len(seq_lens), max_blocks), -7, dtype=torch.int32)
    tail = torch.full((len(seq_lens),), -7, dtype=torch.int32)
    ks, vs = [], []
    pool_next, phys_next = 0, 0
    src, dst = [], []
    for r, n in enumerate(seq_lens):
        k = realistic_kv(gen, n, hkv, d)
        v = realistic_kv(gen, n, hkv, d)
        ks.append(k)
        vs.append(v)
        nblk = -(-n // g)
        pool_blocks = torch.arange(pool_next, pool_next + nblk)
        pool_next += nblk
        tok = torch.arange(n)
        slots = (pool_blocks[tok // g] * g + tok % g).to(torch.int64)
        ref.store(k, v, slots, exact_k, exact_v, k_scale, v_scale)
        for i in range(n // g):
            block_table[r, i] = int(phys[phys_next])
            src.append(int(pool_blocks[i]))
            dst.append(int(phys[phys_next]))
            phys_next += 1
        if n % g:
            tail[r] = int(pool_blocks[-1])
    ref.flush(
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        torch.tensor(src, dtype=torch.int32),
        torch.tensor(dst, dtype=torch.int32),
        packed,
        lay,
    )
    return PagedCache(
        lay,
        ks,
        vs,
        packed,
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        exact_k,
        exact_v,
        k_scale,
        v_scale,
        tail,
    )


@pytest.fixture
def make_cache(gen):
    """``make_cache(fmt, head_dim, seq_lens, num_kv_heads, pool_dtype)`` -> PagedCache."""

    def make(fmt, head_dim, seq_lens, num_kv_heads, pool_dtype=torch.float16, spare_blocks=3):
        return build_cache(gen, fmt, head_dim, seq_lens, num_kv_heads, pool_dtype, spare_blocks)

    return make
