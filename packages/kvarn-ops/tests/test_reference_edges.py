"""Edge cases of the reference cache ops that the GPU parity suite first hit: a flush of a
single block (a non-contiguous view of the pool) and contexts shorter than one block."""

import os

import pytest
import torch

import kvarn_formats as kf
from kvarn_ops import reference as R


@pytest.fixture
def gen():
    g = torch.Generator()
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    g.manual_seed(seed)
    return g


@pytest.mark.parametrize("hkv", [1, 2])
def test_flush_one_block_then_read_short_and_full_contexts(gen, hkv):
    layout = kf.dense_layout("kvarn_k4v4_g64", 64)
    ek = torch.zeros(3, 64, hkv, 64, dtype=torch.bfloat16)
    ev = torch.zeros_like(ek)
    k = torch.randn(64, hkv, 64, generator=gen)
    v = torch.randn(64, hkv, 64, generator=gen)
    R.store(k, v, torch.arange(64) + 64, ek, ev)
    packed = torch.full((4, hkv, layout.record_bytes), 0xFF, dtype=torch.uint8)
    one = torch.tensor([1], dtype=torch.int32)
    R.flush(ek, ev, None, None, one, torch.tensor([2], dtype=torch.int32), packed, layout)
    assert (packed[[0, 1, 3]] == 0xFF).all()
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    for length in (30, 64):
        ko = torch.full((70, hkv, 64), float("nan"), dtype=torch.bfloat16)
        vo = ko.clone()
        lens = torch.tensor([length], dtype=torch.int32)
        cu = torch.tensor([0, length], dtype=torch.int32)
        R.materialize(packed, table, lens, ek, ev, None, None, one, layout, ko, vo, cu)
        assert torch.isfinite(ko[:length].float()).all()
        assert ko[length:].isnan().all()
        if length == 64:  # one packed block: 4-bit error
            err = (ko[:64].float() - k).norm() / k.norm()
            assert err < 0.15
        else:  # 30 exact tokens read from pool block 1, which holds the first 64 stored ones
            assert torch.allclose(ko[:30].float(), k[:30], rtol=2e-2, atol=2e-2)
        q = torch.randn(1, 1, 2 * hkv, 64, generator=gen)
        out = torch.full_like(q, float("nan"))
        R.decode(q, packed, table, lens, ek, ev, None, None, one, layout, 0.125, out, None)
        assert torch.isfinite(out).all()
