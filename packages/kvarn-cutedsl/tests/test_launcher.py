"""Host side of the launcher: argument checks, specs, workspace and split plan, and that
every refusal comes before any compile."""

from __future__ import annotations

import math

import pytest
import torch

import kvarn_formats as kf
from kvarn_cutedsl import _capability as cap
from kvarn_cutedsl import aot
from kvarn_cutedsl import launcher as dec
from kvarn_cutedsl._spec import make_spec, split_plan


def _case(
    fmt="kvarn_k4v2_g64",
    d=128,
    hq=8,
    hkv=2,
    lens=(70, 200),
    t=1,
    qd=torch.bfloat16,
    pd=torch.bfloat16,
):
    layout = kf.dense_layout(fmt, d)
    g = layout.block_size
    b = len(lens)
    mb = max(1, max(-(-n // g) for n in lens))
    packed = torch.zeros(b * mb + 1, hkv, layout.record_bytes, dtype=torch.uint8)
    table = torch.zeros(b, mb, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    pool = torch.zeros(b + 1, g, hkv, d, dtype=pd)
    fp8 = pd == torch.float8_e4m3fn
    sc = torch.ones(b + 1, g, hkv) if fp8 else None
    tail = torch.arange(b, dtype=torch.int32)
    q = torch.randn(b, t, hq, d).to(qd)
    out = torch.empty_like(q)
    ws = dec.decode_workspace(b, t, hq, hkv, d, max(lens), g, device="cpu")
    return [
        q,
        packed,
        table,
        seq,
        pool,
        pool.clone(),
        sc,
        None if sc is None else sc.clone(),
        tail,
        layout,
        1 / math.sqrt(d),
        out,
        ws,
    ]


@pytest.fixture
def no_compile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("compiled or loaded a kernel before refusing")

    monkeypatch.setattr(aot, "get_function", boom)
    monkeypatch.setattr(aot, "build", boom)


@pytest.mark.parametrize(
    ("index", "bad", "match"),
    [
        (0, torch.zeros(2, 1, 8, 128, dtype=torch.int32), "q: dtype"),
        (1, torch.zeros(3, 2, 100, dtype=torch.uint8), "record_bytes"),
        (2, torch.zeros(3, 4, dtype=torch.int32), "block_table"),
        (3, torch.tensor([70, 200], dtype=torch.int64), "seq_lens: dtype"),
        (8, torch.zeros(3, dtype=torch.int32), "tail_pool_block"),
        (10, float("nan"), "softmax_scale"),
        (10, 10**400, "softmax_scale"),  # too large for a float (OverflowError before)
        (10, -0.125, "softmax_scale"),
        (11, torch.empty(2, 1, 8, 64, dtype=torch.bfloat16), "out: expected shape"),
        (12, torch.empty(10), "workspace: too small"),
    ],
)
def test_bad_arguments_raise_value_error(no_compile, index, bad, match):
    args = _case()
    args[index] = bad
    with pytest.raises(ValueError, match=match):
        dec.decode(*args)


def test_short_seq_len_rejected_on_cpu(no_compile):
    args = _case(lens=(70, 1), t=2)
    with pytest.raises(ValueError, match="seq_lens"):
        dec.decode(*args)


@pytest.mark.parametrize("arch", ["sm_80a", "sm_100a", "sm_121a", "sm_120a"])
def test_unvalidated_arch_refused_before_compile(no_compile, monkeypatch, arch):
    monkeypatch.setenv(cap.ARCH_ENV, arch)
    with pytest.raises(NotImplementedError, match=arch):
        dec.decode(*_case())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(fmt="kvarn_k5v5_g64"), "K bits 5"),
        (dict(fmt="kvarn_k2v2_g128"), "K bits 2"),
        (dict(fmt="kvarn_k4v2_g64", d=256), "head_dim 256"),
        (dict(pd=torch.float8_e4m3fn), "float8_e4m3fn"),
        (dict(t=4, hq=8, hkv=2), "T=4, GQA=4"),
        (dict(qd=torch.float32), "q of float32"),
    ],
)
def test_unimplemented_refused_before_compile(no_compile, monkeypatch, kwargs, match):
    monkeypatch.setenv(cap.ARCH_ENV, "sm_90a")
    args = _case(**kwargs)
    with pytest.raises(NotImplementedError, match=match):
        dec.decode(*args)


def test_spec_matches_layout_fields():
    for fmt in ("kvarn_k4v2_g64", "kvarn_k4v4_g128"):
        for d in (64, 128):
            lay = kf.dense_layout(fmt, d)
            s = make_spec(fmt, d, 4, 1, torch.bfloat16, torch.float16)
            assert s.record_bytes == lay.record_bytes
            for name in (
                "k_codes",
                "k_col_scale",
                "k_zero_point",
                "k_row_scale",
                "v_codes",
                "v_col_scale",
                "v_row_scale",
                "v_zero_point",
            ):
                assert getattr(s, name) == lay.field(name).offset
                # fp16 fields are read through a half view of the record
                assert name.endswith("codes") or lay.field(name).offset % 2 == 0
            assert s.out_dtype == "bfloat16" and s.pool_dtype == "float16"
            assert s.rows == 4 and s.format_name == fmt


def test_spec_names_are_unique():
    names = {make_spec(*row).name for row in aot.PRESETS["all"]}
    assert len(names) == len(aot.PRESETS["all"])


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("splits", [1, 3, 16, 128])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 1000, 4113, 131077])
def test_split_plan_covers_every_unit_once(group, splits, length):
    plan = split_plan(length, group, splits)
    units = -(-length // group)
    assert 1 <= len(plan) <= splits
    covered = [u for a, b in plan for u in range(a, b)]
    assert covered == list(range(units))
    assert all(b > a for a, b in plan)


def test_workspace_matches_kvarn_ops_size():
    ws = dec.decode_workspace(3, 2, 12, 4, 64, 5000, 64, device="cpu", num_splits=7)
    assert ws.dtype == torch.float32 and ws.numel() == 7 * 3 * 2 * 12 * 65
    assert dec.decode_num_splits(1, 8, 32768, 64) == 66
    assert dec.decode_num_splits(64, 8, 4096, 64) == 2
    with pytest.raises(ValueError, match="num_splits"):
        dec.decode_workspace(1, 1, 1, 1, 64, 10, 64, device="cpu", num_splits=0)
