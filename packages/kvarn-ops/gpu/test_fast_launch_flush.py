"""Recorded launches of the flush on a GPU (``kernels/_fastlaunch.py``): a repeated call of one
signature replays the first call's launches, with its scratch (the split tiles' zeroed
counters and partial values, the planned flush's plan buffer) allocated anew; its records must
equal the full path's byte for byte and the reference within the flush bound."""

from __future__ import annotations

import importlib

import pytest
import torch
from gpu_support import DEVICE, poison_
from test_dense_parity import _check_flush, _flush_pool, _sink_rows

import kvarn_formats as kf
from kvarn_ops import kernels, reference

kfl = importlib.import_module("kvarn_ops.kernels.flush")


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("n", "sink"), [(1, False), (3, True), (300, False), (300, True)])
def test_flush_replays_with_fresh_inputs(gen, request, monkeypatch, pool_dtype, n, sink):
    """A decode step's flush (1 or 3 blocks: split tiles, whose counters must be zero at
    every launch) and a bulk flush (300 blocks: the planned flush where this GPU has it; with
    sink rows, two launches), three times with fresh pools and indices: the first call
    records, the next two replay."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kfl._PLANS.clear()
    layout = kf.dense_layout("kvarn_k4v2_g64", 128)
    hkv, g = 8, layout.block_size
    pool_blocks, num_blocks = (320, 400) if n > 8 else (8, 12)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    parts = kfl.parts_for(n * hkv * 2, g, 128, sms)
    assert (parts > 1) == (n <= 8), "the case does not take the path it is meant to"
    request.node.user_properties.append(("parts", parts))
    before = kfl._PLANS.replays
    for i in range(3):
        pools = _flush_pool(gen, layout, hkv, pool_blocks, pool_dtype)
        src = torch.randperm(pool_blocks, generator=gen, device=DEVICE)[:n].to(torch.int32)
        dst = torch.randperm(num_blocks, generator=gen, device=DEVICE)[:n].to(torch.int32)
        rows = _sink_rows(gen, n, g) if sink else None
        if rows is not None:
            rows[0] = 0
        shape = (num_blocks, hkv, layout.record_bytes)
        got = poison_(torch.empty(shape, dtype=torch.uint8, device=DEVICE))
        full, want = got.clone(), got.clone()
        kernels.flush(*pools, src, dst, got, layout, sink_rows=rows)
        assert kfl._PLANS.replays == before + i, "call did not take the expected path"
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "0")
        kernels.flush(*pools, src, dst, full, layout, sink_rows=rows)
        monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
        assert torch.equal(got, full), f"call {i}: replay differs from the full path"
        reference.flush(*pools, src, dst, want, layout, sink_rows=rows)
        sink_tiles = None if rows is None else (rows >= 0).repeat_interleave(hkv)
        _check_flush(request, got, want, src, dst, layout, pools, f"call{i}_", sink_tiles)


def test_flush_switch_takes_the_full_path(gen, request, monkeypatch):
    """``FORCE_PARTS`` (read at launch) is part of the signature: one program per tile is
    recorded anew, not served by the split plan, and gives the same records' bound."""
    monkeypatch.setenv("KVARN_FAST_LAUNCH", "1")
    kfl._PLANS.clear()
    layout = kf.dense_layout("kvarn_k4v2_g64", 128)
    pools = _flush_pool(gen, layout, 8, 8, torch.bfloat16)
    src = torch.tensor([5, 2], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
    shape = (8, 8, layout.record_bytes)
    split, one, want = (
        poison_(torch.empty(shape, dtype=torch.uint8, device=DEVICE)) for _ in "abc"
    )
    kernels.flush(*pools, src, dst, split, layout)
    n = kfl._PLANS.replays
    monkeypatch.setattr(kfl, "FORCE_PARTS", 1)
    kernels.flush(*pools, src, dst, one, layout)
    assert kfl._PLANS.replays == n, "a switch change replayed the old plan"
    reference.flush(*pools, src, dst, want, layout)
    _check_flush(request, split, want, src, dst, layout, pools, "split_")
    _check_flush(request, one, want, src, dst, layout, pools, "one_")
