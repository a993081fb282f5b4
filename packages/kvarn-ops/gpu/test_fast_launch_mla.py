"""Recorded launches of the MLA scatter, pack, rehydrate, decode and gathers on a GPU
(``kernels/_fastlaunch.py``): a repeated call of one signature replays the first call's
launches with the new inputs' pointers; the results must equal the full path's bit for bit
and the reference within the bounds of ``test_mla_parity.py``."""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import DEVICE, poison_, rel_err
from test_mla_parity import (
    BF16,
    FP8,
    G,
    _bf16_ulp,
    _check_pack,
    _decode_cache,
    _filled_pool,
    _latent,
    _packed_cache,
    _pool,
    kdec,
    kgat,
    kpack,
    kscat,
)

import kvarn_formats as kf
from kvarn_ops.reference import mla as ref


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_scatter_replays_with_fresh_inputs(gen, monkeypatch, dtype):
    """A decode step's scatter (16 tokens, one skipped) three times with fresh tokens and
    pools: each replay writes exactly the full path's bytes, and the RoPE rows equal the
    reference's."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kscat._PLANS.clear()
    p, n = 40, 16
    before = kscat._PLANS.replays
    for i in range(3):
        slots = torch.randperm(p * G, generator=gen, device=DEVICE)[:n]
        slots[3] = -1
        lat = _latent(gen, n).to(BF16)
        rope = torch.randn(n, 64, generator=gen, device=DEVICE)
        fast, full, want = _pool(p, dtype), _pool(p, dtype), _pool(p, dtype)
        kscat.mla_exact_scatter(lat, rope, slots, fast[0], fast[2], fast[1])
        assert kscat._PLANS.replays == before + i, "call did not take the expected path"
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        kscat.mla_exact_scatter(lat, rope, slots, full[0], full[2], full[1])
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        ref.mla_exact_scatter(lat, rope, slots, want[0], want[2], want[1])
        for a, b in zip(fast, full, strict=True):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"call {i}"
        assert torch.equal(fast[2].view(torch.int16), want[2].view(torch.int16))


@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("n", [1, 300])
def test_pack_and_rehydrate_replay_with_fresh_inputs(gen, monkeypatch, dtype, n):
    """A decode step's pack (1 block: the split kernel, whose counters must be zero at every
    launch) and a bulk pack (300 blocks), then a rehydrate of the records, three times with
    fresh pools and indices: each replay writes the full path's bytes, the packs within the
    reference's bound, the rehydrates byte-exact."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kpack._PACK_PLANS.clear()
    kpack._REHYDRATE_PLANS.clear()
    layout = kf.mla_layout("kvarn_mla_k4_g64")
    p, nb = (8, 12) if n == 1 else (320, 400)
    before = kpack._PACK_PLANS.replays, kpack._REHYDRATE_PLANS.replays
    for i in range(3):
        pool = _filled_pool(gen, p, dtype)
        src = torch.randperm(p, generator=gen, device=DEVICE)[:n].to(torch.int32)
        dst = torch.randperm(nb, generator=gen, device=DEVICE)[:n].to(torch.int32)
        got = poison_(torch.empty(nb, layout.record_bytes, dtype=torch.uint8, device=DEVICE))
        full, want = got.clone(), got.clone()
        kpack.mla_pack(*pool, src, dst, got, layout)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        kpack.mla_pack(*pool, src, dst, full, layout)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        assert torch.equal(got, full), f"call {i}: pack replay differs from the full path"
        ref.mla_pack(*pool, src, dst, want, layout)
        _check_pack(got, want, dst, layout)
        into = torch.randperm(p, generator=gen, device=DEVICE)[:n].to(torch.int32)
        back, back_ref = _pool(p, dtype), _pool(p, dtype)
        kpack.mla_rehydrate(want, dst, into, *back, layout)
        ref.mla_rehydrate(want, dst, into, *back_ref, layout)
        for a, b in zip(back, back_ref, strict=True):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"call {i}"
        now = kpack._PACK_PLANS.replays, kpack._REHYDRATE_PLANS.replays
        assert now == (before[0] + i, before[1] + i), "a call did not take the expected path"


MLA_CASES = [  # (bits, pool dtype, seq_lens, heads, sparse)
    (4, BF16, [3000, 65, 9000], 16, False),  # the 16-head kernel (wgmma on sm_90)
    (5, FP8, [20000, 777], 128, False),  # the 64-head kernel on sm_90
    (2, BF16, [2100, 4097], 16, True),  # sparse: the Triton kernel, indices an input
]


@pytest.mark.parametrize(("bits", "dtype", "lens", "heads", "sparse"), MLA_CASES)
def test_decode_replays_with_fresh_inputs(gen, monkeypatch, bits, dtype, lens, heads, sparse):
    """Three caches of one geometry with fresh values and block tables: the first call
    records, the next two replay; each output equals the full path's bit for bit and the
    fp64 oracle within the decode bound; another scale is recorded anew."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kdec._PLANS.clear()
    b = len(lens)
    scale = 1 / math.sqrt(576)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ws = kdec.mla_decode_workspace(b, heads, device=DEVICE)
    before = kdec._PLANS.replays
    for i in range(3):
        layout, pool, packed, table, pool_map = _decode_cache(gen, bits, dtype, lens)
        q = torch.randn(b, heads, 576, generator=gen, device=DEVICE).to(BF16)
        indices = None
        if sparse:
            indices = torch.full((b, 2048), -1, dtype=torch.int32, device=DEVICE)
            for r, n in enumerate(lens):
                sel = torch.randperm(n, generator=gen, device=DEVICE)[:2048]
                indices[r, : sel.numel()] = sel.to(torch.int32)
        args = (packed, table, seq, pool_map, *pool, layout, scale)
        fast, full = (poison_(torch.empty(b, heads, 512, dtype=BF16, device=DEVICE)) for _ in "ab")
        kdec.mla_decode(q, *args, fast, ws, indices)
        assert kdec._PLANS.replays == before + i, "call did not take the expected path"
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        kdec.mla_decode(q, *args, full, ws, indices)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        assert torch.equal(fast, full), f"call {i}: replay differs from the full path"
        oracle = torch.empty(b, heads, 512, dtype=torch.float32, device=DEVICE)
        ref.mla_decode(q, *args, oracle, None, indices)
        err = rel_err(fast, oracle)
        assert err <= 2 * 2**-10 + 2**-8, f"call {i}: MLA decode error {err:.2e}"
    n = kdec._PLANS.replays
    args = (packed, table, seq, pool_map, *pool, layout, 0.5 * scale)
    half = poison_(torch.empty(b, heads, 512, dtype=BF16, device=DEVICE))
    kdec.mla_decode(q, *args, half, ws, indices)
    assert kdec._PLANS.replays == n, "another scale replayed the old plan"
    oracle = torch.empty(b, heads, 512, dtype=torch.float32, device=DEVICE)
    ref.mla_decode(q, *args, oracle, None, indices)
    assert rel_err(half, oracle) <= 2 * 2**-10 + 2**-8


@pytest.mark.parametrize(("bits", "dtype"), [(4, BF16), (5, FP8)])
def test_gathers_replay_with_fresh_inputs(gen, monkeypatch, bits, dtype):
    """``mla_stage_fp8``, ``mla_materialize`` and ``mla_remap_indices`` three times with fresh
    caches, pool maps, slots and indices: the first call of each records, the next two
    replay; every replay writes the full path's bytes, the staged records and remapped slots
    equal the reference's, the materialized rows are within a bf16 ulp of it, and rows of
    slot -1 are left as they were."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kgat._GATHER_PLANS.clear()
    kgat._REMAP_PLANS.clear()
    n, nb, reqs, width = 3000, 300, 4, 512
    before = kgat._GATHER_PLANS.replays, kgat._REMAP_PLANS.replays
    for i in range(3):
        layout, pool, packed = _packed_cache(gen, bits, dtype, num_blocks=nb, pool_blocks=40)
        pool_map = torch.full((nb,), -1, dtype=torch.int32, device=DEVICE)
        mapped = torch.randperm(nb, generator=gen, device=DEVICE)[:40]
        pool_map[mapped] = torch.arange(40, dtype=torch.int32, device=DEVICE)
        slots = torch.randint(0, nb * G, (n,), generator=gen, device=DEVICE)
        slots[torch.rand(n, generator=gen, device=DEVICE) < 0.05] = -1
        args = (packed, pool_map, *pool, slots, layout)
        staged = poison_(torch.empty(n, 656, dtype=torch.uint8, device=DEVICE))
        staged_full, staged_ref = staged.clone(), staged.clone()
        rows = poison_(torch.empty(n, 576, dtype=BF16, device=DEVICE))
        rows_full, rows_ref = rows.clone(), rows.clone()
        table = torch.randperm(nb, generator=gen, device=DEVICE)[: reqs * 64].view(reqs, 64)
        table = table.to(torch.int32).contiguous()
        indices = torch.randint(-1, 64 * G, (8, width), generator=gen, device=DEVICE)
        indices = indices.to(torch.int32)
        req_ids = torch.randint(0, reqs, (8,), generator=gen, device=DEVICE).to(torch.int32)
        remapped = torch.full((8, width), -7, dtype=torch.int64, device=DEVICE)
        remapped_full, remapped_ref = remapped.clone(), remapped.clone()

        kgat.mla_stage_fp8(*args, staged)
        kgat.mla_materialize(*args, rows)
        kgat.mla_remap_indices(indices, req_ids, table, remapped)
        now = kgat._GATHER_PLANS.replays, kgat._REMAP_PLANS.replays
        assert now == (before[0] + 2 * i, before[1] + i), "a call did not take the expected path"
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        kgat.mla_stage_fp8(*args, staged_full)
        kgat.mla_materialize(*args, rows_full)
        kgat.mla_remap_indices(indices, req_ids, table, remapped_full)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        assert torch.equal(staged, staged_full), f"call {i}: staged replay differs"
        assert torch.equal(rows.view(torch.int16), rows_full.view(torch.int16)), f"call {i}"
        assert torch.equal(remapped, remapped_full), f"call {i}: remap replay differs"

        ref.mla_stage_fp8(*args, staged_ref)
        assert torch.equal(staged, staged_ref), (
            f"call {i}: staged records differ from the reference"
        )
        ref.mla_materialize(*args, rows_ref)
        ok = slots >= 0
        assert torch.equal(rows[~ok].view(torch.int16), rows_ref[~ok].view(torch.int16))
        a, b = rows[ok].double(), rows_ref[ok].double()
        atol = 8 * torch.finfo(torch.float32).eps * float(b.abs().max())
        assert ((a - b).abs() <= _bf16_ulp(b) * 1.0001 + atol).all(), f"call {i}"
        ref.mla_remap_indices(indices, req_ids, table, remapped_ref)
        assert torch.equal(remapped, remapped_ref), f"call {i}: remapped slots differ"
