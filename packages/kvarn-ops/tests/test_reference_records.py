"""Whole records: every byte written at the layout's offsets, exact code round trips,
bounded reconstruction error.

Tolerances:
- record bytes, codes, fp16 fields: exact; why: packing and field placement are exact
- decode(encode(x)) element error: ``error_bound`` of test_reference_quantize; why: RTN half
  step + fp16 scale rounding
- relative rms error, 4-bit K on realistic tiles: < 0.12; why: uniform RTN: step/sqrt(12) ~ 0.09
  of a gaussian channel
"""

from __future__ import annotations

import pytest
import torch

import kvarn_formats as kf
from conftest import realistic_kv
from kvarn_ops import reference as ref
from test_reference_quantize import RTN, error_bound

LAYOUTS = [
    ("kvarn_k4v2_g64", 128),
    ("kvarn_k2v2_g128", 64),
    ("kvarn_k5v5_g32", 256),
    ("kvarn_k8v3_g64", 512),
    ("kvarn_k3v7_g32", 64),
]


def rotated_kv(gen, n, g, d):
    return ref.hadamard(realistic_kv(gen, n, g, d)), ref.hadamard(realistic_kv(gen, n, g, d))


@pytest.mark.parametrize("fmt,d", LAYOUTS)
def test_every_byte_written_and_fields_in_place(gen, fmt, d):
    lay = kf.dense_layout(fmt, d)
    k, v = rotated_kv(gen, 3, lay.block_size, d)
    fresh = ref.encode_records(k, v, lay)
    out = torch.full((3, lay.record_bytes), 0xFF, dtype=torch.uint8)
    got = ref.encode_records(k, v, lay, out=out)
    assert got is out and torch.equal(out, fresh)
    # Padding between fields is zero; each field holds exactly its own bytes.
    covered = torch.zeros(lay.record_bytes, dtype=torch.bool)
    for f in lay.fields:
        covered[f.offset : f.end] = True
    assert (out[:, ~covered] == 0).all()
    fields = ref.quantize_k(k, lay.field("k_codes").bits) | ref.quantize_v(
        v, lay.field("v_codes").bits
    )
    for f in lay.fields:
        raw = ref.field_bytes(out, lay, f.name)
        val = fields[f.name]
        if f.dtype == "codes":
            for i in range(3):
                assert bytes(raw[i].tolist()) == kf.pack_codes(val[i].flatten().tolist(), f.bits)
        else:
            assert torch.equal(
                raw.contiguous().view(torch.float16).view(3, *f.shape), val.view(3, *f.shape)
            )  # little-endian host


@pytest.mark.parametrize("fmt,d", LAYOUTS)
def test_fields_round_trip_exactly(gen, fmt, d):
    lay = kf.dense_layout(fmt, d)
    k, v = rotated_kv(gen, 4, lay.block_size, d)
    rec = ref.encode_records(k, v, lay)
    fields = ref.record_fields(rec, lay)
    assert set(fields) == set(ref.FIELD_NAMES)
    assert fields["k_codes"].shape == (4, d, lay.block_size)
    assert fields["v_codes"].shape == (4, lay.block_size, d)
    assert torch.equal(ref.fields_to_records(fields, lay), rec)
    # Arbitrary codes (not only those RTN produces) survive a record.
    for name in ("k_codes", "v_codes"):
        bits = lay.field(name).bits
        fields[name] = torch.randint(
            0, 1 << bits, fields[name].shape, generator=gen, dtype=torch.uint8
        )
    again = ref.record_fields(ref.fields_to_records(fields, lay), lay)
    for name in ref.FIELD_NAMES:
        assert torch.equal(again[name], fields[name]), name


@pytest.mark.parametrize("fmt,d", LAYOUTS)
def test_decode_error_is_bounded(gen, fmt, d):
    lay = kf.dense_layout(fmt, d)
    k, v = rotated_kv(gen, 4, lay.block_size, d)
    # The per-element bound is min/max RTN's (the default trades it for a lower mean error).
    rec = ref.encode_records(k, v, lay, config=RTN)
    dk, dv = ref.decode_records(rec, lay)
    f = ref.record_fields(rec, lay)
    kq = ref.QuantizedTiles(f["k_codes"], f["k_col_scale"], f["k_zero_point"], f["k_row_scale"])
    vq = ref.QuantizedTiles(f["v_codes"], f["v_row_scale"], f["v_zero_point"], f["v_col_scale"])
    assert ((dk - k).transpose(1, 2).abs().double() <= error_bound(kq, k.transpose(1, 2))).all()
    assert ((dv - v).abs().double() <= error_bound(vq, v)).all()
    if lay.field("k_codes").bits == 4:
        assert float((dk - k).norm() / k.norm()) < 0.12
    # Matches the contract's dequantization formulas literally.
    g = lay.block_size
    kk = (
        f["k_codes"].float() * f["k_col_scale"].float()[:, :, None]
        + f["k_zero_point"].float()[:, :, None]
    ) * f["k_row_scale"].float()[:, None, :]
    vv = (
        f["v_codes"].float() * f["v_row_scale"].float()[:, :, None]
        + f["v_zero_point"].float()[:, :, None]
    ) * f["v_col_scale"].float()[:, None, :]
    assert torch.equal(dk, kk.transpose(1, 2)) and dk.shape == (4, g, d)
    assert torch.equal(dv, vv)


def test_half_precision_inputs_match_fp32(gen):
    lay = kf.dense_layout("kvarn_k4v4_g64", 128)
    k, v = rotated_kv(gen, 2, 64, 128)
    k16, v16 = k.to(torch.bfloat16), v.to(torch.float16)
    assert torch.equal(
        ref.encode_records(k16, v16, lay), ref.encode_records(k16.float(), v16.float(), lay)
    )


def test_rejects_bad_input(gen):
    lay = kf.dense_layout("kvarn_k4v2_g64", 128)
    k, v = rotated_kv(gen, 2, 64, 128)
    cases = [
        (
            lambda: ref.encode_records(k[:, :32].contiguous(), v[:, :32].contiguous(), lay),
            "k",
            "64",
        ),
        (lambda: ref.encode_records(k, v[:1], lay), "v", "shape"),
        (lambda: ref.encode_records(k.double(), v, lay), "k", "dtype"),
        (
            lambda: ref.encode_records(k, v.transpose(1, 2).contiguous().transpose(1, 2), lay),
            "v",
            "contiguous",
        ),
        (lambda: ref.encode_records(k, v.to("meta"), lay), "v", "meta"),
        (
            lambda: ref.encode_records(k, v, kf.dense_layout("kvarn_k4v2_g64", 64)),
            "layout",
            "head_dim",
        ),
        (lambda: ref.encode_records(k, v, kf.mla_layout("kvarn_mla_k4_g64")), "layout", "mla"),
        (lambda: ref.encode_records(k, v, "kvarn_k4v2_g64"), "layout", "RecordLayout"),
        (
            lambda: ref.encode_records(k, v, lay, out=torch.empty(2, 7, dtype=torch.uint8)),
            "out",
            "shape",
        ),
        (
            lambda: ref.decode_records(torch.zeros(2, 100, dtype=torch.uint8), lay),
            "records",
            "bytes per record",
        ),
        (lambda: ref.decode_records(torch.zeros(2, lay.record_bytes), lay), "records", "dtype"),
    ]
    for fn, arg, match in cases:
        with pytest.raises(ValueError, match=rf"^{arg}:.*{match}"):
            fn()
