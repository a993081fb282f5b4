"""MLA kvarn-ops kernels against the reference on a CUDA GPU, at real sizes.

Tolerances (the reasons are those of tests/test_mla_ops.py; GPU-specific numbers here):
- stage_fp8, rehydrate: byte-exact (the same dequantization, exact products, RNE casts).
- scatter: 1 ulp of the pool dtype (the Hadamard sums run in another order).
- pack: codes identical for >= 99.5%, differences 1 LSB; dequantized tiles within 2% of the
  tile rms of the reference's (the best iterate can differ where imbalances tie to noise),
  plus one quantization step where a code flipped.
- materialize: 1 bf16 ulp plus 8 fp32 epsilons of the largest magnitude.
- decode: the kernel's dots may run in tf32 (10-bit mantissa) on the GPU: relative error
  against the fp64 oracle at most 2 * 2**-10 + the bf16 rounding of the output (2**-8).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from gpu_support import DEVICE, check_graph_replays, poison_, rel_err

import kvarn_formats as kf
from kvarn_ops.reference import mla as ref

# By module path: the kernels package exports launchers with some of these names.
kdec = importlib.import_module("kvarn_ops.kernels.mla_decode")
kgat = importlib.import_module("kvarn_ops.kernels.mla_gather")
kpack = importlib.import_module("kvarn_ops.kernels.mla_pack")
kscat = importlib.import_module("kvarn_ops.kernels.mla_scatter")

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
G = 64


def _bf16_ulp(b: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |b|, from the exponent field (CUDA's log2 of an exact power of two can
    round below the integer and halve the ulp)."""
    ax = b.abs().double().clamp_min(1e-30)
    _, e = torch.frexp(ax)
    return torch.ldexp(torch.ones_like(ax), (e - 1 - 7).to(ax.dtype)).to(b.dtype)


def _latent(gen, n):
    """Latent-like rows [n, 512]: low-rank structure plus noise, log-normal channel scales."""
    basis = torch.randn(16, 512, generator=gen, device=DEVICE)
    x = torch.randn(n, 16, generator=gen, device=DEVICE) @ basis * 0.5
    x = x + torch.randn(n, 512, generator=gen, device=DEVICE)
    return x * torch.exp(0.6 * torch.randn(512, generator=gen, device=DEVICE))


def _pool(p, dtype):
    lat = poison_(torch.empty(p, G, 512, dtype=dtype, device=DEVICE))
    scale = poison_(torch.empty(p, G, device=DEVICE)) if dtype == FP8 else None
    rope = poison_(torch.empty(p, G, 64, dtype=BF16, device=DEVICE))
    return lat, scale, rope


def _filled_pool(gen, p, dtype):
    pool = _pool(p, dtype)
    n = p * G
    rope = torch.randn(n, 64, generator=gen, device=DEVICE)
    ref.mla_exact_scatter(
        _latent(gen, n), rope, torch.arange(n, device=DEVICE), pool[0], pool[2], pool[1]
    )
    return pool


def _packed_cache(gen, bits, dtype, num_blocks, pool_blocks):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    pool = _filled_pool(gen, pool_blocks, dtype)
    packed = poison_(torch.empty(num_blocks, layout.record_bytes, dtype=torch.uint8, device=DEVICE))
    src = (
        torch.arange(pool_blocks, dtype=torch.int32, device=DEVICE)
        .repeat(-(-num_blocks // pool_blocks))[:num_blocks]
        .contiguous()
    )
    ref.mla_pack(
        *_args3(pool),
        src,
        torch.arange(num_blocks, dtype=torch.int32, device=DEVICE),
        packed,
        layout,
    )
    return layout, pool, packed


def _args3(pool):
    lat, scale, rope = pool
    return lat, scale, rope


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_scatter(gen, dtype):
    p, n = 300, 15000
    slots = torch.randperm(p * G, generator=gen, device=DEVICE)[:n]
    slots[torch.rand(n, generator=gen, device=DEVICE) < 0.1] = -1
    lat, rope = _latent(gen, n).to(BF16), torch.randn(n, 64, generator=gen, device=DEVICE)
    got, want = _pool(p, dtype), _pool(p, dtype)
    kscat.mla_exact_scatter(lat, rope, slots, got[0], got[2], got[1])
    ref.mla_exact_scatter(lat, rope, slots, want[0], want[2], want[1])
    written = torch.zeros(p * G, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    written = written.view(p, G)
    assert torch.equal(got[2].view(torch.int16), want[2].view(torch.int16))  # RoPE: a copy
    assert torch.equal(got[0].view(torch.uint8)[~written], want[0].view(torch.uint8)[~written])
    if dtype == BF16:
        a, b = got[0][written].double(), want[0][written].double()
        ulp = _bf16_ulp(b)
        assert ((a - b).abs() <= ulp * 1.0001 + 1e-6 * b.abs().max()).all()
    else:
        assert rel_err(got[1][written], want[1][written]) < 1e-6
        a = got[0][written].float() * got[1][written][:, None]
        b = want[0][written].float() * want[1][written][:, None]
        assert rel_err(a, b) < 2**-4


def _check_pack(got, want, dst, layout):
    """Pack records ``got`` against ``want`` (both poisoned before, written at ``dst``): the
    same untouched records, codes identical >= 99.5% and never more than 1 apart, RoPE
    bit-exact, decoded latents within 2% of the tile rms plus one step where a code flipped."""
    nb = got.shape[0]
    untouched = torch.ones(nb, dtype=torch.bool, device=DEVICE)
    untouched[dst.long()] = False
    assert torch.equal(got[untouched], want[untouched])
    gt, wt = (
        ref.record_tensors(got[dst.long()], layout),
        ref.record_tensors(want[dst.long()], layout),
    )
    same = (gt["codes"] == wt["codes"]).double().mean().item()
    assert same >= 0.995, f"codes identical: {same:.5f}"
    assert (gt["codes"].int() - wt["codes"].int()).abs().max() <= 1
    glat, grope = ref.decode_mla_records(got[dst.long()], layout)
    wlat, wrope = ref.decode_mla_records(want[dst.long()], layout)
    assert torch.equal(grope.view(torch.int16), wrope.view(torch.int16))
    # Elementwise: within 2% of the tile rms (scales traded between the two sides), plus one
    # quantization step |col_scale[d] * row_scale[t]| where a code flipped (the 0.5% above).
    rms = wlat.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    step = (wt["col_scale"].float()[:, None, :] * wt["row_scale"].float()[:, :, None]).abs()
    flipped = (gt["codes"] != wt["codes"]).transpose(1, 2)
    bound = 0.02 * rms + torch.where(flipped, 1.01 * step, torch.zeros_like(step))
    assert ((glat - wlat).abs() <= bound).all()
    assert rel_err(glat, wlat) <= 0.02


@pytest.mark.parametrize("bits", [2, 4, 5])
@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_pack_and_rehydrate(gen, bits, dtype):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    p, n, nb = 520, 512, 700
    pool = _filled_pool(gen, p, dtype)
    src = torch.randperm(p, generator=gen, device=DEVICE)[:n].to(torch.int32)
    dst = torch.randperm(nb, generator=gen, device=DEVICE)[:n].to(torch.int32)
    got = poison_(torch.empty(nb, layout.record_bytes, dtype=torch.uint8, device=DEVICE))
    want = got.clone()
    kpack.mla_pack(*pool, src, dst, got, layout)
    ref.mla_pack(*pool, src, dst, want, layout)
    _check_pack(got, want, dst, layout)

    # Rehydrate the reference's records into fresh pool blocks: byte-exact.
    back_k, back_r = _pool(p, dtype), _pool(p, dtype)
    blocks = dst[:64].contiguous()
    into = torch.randperm(p, generator=gen, device=DEVICE)[:64].to(torch.int32)
    kpack.mla_rehydrate(want, blocks, into, *back_k, layout)
    ref.mla_rehydrate(want, blocks, into, *back_r, layout)
    for a, b in zip(back_k, back_r, strict=True):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


_SPLIT = importlib.import_module("kvarn_ops.kernels.mla_pack_split")


@pytest.mark.parametrize("bits", [2, 4, 5])
@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("n", [1, 3])
def test_pack_few_blocks(gen, request, bits, dtype, n):
    """A decode step's pack (a few blocks): each tile's channels split over several programs
    (the launch must split), against the reference and against one program per tile."""
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    parts = _SPLIT.parts_for(n, sms)
    assert parts > 1, "this case must take the split path"
    request.node.user_properties.append(("parts", parts))
    p, nb = 8, 12
    pool = _filled_pool(gen, p, dtype)
    src = torch.randperm(p, generator=gen, device=DEVICE)[:n].to(torch.int32)
    dst = torch.randperm(nb, generator=gen, device=DEVICE)[:n].to(torch.int32)
    got = poison_(torch.empty(nb, layout.record_bytes, dtype=torch.uint8, device=DEVICE))
    want, single = got.clone(), got.clone()
    kpack.mla_pack(*pool, src, dst, got, layout)
    ref.mla_pack(*pool, src, dst, want, layout)
    _SPLIT.FORCE_PARTS = 1
    try:
        kpack.mla_pack(*pool, src, dst, single, layout)
    finally:
        _SPLIT.FORCE_PARTS = None
    _check_pack(got, want, dst, layout)
    _check_pack(got, single, dst, layout)


def test_pack_few_blocks_graph_replay(gen):
    """The split pack captured in a CUDA graph and replayed with new pool contents: every
    replay writes the records an eager call writes (the graph zeroes the counters)."""
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    pool = _filled_pool(gen, 4, BF16)
    src = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    got = torch.empty(4, layout.record_bytes, dtype=torch.uint8, device=DEVICE)
    check_graph_replays(
        lambda out: kpack.mla_pack(*pool, src, dst, out, layout),
        pool,
        lambda: _filled_pool(gen, 4, BF16),
        got,
        dst.long(),
    )


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_stage_fp8_and_materialize(gen, bits, dtype):
    layout, pool, packed = _packed_cache(gen, bits, dtype, num_blocks=900, pool_blocks=40)
    nb = packed.shape[0]
    # A third of the blocks are still exact (mapped to a pool block), the rest packed.
    block_pool_map = torch.full((nb,), -1, dtype=torch.int32, device=DEVICE)
    mapped = torch.randperm(nb, generator=gen, device=DEVICE)[:40]
    block_pool_map[mapped] = torch.arange(40, dtype=torch.int32, device=DEVICE)
    n = 50000
    slots = torch.randint(0, nb * G, (n,), generator=gen, device=DEVICE)
    slots[torch.rand(n, generator=gen, device=DEVICE) < 0.05] = -1
    args = (packed, block_pool_map, *pool, slots, layout)
    got = poison_(torch.empty(n, 656, dtype=torch.uint8, device=DEVICE))
    want = got.clone()
    kgat.mla_stage_fp8(*args, got)
    ref.mla_stage_fp8(*args, want)
    assert torch.equal(got, want), "staged fp8 records differ from the reference"
    mgot = poison_(torch.empty(n, 576, dtype=BF16, device=DEVICE))
    mwant = mgot.clone()
    kgat.mla_materialize(*args, mgot)
    ref.mla_materialize(*args, mwant)
    ok = slots >= 0
    assert torch.equal(mgot[~ok].view(torch.int16), mwant[~ok].view(torch.int16))
    a, b = mgot[ok].double(), mwant[ok].double()
    ulp = _bf16_ulp(b)
    atol = 8 * torch.finfo(torch.float32).eps * float(b.abs().max())
    assert ((a - b).abs() <= ulp * 1.0001 + atol).all()


def _decode_cache(gen, bits, dtype, lens, spare_blocks=0):
    """Packed records for every block of ``lens`` (plus ``spare_blocks`` per request, in the
    block table for contexts that grow), block tables over a random permutation, and a pool
    map: the last block of each request is live in the exact pool, and so is the first block of
    every other request that has three or more (a rehydrated block between packed ones)."""
    nblk = sum(-(-n // G) + spare_blocks for n in lens) + 2
    layout, pool, packed = _packed_cache(gen, bits, dtype, num_blocks=nblk, pool_blocks=32)
    max_blocks = max(-(-n // G) for n in lens) + spare_blocks
    perm = torch.randperm(nblk, generator=gen, device=DEVICE).to(torch.int32)
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device=DEVICE)
    used = 0
    for r, n in enumerate(lens):
        k = -(-n // G) + spare_blocks
        table[r, :k] = perm[used : used + k]
        used += k
    block_pool_map = torch.full((nblk,), -1, dtype=torch.int32, device=DEVICE)
    for r, n in enumerate(lens):
        block_pool_map[table[r, -(-n // G) - 1]] = r % 16
        if r % 2 == 1 and n > 2 * G:
            block_pool_map[table[r, 0]] = 16 + r % 16
    return layout, pool, packed, table, block_pool_map


DECODE_CASES = [
    (5, BF16, [8192 + 17] * 16, 16, False),
    (4, FP8, [65536 + 3], 128, False),
    (2, BF16, [1, 64, 65, 3000], 16, False),
    (5, BF16, [20000, 9000], 64, True),
    (4, FP8, [32768 + 5] * 4, 128, True),
    (3, BF16, [2100, 4097, 64], 16, True),
    # the Gluon kernels' cases (2-, 4- and 5-bit, full context): short and exact-multiple
    # requests, a partial head group, and both pools
    (4, BF16, [1, 64, 65, 3000, 4096], 16, False),
    (4, FP8, [20000, 777], 20, False),
    (4, BF16, [8192 + 17] * 16, 16, False),
    (5, BF16, [1, 64, 65, 3000, 4096], 16, False),
    (5, FP8, [20000, 777], 20, False),
    (2, FP8, [20000, 777], 20, False),
    # the 64-head kernel (sm_90, from WGMMA64_MIN_HEADS heads): short requests, a partial
    # second head group (96 heads), every width, both pools
    (4, BF16, [1, 64, 65, 3000, 4096], 128, False),
    (5, FP8, [20000, 777], 96, False),
    (2, BF16, [8192 + 17] * 4, 64, False),
    (5, BF16, [16384 + 5] * 3, 128, False),
]
#: full-context cases run through every kernel that serves them: the library's choice
#: (``default``, checked to be the one chosen: the wgmma kernel on sm_90), the mma.sync Gluon
#: kernel (``mma``, 4 bits) and the Triton one (``triton``: what 2- and 5-bit codes take on
#: GPUs other than sm_90)
DECODE_PARAMS = [(*c, "default") for c in DECODE_CASES] + [
    (*c, k)
    for c in DECODE_CASES
    if c[0] in (2, 4, 5) and not c[4]
    for k in (("mma", "triton") if c[0] == 4 else ("triton",))
    + (("wgmma16",) if c[3] >= kdec.WGMMA64_MIN_HEADS else ())
]


@pytest.mark.parametrize(("bits", "dtype", "lens", "heads", "sparse", "kernel"), DECODE_PARAMS)
def test_decode(gen, monkeypatch, bits, dtype, lens, heads, sparse, kernel):
    """Every case against the fp64 oracle; full-context cases through each kernel that serves
    them (checked to be the one chosen)."""
    _pick_kernel(monkeypatch, kernel)
    layout, pool, packed, table, block_pool_map = _decode_cache(gen, bits, dtype, lens)
    b = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, heads, 576, generator=gen, device=DEVICE).to(BF16)
    indices = None
    if sparse:
        topk = 2048
        indices = torch.full((b, topk), -1, dtype=torch.int32, device=DEVICE)
        for r, n in enumerate(lens):  # shorter requests select all they have, then -1
            sel = torch.randperm(n, generator=gen, device=DEVICE)[:topk]
            indices[r, : sel.numel()] = sel.to(torch.int32)
        indices[:, -7:] = -1
    scale = 1 / math.sqrt(576)
    args = (packed, table, seq, block_pool_map, *pool, layout, scale)
    out = poison_(torch.empty(b, heads, 512, dtype=BF16, device=DEVICE))
    ws = (
        kdec.mla_decode_workspace(b, heads, device=DEVICE)
        if hasattr(kdec, "mla_decode_workspace")
        else ref.mla_decode_workspace(b, heads, device=DEVICE)
    )
    mma = kdec._use_mma_kernel(bits, q, sparse)
    assert mma == (kernel != "triton" and bits == 4 and not sparse)
    _check_wgmma_choice(q, bits, sparse, kernel)
    kdec.mla_decode(q, *args, out, ws, indices)
    oracle = torch.empty(b, heads, 512, dtype=torch.float32, device=DEVICE)
    ref.mla_decode(q, *args, oracle, None, indices)
    err = rel_err(out, oracle)
    print(f"MLA decode error {err:.2e} (kernel {kernel})")
    assert err <= 2 * 2**-10 + 2**-8, f"MLA decode error {err:.2e}"


def _pick_kernel(monkeypatch, kernel):
    """``default``: the library's choice (for full context: the ``wgmma`` kernel on sm_90 for
    the widths in ``WGMMA_BITS``, the ``mma.sync`` one on other sm_80+ GPUs at 4 bits);
    ``mma``: the ``mma.sync`` Gluon kernel (the Triton one at 2 and 5 bits); ``wgmma``: the
    ``wgmma`` kernel at every width it compiles for; ``wgmma16``: the 16-head ``wgmma`` kernel
    at every head count; ``triton``: the Triton kernel."""
    if kernel == "wgmma16":
        monkeypatch.setattr(kdec, "WGMMA64_MIN_HEADS", None)
    if kernel == "wgmma":
        from kvarn_ops.kernels import mla_decode_wgmma

        monkeypatch.setattr(kdec, "WGMMA_BITS", mla_decode_wgmma.MLA_WGMMA_BITS)
    if kernel == "triton":
        monkeypatch.setattr(kdec, "MMA_KERNEL", False)
    if kernel == "mma":
        monkeypatch.setattr(kdec, "WGMMA_KERNEL", False)


def _check_wgmma_choice(q, bits, sparse, kernel):
    hopper = torch.cuda.get_device_capability(q.device)[0] == 9
    chosen = kernel == "wgmma" or (kernel in ("default", "wgmma16") and bits in kdec.WGMMA_BITS)
    want = chosen and not sparse and hopper
    assert kdec._use_wgmma_kernel(bits, q, sparse) == want
    wide = want and kernel != "wgmma16" and q.shape[1] >= kdec.WGMMA64_MIN_HEADS
    assert kdec._use_wgmma64_kernel(bits, q, sparse) == wide


@pytest.mark.parametrize(
    ("bits", "kernel", "heads"),
    [(4, "default", 16), (4, "mma", 16), (4, "triton", 16), (5, "default", 16), (5, "triton", 16),
     (2, "default", 16), (4, "default", 128), (5, "default", 64)],
)  # fmt: skip
def test_decode_ill_conditioned_latents(gen, monkeypatch, bits, kernel, heads):
    """Full context over latent records whose zero-point term nearly cancels the code term
    (the CPU suite's ``make_ill_conditioned``): the ``mma.sync`` and Triton kernels must keep
    ``q * cs / cmax`` to about 2^-22 (two fp16 operands; one fp16 operand fails the CPU version
    of this test 65-120x over its allowance), the ``wgmma`` kernel rounds ``cs code + zp``
    once, after the cancellation."""
    import os
    import sys
    from pathlib import Path

    os.environ["TRITON_INTERPRET"] = "0"  # the CPU test module defaults it to 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_mla_ops as tm

    _pick_kernel(monkeypatch, kernel)
    lens = [3000, 8192 + 17, 640]
    layout, pool, packed, table, block_pool_map = _decode_cache(gen, bits, BF16, lens)
    host = packed.cpu()
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen, device=DEVICE))
    tm.make_ill_conditioned(torch.Generator().manual_seed(seed), host, layout, range(len(host)))
    packed.copy_(host)
    b = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, heads, 576, generator=gen, device=DEVICE).to(BF16)
    scale = 1 / math.sqrt(576)
    args = (packed, table, seq, block_pool_map, *pool, layout, scale)
    out = poison_(torch.empty(b, heads, 512, dtype=BF16, device=DEVICE))
    ws = kdec.mla_decode_workspace(b, heads, device=DEVICE)
    assert kdec._use_mma_kernel(bits, q, False) == (kernel not in ("triton", "wgmma") and bits == 4)
    _check_wgmma_choice(q, bits, False, kernel)
    kdec.mla_decode(q, *args, out, ws, None)
    oracle = torch.empty(b, heads, 512, dtype=torch.float32, device=DEVICE)
    ref.mla_decode(q, *args, oracle, None, None)
    err = rel_err(out, oracle)
    print(f"MLA decode error {err:.2e} (kernel {kernel})")
    assert err <= 2 * 2**-10 + 2**-8, f"MLA decode error {err:.2e}"


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_cuda_graph_replay(gen, heads):
    """The 4-bit full-context decode (the Gluon kernel; at 128 heads the 64-head one on sm_90)
    captured once and replayed with new queries and longer contexts (one crossing into a spare
    packed block): no host sync inside, results equal to eager calls and within the oracle
    bound."""
    lens = [3000, 70, 9000, 640]
    layout, pool, packed, table, bmap = _decode_cache(gen, 4, BF16, lens, spare_blocks=2)
    b = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, heads, 576, generator=gen, device=DEVICE).to(BF16)
    scale = 1 / math.sqrt(576)
    args = (packed, table, seq, bmap, *pool, layout, scale)
    assert kdec._use_mma_kernel(4, q, False)
    hopper = torch.cuda.get_device_capability(q.device)[0] == 9
    assert kdec._use_wgmma64_kernel(4, q, False) == (hopper and heads >= kdec.WGMMA64_MIN_HEADS)
    out = torch.empty(b, heads, 512, dtype=BF16, device=DEVICE)
    ws = kdec.mla_decode_workspace(b, heads, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            kdec.mla_decode(q, *args, out, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kdec.mla_decode(q, *args, out, ws)
    for step in range(1, 4):
        q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE))
        seq.add_(step * 13)
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.empty_like(out)
        kdec.mla_decode(q, *args, eager, kdec.mla_decode_workspace(b, heads, device=DEVICE))
        assert torch.equal(out, eager), f"replay {step} differs from an eager call"
        oracle = torch.empty(b, heads, 512, dtype=torch.float32, device=DEVICE)
        ref.mla_decode(q, *args, oracle, None)
        err = rel_err(out, oracle)
        assert err <= 2 * 2**-10 + 2**-8, f"replay {step}: MLA decode error {err:.2e}"


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_scatter_fp8_keeps_nonfinite_tokens_nonfinite(gen, kind):
    """Compiled, the clamp before the e4m3 rounding must keep NaN (tl.minimum/maximum may turn
    it into -448) and the amax must see it (scale 1.0 for NaN, as the reference)."""
    n = 256
    lat = _latent(gen, n)
    bad = torch.randperm(n, generator=gen, device=DEVICE)[:8]
    lat[bad, torch.randint(0, 512, (8,), generator=gen, device=DEVICE)] = (
        float("nan") if kind == "nan" else -float("inf")
    )
    rope = torch.randn(n, 64, generator=gen, device=DEVICE)
    got, want = _pool(4, FP8), _pool(4, FP8)
    slots = torch.arange(n, device=DEVICE)
    kscat.mla_exact_scatter(lat, rope, slots, got[0], got[2], got[1])
    ref.mla_exact_scatter(lat, rope, slots, want[0], want[2], want[1])
    glat, wlat = got[0].view(n, 512).float(), want[0].view(n, 512).float()
    assert bool((~torch.isfinite(glat[bad])).any(dim=1).all()), "a bad token came out finite"
    assert bool((~torch.isfinite(wlat[bad])).any(dim=1).all())
    good = torch.ones(n, dtype=torch.bool, device=DEVICE)
    good[bad] = False
    assert bool(torch.isfinite(glat[good]).all())
    gs, ws = got[1].view(n), want[1].view(n)
    if kind == "nan":
        assert bool((gs[bad] == 1.0).all()) and bool((ws[bad] == 1.0).all())
    assert rel_err(gs[good], ws[good]) < 1e-6


@pytest.mark.parametrize("kernel", ["default", "triton"])
def test_decode_nonfinite_query_gives_nan(gen, monkeypatch, kernel):
    """A head whose query holds NaN gets NaN (every kernel kept a NaN sum of weights as an
    empty split's and returned zeros before); the other heads match the oracle."""
    _pick_kernel(monkeypatch, kernel)
    lens = [4096 + 5, 300]
    layout, pool, packed, table, block_pool_map = _decode_cache(gen, 4, BF16, lens)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 16, 576, generator=gen, device=DEVICE).to(BF16)
    q[0, 3, 100] = float("nan")
    q[1, 7, 530] = float("inf")
    args = (packed, table, seq, block_pool_map, *pool, layout, 1 / math.sqrt(576))
    out = poison_(torch.empty(2, 16, 512, dtype=BF16, device=DEVICE))
    kdec.mla_decode(q, *args, out, kdec.mla_decode_workspace(2, 16, device=DEVICE), None)
    oracle = torch.empty(2, 16, 512, dtype=torch.float32, device=DEVICE)
    ref.mla_decode(q, *args, oracle, None, None)
    assert bool(out[0, 3].isnan().all()) and bool(out[1, 7].isnan().all())
    ok = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
    ok[0, 3] = ok[1, 7] = False
    assert rel_err(out[ok], oracle[ok]) <= 2 * 2**-10 + 2**-8
