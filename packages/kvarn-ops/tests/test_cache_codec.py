"""``kvarn_ops.cache_codec``: a [B, Hkv, n, D] K/V stream's full tiles to records and back,
through the Triton kernels (here under the interpreter) against the reference.

- encode, kernels: the records of tile ``t`` of row ``b`` and head ``h`` are the reference's
  records of that tile rotated into the pool's dtype (``test_flush._compare``: codes >= 99.9%
  identical, the rest 1 LSB apart, the decoded error within 1.02x the reference's), with the
  sink's V row in each row's first tile only; packing a stream tile by tile gives the bytes
  of packing it at once.
- decode, kernels: every element within the materialize test's bound of the reference's
  decode of the same records (one bf16/fp16 rounding, fp32 sums in another order).
- the backend rules: ``auto`` takes the reference on the CPU and for float32; ``kernels``
  refuses what it cannot take, naming the argument.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from conftest import realistic_kv  # noqa: E402
from kvarn_ops import cache_codec as cc  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from test_flush import _compare  # noqa: E402
from test_materialize import ATOL_REL, EPS  # noqa: E402


def _stream(gen, b, hkv, n, d, dtype):
    """Realistic K/V ``[B, Hkv, n, D]`` in the model frame."""
    k = realistic_kv(gen, b * n, hkv, d).view(b, n, hkv, d).transpose(1, 2)
    v = realistic_kv(gen, b * n, hkv, d).view(b, n, hkv, d).transpose(1, 2)
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


def _expected(k, v, lay, first):
    """Reference records ``[B * tiles, Hkv, R]`` and rotated tiles ``[B * tiles, Hkv, G, D]``
    of each tile, computed tile by tile (the pool rounds the rotation to ``k.dtype``)."""
    b, hkv, n, d = k.shape
    g = lay.block_size
    recs, kts, vts = [], [], []
    for row in range(b):
        for t in range(n // g):
            kt = ref.hadamard(k[row, :, t * g : (t + 1) * g].float()).to(k.dtype).float()
            vt = ref.hadamard(v[row, :, t * g : (t + 1) * g].float()).to(v.dtype).float()
            sink = torch.full((hkv,), 0 if (first and t == 0) else -1, dtype=torch.int32)
            recs.append(ref.encode_records(kt, vt, lay, sink_rows=sink))
            kts.append(kt)
            vts.append(vt)
    return torch.stack(recs), torch.stack(kts), torch.stack(vts)


CASES = [
    # (format, D, B, Hkv, tiles, dtype)
    ("kvarn_k4v2_g64", 64, 2, 2, 2, torch.bfloat16),
    ("kvarn_k2v2_g32", 128, 1, 1, 3, torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[5])[6:]}")
def test_kernel_records_are_the_reference_records_of_each_tile(case, gen):
    fmt, d, b, hkv, tiles, dtype = case
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    k, v = _stream(gen, b, hkv, tiles * g, d, dtype)
    got = cc.encode_tiles(k, v, lay, True, "kernels")
    assert got.shape == (b, tiles, hkv, lay.record_bytes)
    want, kt, vt = _expected(k, v, lay, first=True)
    dst = torch.arange(b * tiles, dtype=torch.int32)
    _compare(got.reshape(b * tiles, hkv, -1), want, dst, lay, (kt, vt))
    # the sink's V row only in each row's first tile: packed as a later tile, the same tokens
    # give other records
    later = cc.encode_tiles(k[:, :, :g], v[:, :, :g], lay, False, "kernels")
    assert not torch.equal(later[:, 0], got[:, 0])
    # tile by tile (as a cache packs them) gives the bytes of packing the stream at once
    parts = [cc.encode_tiles(k[:, :, :g], v[:, :, :g], lay, True, "kernels")]
    for t in range(1, tiles):
        sl = slice(t * g, (t + 1) * g)
        parts.append(cc.encode_tiles(k[:, :, sl], v[:, :, sl], lay, False, "kernels"))
    assert torch.equal(torch.cat(parts, dim=1), got)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[5])[6:]}")
def test_kernel_decode_matches_the_reference_decode(case, gen):
    fmt, d, b, hkv, tiles, dtype = case
    lay = kf.dense_layout(fmt, d)
    k, v = _stream(gen, b, hkv, tiles * lay.block_size, d, dtype)
    recs = cc.encode_tiles(k, v, lay, True, "reference")
    got = cc.decode_tiles(recs, lay, dtype, "kernels")
    want = cc.decode_tiles(recs, lay, torch.float32, "reference")
    for x, y in zip(got, want, strict=True):
        assert x.dtype == dtype and x.shape == (b, hkv, tiles * lay.block_size, d)
        bound = EPS[dtype] * y.abs() + ATOL_REL * y.abs().max()
        assert bool(((x.float() - y).abs() <= bound).all()), float((x.float() - y).abs().max())
    # no tiles: empty
    none = cc.decode_tiles(recs[:, :0], lay, dtype, "kernels")
    assert none[0].shape == (b, hkv, 0, d)


def test_backend_rules(monkeypatch):
    bf = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    assert cc.choose_backend("auto", bf) == "reference"  # a CPU tensor
    assert cc.choose_backend("auto", bf.float()) == "reference"
    assert cc.choose_backend("reference", bf) == "reference"
    assert cc.choose_backend("kernels", bf) == "kernels"  # the interpreter is on here
    with pytest.raises(ValueError, match="^backend: expected one of"):
        cc.choose_backend("triton", bf)
    with pytest.raises(ValueError, match="^key_states: backend='kernels' takes bfloat16"):
        cc.choose_backend("kernels", bf.float())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="^key_states: backend='kernels' needs CUDA"):
        cc.choose_backend("kernels", bf)


def test_encode_refuses_a_partial_tile():
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    k = torch.randn(1, 1, 65, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^keys: 65 tokens is not a whole number of 64-token"):
        cc.encode_tiles(k, k, lay, True, "reference")
