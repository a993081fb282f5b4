"""Recorded launches (``kernels/_fastlaunch.py``) on a GPU: a repeated call of one signature
replays the first call's launches with the new inputs' pointers; its results must equal the
full path's bit for bit and the reference within the usual bounds, and every change of
signature (an unaligned pointer, a switch) must take the full path again."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from cache_builder import build_cache
from gpu_support import DEVICE, poison_, realistic_kv, rel_err
from test_dense_parity import (
    _assert_within_ulp,
    _e4m3_ordered,
    _run_decode,
    _tf32x3_atol,
    assert_decode_error,
)

from kvarn_ops import kernels, reference

kd = importlib.import_module("kvarn_ops.kernels.decode")
ks = importlib.import_module("kvarn_ops.kernels.store")


def _decode_case(gen, lens, hq=32, hkv=8, d=128):
    cache = build_cache(gen, "kvarn_k4v2_g64", d, hkv, lens)
    q = torch.randn(len(lens), 1, hq, d, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    return cache, q


def _oracle(cache, q, scale):
    ref = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.decode(q, *cache.args(), scale, ref, None, compute_dtype=torch.float64)
    return ref


def test_decode_replays_with_fresh_inputs(gen, monkeypatch):
    """Three caches of one geometry (fresh tensors, fresh values): the first call records,
    the next two replay; each output equals the full path's (``KVARN_FAST_LAUNCH=0``) bit for
    bit and the fp64 oracle within the decode bound."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kd._PLANS.clear()
    lens = [3000, 130, 9000, 64]
    scale = 1 / math.sqrt(128)
    before = kd._PLANS.replays
    for i in range(3):
        cache, q = _decode_case(gen, lens)
        fast = _run_decode(cache, q, scale)
        assert kd._PLANS.replays == before + i, "call did not take the expected path"
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        full = _run_decode(cache, q, scale)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        assert torch.equal(fast, full), f"call {i}: replay differs from the full path"
        assert_decode_error(fast, q, cache, scale, _oracle(cache, q, scale))


def test_decode_signature_changes_take_the_full_path(gen, monkeypatch):
    """An unaligned query (Triton specializes on 16-byte alignment), another scale and a
    switch each make a new signature: recorded anew, never served by the old plan."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kd._PLANS.clear()
    lens = [700, 2000]
    cache, q = _decode_case(gen, lens)
    scale = 1 / math.sqrt(128)
    _run_decode(cache, q, scale)
    n = kd._PLANS.replays
    # the same values from a buffer 8 bytes off 16-byte alignment
    buf = torch.empty(q.numel() + 4, dtype=q.dtype, device=DEVICE)
    q_off = buf[4:].view(q.shape)
    q_off.copy_(q)
    assert q_off.data_ptr() % 16 != 0
    out = _run_decode(cache, q_off, scale)
    assert kd._PLANS.replays == n, "an unaligned query replayed an aligned plan"
    assert torch.equal(out, _run_decode(cache, q, scale))
    assert kd._PLANS.replays == n + 1
    out2 = _run_decode(cache, q, 0.5 * scale)
    assert kd._PLANS.replays == n + 1, "another scale replayed the old plan"
    assert_decode_error(out2, q, cache, 0.5 * scale, _oracle(cache, q, 0.5 * scale))
    # the Triton split kernel instead of the MMA kernel: a switch read at launch
    monkeypatch.setenv("KVARN_DECODE_MMA", "0")
    out3 = _run_decode(cache, q, scale)
    assert kd._PLANS.replays == n + 1, "a switch change replayed the old plan"
    assert_decode_error(out3, q, cache, scale, _oracle(cache, q, scale))
    assert not torch.equal(out3, out), "the switch did not change the kernel"


def _store_inputs(gen, tokens, pool_dtype):
    hkv, d, g, blocks = 8, 128, 64, 32
    k = realistic_kv(gen, (tokens, hkv, d), torch.bfloat16)
    v = realistic_kv(gen, (tokens, hkv, d), torch.bfloat16)
    slots = torch.randperm(blocks * g, generator=gen, device=DEVICE)[:tokens]
    shape = (blocks, g, hkv, d)
    fp8 = pool_dtype == torch.float8_e4m3fn

    def pools():  # every byte 0xFF (poison_): unwritten bytes compare equal across pools
        e = [poison_(torch.empty(shape, dtype=pool_dtype, device=DEVICE)) for _ in range(2)]
        sc = [poison_(torch.empty(shape[:3], device=DEVICE)) if fp8 else None for _ in range(2)]
        return (*e, *sc)

    return k, v, slots, (pools(), pools(), pools())


def test_store_replays_with_fresh_inputs(gen, monkeypatch):
    """A decode step's store (8 tokens) three times with fresh tensors into bf16 and fp8
    pools: every replay writes exactly the bytes of the full path, leaves every other slot's
    poison, and its values match the reference (16-bit pools within the rotation's rounding,
    fp8 codes within one e4m3 step, scales within fp32 rounding)."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    ks._PLANS.clear()
    for pool_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        before = ks._PLANS.replays
        for i in range(3):
            k, v, slots, (fast, full, ref) = _store_inputs(gen, 8, pool_dtype)
            kernels.store(k, v, slots, *fast)
            assert ks._PLANS.replays == before + i
            monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
            kernels.store(k, v, slots, *full)
            monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
            reference.store(k, v, slots, *ref)
            rows = torch.zeros(fast[0].shape[0] * fast[0].shape[1], dtype=torch.bool, device=DEVICE)
            rows[slots] = True
            rows = rows.view(fast[0].shape[:2])
            for a, b, r in zip(fast, full, ref, strict=True):
                if a is None:
                    continue
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"call {i}"
                # nothing outside the slots' rows written
                assert torch.equal(a.view(torch.uint8)[~rows], r.view(torch.uint8)[~rows])
                if a.dtype == torch.float8_e4m3fn:
                    steps = (_e4m3_ordered(a[rows]) - _e4m3_ordered(r[rows])).abs()
                    assert int(steps.max()) <= 1, f"call {i}: fp8 codes off"
                elif a.dtype == torch.bfloat16:
                    extra = _tf32x3_atol(k if a is fast[0] else v, 128, True)
                    _assert_within_ulp(a[rows].float(), r[rows].float(), a.dtype, "store", extra)
                elif a.dtype == torch.float32:  # fp8 pools' scales
                    assert rel_err(a[rows], r[rows]) < 1e-6


@pytest.mark.parametrize(
    ("fmt", "d", "pool_dtype"),
    [
        ("kvarn_k4v2_g64", 128, torch.bfloat16),  # the Gluon kernel, then the tails' kernel
        ("kvarn_k4v4_g128", 64, torch.float8_e4m3fn),  # head pairs, an fp8 pool's scales
        ("kvarn_k5v5_g64", 128, torch.bfloat16),  # the Triton kernel alone
    ],
)
def test_materialize_replays_with_fresh_inputs(gen, monkeypatch, fmt, d, pool_dtype):
    """Three caches of one geometry: the first materialize records (the sign table a
    constant of its plan), the next two replay; each output equals the full path's byte for
    byte and the reference within one ulp, and rows past the contexts stay poisoned."""
    km = importlib.import_module("kvarn_ops.kernels.materialize")
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    km._PLANS.clear()
    lens, hkv = [700, 64, 3000, 5], 8
    total = sum(lens) + 7
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    before = km._PLANS.replays
    for i in range(3):
        cache = build_cache(gen, fmt, d, hkv, lens, pool_dtype)
        fast, full, want = (
            [poison_(torch.empty(total, hkv, d, dtype=torch.bfloat16, device=DEVICE)) for _ in "kv"]
            for _ in range(3)
        )
        kernels.materialize(*cache.args(), fast[0], fast[1], cu)
        assert km._PLANS.replays == before + i, "call did not take the expected path"
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        kernels.materialize(*cache.args(), full[0], full[1], cu)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        reference.materialize(*cache.args(), want[0], want[1], cu)
        n = sum(lens)
        for got, same, ref in zip(fast, full, want, strict=True):
            assert torch.equal(got.view(torch.uint8), same.view(torch.uint8)), f"call {i}"
            assert torch.equal(got[n:].view(torch.uint8), ref[n:].view(torch.uint8))
            _assert_within_ulp(got[:n].float(), ref[:n].float(), torch.bfloat16, "materialize")
