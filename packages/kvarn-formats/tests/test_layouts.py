"""Record layouts: published sizes and offsets, invariants for every format, JSON form."""

import json

import pytest

import kvarn_formats as kf

# docs/kvarn-method.md, section 2 (dense, head_dim 128) and section 4 (MLA).
PUBLISHED_DENSE = {
    "kvarn_k4v2_g128": (13824, 108),
    "kvarn_k4v4_g128": (17920, 140),
    "kvarn_k4v2_g64": (7296, 114),
    "kvarn_k4v4_g64": (9344, 146),
    "kvarn_k5v5_g64": (11392, 178),
    "kvarn_k2v2_g128": (9728, 76),
}
PUBLISHED_MLA = {
    5: (20480, 20480, 21504, 22528, 22656, 30848, 482),
    4: (16384, 16384, 17408, 18432, 18560, 26752, 418),
    2: (8192, 8192, 9216, 10240, 10368, 18560, 290),
}


@pytest.mark.parametrize(("name", "expected"), PUBLISHED_DENSE.items())
def test_published_dense_sizes(name, expected):
    layout = kf.dense_layout(name, 128)
    assert (layout.record_bytes, layout.bytes_per_token) == expected
    assert kf.compression_ratio(layout) == pytest.approx(512 / expected[1])


@pytest.mark.parametrize("bits", sorted(PUBLISHED_MLA))
def test_published_mla_offsets(bits):
    codes, s_col, zp, s_row, rope, tile, per_token = PUBLISHED_MLA[bits]
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    got = [(f.name, f.offset, f.size) for f in layout.fields]
    assert got == [
        ("codes", 0, codes),
        ("col_scale", s_col, 1024),
        ("zero_point", zp, 1024),
        ("row_scale", s_row, 128),
        ("rope", rope, 8192),
    ]
    assert layout.record_bytes == tile
    assert layout.bytes_per_token == per_token


def test_staged_fp8_record():
    layout = kf.STAGED_MLA_FP8
    assert layout.record_bytes == 656
    assert [(f.name, f.offset, f.size, f.dtype) for f in layout.fields] == [
        ("latent", 0, 512, "float8_e4m3fn"),
        ("scales", 512, 16, "float32"),
        ("rope", 528, 128, "bfloat16"),
    ]


def _all_layouts():
    for name in kf.all_format_names():
        fmt = kf.parse_format(name)
        if isinstance(fmt, kf.DenseFormat):
            for d in kf.DENSE_HEAD_DIMS:
                yield kf.dense_layout(fmt, d)
        elif fmt.group == 64:
            yield kf.mla_layout(fmt)
    yield kf.STAGED_MLA_FP8


def _expected_size(field):
    if field.dtype == "codes":
        return -(-field.count * field.bits // 8)
    return (
        field.count * {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}[field.dtype]
    )


def test_invariants_hold_for_every_layout():
    seen = 0
    for layout in _all_layouts():
        seen += 1
        end = 0
        for field in layout.fields:
            assert field.offset % 16 == 0, (layout.format_name, field)
            assert field.offset >= end, f"{layout.format_name}: {field.name} overlaps"
            assert field.size == _expected_size(field)
            end = field.end
        assert end <= layout.record_bytes
        # Exact size: only the tail alignment of the last field, never power-of-two rounding.
        assert layout.record_bytes == -(-end // 16) * 16
        if layout.kind == "dense":
            fmt = kf.parse_format(layout.format_name)
            d, g = layout.head_dim, layout.block_size
            expected = d * g * (fmt.k_bits + fmt.v_bits) // 8 + 2 * (3 * d + 3 * g)
            assert layout.record_bytes == expected
            assert layout.field("k_codes").shape == (d, g)
            assert layout.field("v_codes").shape == (g, d)
    assert seen == 7 * 7 * 3 * 4 + 7 + 1


def test_no_power_of_two_rounding_at_large_head_dim():
    layout = kf.dense_layout("kvarn_k4v4_g64", 256)
    # 256*64 codes of 8 bits (K+V) + 3*256 + 3*64 fp16 scales, over 64 tokens; upstream pads
    # the per-token slot to 512 bytes.
    assert layout.bytes_per_token == (256 * 64 + 2 * (3 * 256 + 3 * 64)) / 64 == 286


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: kf.dense_layout("kvarn_k4v2_g64", 96),
            "head_dim must be one of 64, 128, 256, 512",
        ),
        (lambda: kf.dense_layout("kvarn_mla_k4_g64", 128), "is an MLA format"),
        (lambda: kf.mla_layout("kvarn_k4v2_g64"), "is a dense format"),
        (lambda: kf.mla_layout("kvarn_mla_k4_g128"), "only for g64"),
        (lambda: kf.mla_layout("kvarn_mla_k4_g64", latent_dim=256), "latent_dim=512"),
        (lambda: kf.layout_for("kvarn_k4v2_g64"), "give head_dim"),
        (lambda: kf.layout_for("kvarn_mla_k4_g64", 128), "latent dim 512"),
    ],
)
def test_layout_errors(call, message):
    with pytest.raises(kf.LayoutError, match=message):
        call()


def test_unknown_field_names_the_fields():
    with pytest.raises(KeyError, match="fields: k_codes"):
        kf.dense_layout("kvarn_k4v2_g64", 64).field("codes")


def test_json_round_trip_for_every_layout():
    for layout in _all_layouts():
        text = layout.to_json()
        assert json.loads(text)["schema_version"] == 1
        assert kf.layout_from_json(text) == layout


def test_json_rejects_tampering_and_garbage():
    data = json.loads(kf.dense_layout("kvarn_k4v2_g64", 128).to_json())
    data["fields"][1]["offset"] += 16
    with pytest.raises(kf.LayoutError, match="does not match"):
        kf.layout_from_dict(data)
    data = json.loads(kf.dense_layout("kvarn_k4v2_g64", 128).to_json())
    data["schema_version"] = 99
    with pytest.raises(kf.LayoutError, match="schema_version 99"):
        kf.layout_from_dict(data)
    data["schema_version"] = 1
    data["format"] = "kvarn_k4v9_g64"
    with pytest.raises(kf.LayoutError, match="invalid format"):
        kf.layout_from_dict(data)
    del data["fields"]
    with pytest.raises(kf.LayoutError, match="malformed"):
        kf.layout_from_dict(data)
    with pytest.raises(kf.LayoutError, match="not valid JSON"):
        kf.layout_from_json("{")
    with pytest.raises(kf.LayoutError, match="JSON object"):
        kf.layout_from_json("[]")


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d["fields"][1].__setitem__("offset", d["fields"][1]["offset"] + 0.5),
        lambda d: d.__setitem__("head_dim", str(d["head_dim"])),
        lambda d: d.__setitem__("schema_version", True),
        lambda d: d.__setitem__("endianness", "big"),
        lambda d: d["fields"][0].__setitem__("packing", "msb"),
        lambda d: d["fields"][0].__setitem__("shape", [128.0, 64]),
        lambda d: d["fields"][0].__setitem__("bits", "4"),
    ],
    ids=[
        "float-offset",
        "str-head-dim",
        "bool-version",
        "unknown-key",
        "unknown-field-key",
        "float-shape",
        "str-bits",
    ],  # fmt: skip
)
def test_json_refuses_wrong_types_and_unknown_keys(tamper):
    """Values are not converted (4096.5 is not an offset) and no key is ignored: a document
    this version does not fully understand is refused, naming what is wrong."""
    data = json.loads(kf.dense_layout("kvarn_k4v2_g64", 128).to_json())
    tamper(data)
    with pytest.raises(kf.LayoutError, match="malformed layout description"):
        kf.layout_from_dict(data)


def test_hand_built_formats_are_checked_like_names():
    with pytest.raises(kf.FormatError):
        kf.dense_layout(kf.DenseFormat(9, 2, 48), 128)
    with pytest.raises(kf.FormatError):
        kf.mla_layout(kf.MlaFormat(1, 64))
    with pytest.raises(kf.FormatError, match="g32|group"):
        kf.mla_layout(kf.MlaFormat(4, 32))
    with pytest.raises(kf.FormatError):
        kf.layout_for(object(), 128)  # type: ignore[arg-type]
    assert kf.dense_layout(kf.DenseFormat(4, 2, 64), 128) == kf.dense_layout("kvarn_k4v2_g64", 128)


def test_layouts_are_built_once_and_errors_are_not_cached():
    """Launchers ask for their layout on every call: the same immutable object comes back
    (for equal head_dim values of other types too, as a plain int), and a bad request raises
    every time."""
    a = kf.dense_layout("kvarn_k4v2_g64", 128)
    assert kf.dense_layout("kvarn_k4v2_g64", 128) is a
    assert kf.dense_layout(kf.parse_format("kvarn_k4v2_g64"), 128) is a
    b = kf.dense_layout("kvarn_k4v2_g64", 128.0)
    assert b is a and type(b.head_dim) is int
    assert kf.dense_layout("kvarn_k4v2_g64", 64) is not a
    m = kf.mla_layout("kvarn_mla_k5_g64")
    assert kf.mla_layout("kvarn_mla_k5_g64") is m
    assert m != kf.mla_layout("kvarn_mla_k4_g64")
    assert kf.parse_format("kvarn_k2v2_g32") is kf.parse_format("kvarn_k2v2_g32")
    for _ in range(2):
        with pytest.raises(kf.FormatError, match="kvarn_k4v2_g64"):
            kf.dense_layout("kvarn_k4v2_g65", 128)
        with pytest.raises(kf.LayoutError, match="head_dim"):
            kf.dense_layout("kvarn_k4v2_g64", 100)
        with pytest.raises(kf.LayoutError, match="latent_dim"):
            kf.mla_layout("kvarn_mla_k5_g64", latent_dim=256)
        with pytest.raises(kf.FormatError, match="string"):
            kf.parse_format(["kvarn_k4v2_g64"])
