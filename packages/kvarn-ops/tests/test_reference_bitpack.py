"""Bit packing: published vectors and bit-exact agreement with kvarn_formats.pack_codes
(no tolerances: packing is exact)."""

from __future__ import annotations

import pytest
import torch

import kvarn_formats as kf
from kvarn_ops import reference as ref


@pytest.mark.parametrize(
    "codes, bits, packed",
    [
        ([0, 1, 2, 3, 0, 1, 2, 3], 2, [228, 228]),
        (list(range(8)), 4, [16, 50, 84, 118]),
        (list(range(8)), 5, [32, 136, 65, 138, 57]),
    ],
)
def test_published_vectors(codes, bits, packed):
    got = ref.pack_codes(torch.tensor(codes, dtype=torch.uint8), bits)
    assert got.dtype == torch.uint8
    assert got.tolist() == packed
    assert (
        ref.unpack_codes(torch.tensor(packed, dtype=torch.uint8), bits, len(codes)).tolist()
        == codes
    )


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("count", [8, 13, 64 * 64, 8191])
def test_matches_kvarn_formats_on_random_codes(gen, bits, count):
    codes = torch.randint(0, 1 << bits, (3, 2, count), generator=gen, dtype=torch.int64)
    got = ref.pack_codes(codes, bits)
    assert got.shape == (3, 2, kf.packed_size(count, bits))
    for row_codes, row_packed in zip(codes.reshape(-1, count), got.reshape(6, -1), strict=True):
        assert bytes(row_packed.tolist()) == kf.pack_codes(row_codes.tolist(), bits)
    back = ref.unpack_codes(got, bits, count)
    assert back.dtype == torch.uint8
    assert torch.equal(back.to(torch.int64), codes)


@pytest.mark.parametrize("bits", range(2, 9))
def test_unpacks_kvarn_formats_bytes(gen, bits):
    codes = torch.randint(0, 1 << bits, (517,), generator=gen).tolist()
    data = torch.tensor(list(kf.pack_codes(codes, bits)), dtype=torch.uint8)
    assert ref.unpack_codes(data, bits, len(codes)).tolist() == codes


@pytest.mark.parametrize("bits", range(2, 9))
def test_unpacks_a_strided_field_with_bytes_around_it(gen, bits):
    """A record's codes field is a strided slice of the record rows, with other fields' bytes
    before and after it (``records.field_bytes``)."""
    count = 61
    rows = [torch.randint(0, 1 << bits, (count,), generator=gen).tolist() for _ in range(4)]
    need = kf.packed_size(count, bits)
    buf = torch.randint(0, 256, (4, need + 9), generator=gen).to(torch.uint8)
    for i, codes in enumerate(rows):
        buf[i, 3 : 3 + need] = torch.tensor(list(kf.pack_codes(codes, bits)), dtype=torch.uint8)
    got = ref.unpack_codes(buf[:, 3:], bits, count)
    assert got.is_contiguous() and got.tolist() == rows


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="^bits:"):
        ref.pack_codes(torch.zeros(8, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="^bits:"):
        ref.unpack_codes(torch.zeros(8, dtype=torch.uint8), 9, 8)
    with pytest.raises(ValueError, match="^codes:.*dtype"):
        ref.pack_codes(torch.ones(8), 4)
    with pytest.raises(ValueError, match="^data:.*need 5 bytes"):
        ref.unpack_codes(torch.zeros(4, dtype=torch.uint8), 5, 8)
    with pytest.raises(ValueError, match="^data:.*dtype"):
        ref.unpack_codes(torch.zeros(8, dtype=torch.int32), 4, 8)
