"""The compute-ceiling probe (``benchmarks/probe_decode_compute.py``) times a decode step with
its block table folded onto a few physical blocks, so that the records come from L2. Offline,
this checks the fold: every entry, or exactly the asked share spread over every row, lands in
``[0, resident)``; the rest stay as they were; the other launch arguments are the same
objects; bad arguments raise ``ValueError`` naming them. And the tensor-core probe's partner
operands are what its docstring says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
_BENCH = HERE.parent / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(_BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(_BENCH))


@pytest.fixture(scope="module")
def probe():
    return _load("probe_decode_compute")


def _args(gen, b=6, n=700):
    bt = torch.randperm(b * n, generator=gen).to(torch.int32).view(b, n) + 1000
    return ("q", "records", bt, "seq", "ek", "ev")


@pytest.mark.parametrize("share", [1.0, 0.3, 0.25, 0.0])
def test_fold_block_table(probe, gen, share):
    args = _args(gen)
    bt = args[2]
    out = probe.fold_block_table(args, 256, share)
    assert len(out) == len(args)
    assert all(o is a for i, (o, a) in enumerate(zip(out, args, strict=True)) if i != 2)
    new = out[2]
    assert new.dtype == bt.dtype and new.shape == bt.shape
    folded = new != bt  # the original entries are all >= 1000, so a folded one always moved
    assert bool((new[folded] < 256).all()) and bool((new[folded] >= 0).all())
    assert torch.equal(new[folded], torch.remainder(bt[folded], 256))
    # exactly round(100 share) of every 100 consecutive positions, so every request is folded
    # alike (700 entries a row: 7 x that many)
    per_row = folded.sum(dim=1)
    assert bool((per_row == 7 * round(100 * share)).all()), per_row
    assert torch.equal(bt, args[2])  # the input is left as it was


def test_fold_block_table_rejects_bad_arguments(probe, gen):
    args = _args(gen)
    with pytest.raises(ValueError, match="resident"):
        probe.fold_block_table(args, 0)
    with pytest.raises(ValueError, match="share"):
        probe.fold_block_table(args, 256, 1.5)
    with pytest.raises(ValueError, match="share"):
        probe.fold_block_table(args, 256, -0.1)


def test_tensor_probe_partners(gen):
    tp = _load("probe_tensor_subnormal")
    g = gen
    wide = tp.partners(64, 128, 16, "wide", g).float()
    # magnitudes under 2^-25 round to zero in fp16: a few percent of 2^-26 .. 2^4
    assert 0.0 < (wide == 0).float().mean().item() < 0.05
    assert wide.abs().min() < 2.0**-14  # fp16 subnormals among them
    assert wide.abs().max() > 1.0 and bool((wide < 0).any()) and bool((wide > 0).any())
    lo = tp.partners(64, 128, 16, "lo", g).float()
    # low parts: at most half an fp16 ulp (2^-11 relative) of |hi| < 2^2 * 8 sigma
    assert lo.abs().max() < 2.0**-6 and bool((lo != 0).any())
    assert lo.abs().median() < 2.0**-10
    with pytest.raises(ValueError, match="kind"):
        tp.partners(2, 2, 2, "nope", g)


def test_with_splits_sizes_the_workspace_for_the_inputs(monkeypatch):
    """``probe_decode_fixed.with_splits`` (both probes' sweeps) asks ``decode_workspace`` for
    the inputs' own geometry, longest context (tails included) and block size, and puts the
    workspace last, leaving every other argument as it was."""
    pf = _load("probe_decode_fixed")
    import kvarn_formats as kf

    seen = {}

    def fake_workspace(*a, **kw):
        seen["args"], seen["kw"] = a, kw
        return "ws"

    monkeypatch.setattr(pf.kd, "decode_workspace", fake_workspace)
    lay = kf.dense_layout("kvarn_k4v2_g128", 64)
    q = torch.zeros(5, 2, 12, 64)
    packed = torch.zeros(7, 3, lay.record_bytes, dtype=torch.uint8)
    seq = torch.tensor([100, 4133, 7, 9, 4100], dtype=torch.int32)
    args = (q, packed, "bt", seq, "ek", "ev", None, None, "tail", lay, 0.1, "out", "old_ws")
    out = pf.with_splits(args, 6)
    assert out[:12] == args[:12] and out[12] == "ws"
    assert seen["args"] == (5, 2, 12, 3, 64, 4133, 128)
    assert seen["kw"] == {"device": "cuda", "num_splits": 6}
