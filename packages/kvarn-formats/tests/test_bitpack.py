"""Pure-Python bit packing against the published vectors and random round trips."""

import random

import pytest

import kvarn_formats as kf

PUBLISHED = [
    ([0, 1, 2, 3, 0, 1, 2, 3], 2, [228, 228]),
    (list(range(8)), 4, [16, 50, 84, 118]),
    (list(range(8)), 5, [32, 136, 65, 138, 57]),
]


@pytest.mark.parametrize(("codes", "bits", "expected"), PUBLISHED)
def test_published_vectors(codes, bits, expected):
    assert list(kf.pack_codes(codes, bits)) == expected
    assert kf.unpack_codes(bytes(expected), bits, len(codes)) == codes


@pytest.mark.parametrize("bits", range(1, 9))
def test_random_round_trip(bits):
    rng = random.Random()
    count = rng.randint(1, 300)
    codes = [rng.randrange(1 << bits) for _ in range(count)]
    data = kf.pack_codes(codes, bits)
    assert len(data) == kf.packed_size(count, bits) == -(-count * bits // 8)
    assert kf.unpack_codes(data, bits, count) == codes
    # Bit i*b + j of the stream is bit j of code i.
    for i in rng.sample(range(count), min(count, 20)):
        for j in range(bits):
            pos = i * bits + j
            assert (data[pos // 8] >> (pos % 8)) & 1 == (codes[i] >> j) & 1


def test_bad_input():
    with pytest.raises(ValueError, match="bits must be an integer from 1 to 8"):
        kf.pack_codes([1], 9)
    with pytest.raises(ValueError, match=r"codes\[1\] = 4 does not fit in 2 bits"):
        kf.pack_codes([1, 4], 2)
    with pytest.raises(ValueError, match="does not fit"):
        kf.pack_codes([-1], 3)
    with pytest.raises(ValueError, match="need 2"):
        kf.unpack_codes(b"\x00", 4, 3)
    with pytest.raises(ValueError, match=r"codes\[0\] = True"):
        kf.pack_codes([True, False], 2)
    for count in (2.5, True, -1):
        with pytest.raises(ValueError, match="count must be an integer"):
            kf.packed_size(count, 4)
