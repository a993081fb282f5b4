"""The attention-sink token's key on every channel's grid at 2 bits (``reference/sink_key.py``,
``kernels/flush_sink_key.py``).

What must hold, and why:

- reference: in a marked 2-bit K tile, the sink token's key decodes to the input within the
  fp16 rounding of the scale fields it passes through (every live channel's grid has a level
  at its value); unmarked tiles, 4-bit K, ``sink_key=False`` and configs without
  ``sink_token`` give the same K bytes as no marks; no other field changes (the token
  scales of a marked tile only by the fp16 rebalance's power of two); scaling by a power
  of two keeps the codes and scales the decoded key exactly (up to a subnormal zero point's
  fp16 rounding, ``conftest.assert_power_of_two_scaled``).
- kernel: the Triton flush with ``sink_rows`` at 2-bit K against ``reference.flush`` (codes
  >= 99.9% identical, the decoded tile's error within 1.02x, ``test_flush._compare``), one
  program per tile and split tiles; the sink key's own error as the reference's.
- bad marks raise ValueError naming the argument.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from conftest import assert_power_of_two_scaled, realistic_kv  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from test_flush import POISON  # noqa: E402
from test_sink_token import _sink_pool, flush_with_marks  # noqa: E402

FLUSH_MOD = importlib.import_module("kvarn_ops.kernels.flush")
NO_KEY = replace(ref.DEFAULT_CONFIG, sink_key=False)
K_FIELDS = ("k_codes", "k_col_scale", "k_zero_point", "k_row_scale")


def _keys(gen, n, g, d):
    """Rotated key tiles whose token 0 is an outlier, as attention sinks' keys are."""
    k = realistic_kv(gen, n * g, 1, d).reshape(n, g, d)
    k[:, 0] = 3.0 * k[:, 0] + 2.0
    return ref.hadamard(k)


def _rel(dec, x, t, tok):
    return float((dec[t, tok] - x[t, tok]).norm() / x[t, tok].norm())


@pytest.mark.parametrize("d", [64, 128])
def test_sink_key_decodes_almost_exactly(d, gen):
    k = _keys(gen, 4, 64, d)
    marks = torch.tensor([0, 0, 23, -1])
    dec = ref.dequantize_k(ref.quantize_k(k, 2, ref.DEFAULT_CONFIG, marks), torch.float64)
    plain = ref.dequantize_k(ref.quantize_k(k, 2, NO_KEY, marks), torch.float64)
    x = k.double()
    for t, tok in ((0, 0), (1, 0), (2, 23)):
        # code * step + zero point, times the token's scale: three fp16 roundings of terms at
        # most 3 steps + the zero point, relative to the largest value of the key.
        mag = x[t, tok].abs().amax()
        err = (dec[t, tok] - x[t, tok]).abs().amax()
        assert float(err) <= 8 * 2.0**-11 * float(mag), float(err / mag)
        assert _rel(plain, x, t, tok) > 20 * _rel(dec, x, t, tok)
    assert torch.equal(dec[3], plain[3])
    # The other tokens are not much worse off (the pinned grid has one free parameter less).
    others = torch.ones(64, dtype=torch.bool)
    others[0] = False
    e_pin = float((dec[0, others] - x[0, others]).norm())
    e_plain = float((plain[0, others] - x[0, others]).norm())
    assert e_pin < 1.25 * e_plain


def test_only_marked_2bit_k_changes(gen):
    k = _keys(gen, 3, 64, 128)
    v = realistic_kv(gen, 3 * 64, 1, 128).reshape(3, 64, 128)
    marks = torch.tensor([0, -1, 5], dtype=torch.int32)
    for fmt in ("kvarn_k2v2_g64", "kvarn_k4v2_g64"):
        lay = kf.dense_layout(fmt, 128)
        with_key = ref.record_fields(ref.encode_records(k, v, lay, sink_rows=marks), lay)
        no_key = ref.record_fields(
            ref.encode_records(k, v, lay, config=NO_KEY, sink_rows=marks), lay
        )
        unmarked = ref.record_fields(ref.encode_records(k, v, lay), lay)
        for name in with_key:
            same = torch.equal(with_key[name], no_key[name])
            if fmt == "kvarn_k2v2_g64" and name in ("k_codes", "k_col_scale", "k_zero_point"):
                assert not same, name
                assert torch.equal(with_key[name][1], no_key[name][1]), name
            elif fmt == "kvarn_k2v2_g64" and name == "k_row_scale":
                # The token scales are the same up to the fp16 rebalance: new channel steps
                # may move the tile's power-of-two split between the two axes.
                assert torch.equal(with_key[name][1], no_key[name][1]), name
                for n in (0, 2):
                    ratio = (with_key[name][n].double() / no_key[name][n].double()).unique()
                    assert ratio.numel() == 1, (n, ratio)
                    assert float(ratio) == 2.0 ** round(float(ratio.log2())), (n, ratio)
            else:
                assert same, (fmt, name)
        for name in K_FIELDS:
            assert torch.equal(no_key[name], unmarked[name]), name
    lay = kf.dense_layout("kvarn_k2v2_g64", 128)
    plain = replace(ref.DEFAULT_CONFIG, sink_token=False)
    assert torch.equal(
        ref.encode_records(k, v, lay, config=plain, sink_rows=marks),
        ref.encode_records(k, v, lay, config=plain),
    )


@pytest.mark.parametrize("power", [-12, 7])
def test_scale_invariance(power, gen):
    k = _keys(gen, 2, 64, 64)
    marks = torch.tensor([0, 11])
    a = ref.quantize_k(k, 2, ref.DEFAULT_CONFIG, marks)
    b = ref.quantize_k(k * 2.0**power, 2, ref.DEFAULT_CONFIG, marks)
    assert torch.equal(a["k_codes"], b["k_codes"])
    c = 2.0**power
    x1, x2 = ref.dequantize_k(a, torch.float64), ref.dequantize_k(b, torch.float64)
    assert_power_of_two_scaled(a, b, x1, x2, c, "k")


def test_bad_marks_rejected(gen):
    k = _keys(gen, 2, 64, 64)
    with pytest.raises(ValueError, match="sink_rows"):
        ref.quantize_k(k, 2, ref.DEFAULT_CONFIG, torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="sink_cols"):
        ref.quantize_tiles(
            k.transpose(1, 2).contiguous(), 2, ref.DEFAULT_CONFIG, sink_cols=torch.tensor([0.0, 1])
        )


KERNEL_CASES = [
    # (format, D, pool dtype, Hkv, N, P, packed blocks, forced programs per tile)
    ("kvarn_k2v2_g64", 128, torch.bfloat16, 2, 3, 4, 5, None),
    ("kvarn_k2v4_g64", 64, torch.float8_e4m3fn, 1, 3, 3, 4, 4),
    ("kvarn_k2v2_g128", 64, torch.float16, 1, 3, 3, 3, 2),
]


@pytest.mark.parametrize(
    "case", KERNEL_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[2])[6:]}-parts{c[7]}"
)
def test_flush_pins_sink_keys_as_reference(case, gen):
    fmt, d, pdt, hkv, n, p, nb, parts = case
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    _, _, dst, marks, packed, packed_ref, tiles = flush_with_marks(case, gen)
    kt = tiles[0].reshape(-1, g, d).double()
    got, want = (
        ref.decode_records(x[dst.long()].reshape(-1, lay.record_bytes), lay, torch.float64)[0]
        for x in (packed, packed_ref)
    )
    for block, tok in ((0, 0), (2, int(marks[2]))):
        for h in range(hkv):
            t = block * hkv + h
            e_got, e_want = _rel(got, kt, t, tok), _rel(want, kt, t, tok)
            assert e_got <= 1.02 * e_want + 1e-3, (e_got, e_want)
            assert e_got < 0.02


def test_flush_without_sink_key(gen):
    lay = kf.dense_layout("kvarn_k2v2_g64", 64)
    ek, ev, ks, vs = _sink_pool(gen, 2, 64, 1, 64, torch.bfloat16)
    src = torch.tensor([0, 1], dtype=torch.int32)
    dst = torch.tensor([1, 0], dtype=torch.int32)
    marks = torch.tensor([0, 3], dtype=torch.int32)
    a = torch.full((2, 1, lay.record_bytes), POISON, dtype=torch.uint8)
    b, c = a.clone(), a.clone()
    FLUSH_MOD.flush(ek, ev, ks, vs, src, dst, a, lay, config=NO_KEY, sink_rows=marks)
    FLUSH_MOD.flush(ek, ev, ks, vs, src, dst, b, lay)
    FLUSH_MOD.flush(ek, ev, ks, vs, src, dst, c, lay, sink_rows=marks)
    fa, fb, fc = (ref.record_fields(x.reshape(2, -1), lay) for x in (a, b, c))
    assert torch.equal(fa["k_codes"], fb["k_codes"])
    assert not torch.equal(fa["k_codes"], fc["k_codes"])
