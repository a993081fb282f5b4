"""The dtype grammar: every valid name round-trips, every invalid string raises FormatError."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvarn_formats as kf


def test_every_valid_name_round_trips():
    names = kf.all_format_names()
    assert len(names) == 7 * 7 * 3 + 7 * 2
    for name in names:
        fmt = kf.parse_format(name)
        assert fmt.name == name == str(fmt)
        assert kf.parse_format(fmt.name) == fmt


def test_parse_fields():
    assert kf.parse_format("kvarn_k4v2_g64") == kf.DenseFormat(k_bits=4, v_bits=2, group=64)
    assert kf.parse_format("kvarn_k8v3_g32") == kf.DenseFormat(8, 3, 32)
    assert kf.parse_format("kvarn_mla_k5_g64") == kf.MlaFormat(bits=5, group=64)
    assert kf.parse_format("kvarn_mla_k2_g128") == kf.MlaFormat(2, 128)
    assert kf.parse_format("kvarn_k4v2_g64").kind == "dense"
    assert kf.parse_format("kvarn_mla_k4_g64").kind == "mla"


@pytest.mark.parametrize(
    ("text", "part", "suggestion"),
    [
        ("kvarn_k4v9_g64", "V bits must be one of 2, 3, 4, 5, 6, 7, 8, got 9", "kvarn_k4v8_g64"),
        ("kvarn_k1v2_g64", "K bits must be one of", "kvarn_k2v2_g64"),
        (
            "kvarn_k4v2_g65",
            "group size (tokens per tile) must be one of 32, 64, 128",
            "kvarn_k4v2_g64",
        ),
        ("kvarn_k4v2_g256", "must be one of 32, 64, 128, got 256", "kvarn_k4v2_g128"),
        ("kvarn_mla_k5_g32", "must be one of 64, 128, got 32", "kvarn_mla_k5_g64"),
        ("kvarn_mla_k9_g64", "latent bits must be one of", "kvarn_mla_k8_g64"),
        ("KVARN_K4V2_G64", "lower case", "kvarn_k4v2_g64"),
        (" kvarn_k4v2_g64", "no spaces", "kvarn_k4v2_g64"),
        ("kvarn_k04v2_g64", "leading zeros", "kvarn_k4v2_g64"),
        ("kvarn_k4v2", "dense names have the form", "kvarn_k4v2_g64"),
        ("fp8", "start with 'kvarn_'", "kvarn_k4v2_g64"),
        ("kvarn_mla_k5", "MLA names have the form", "kvarn_mla_k5_g64"),
        ("kvarn_k4v2_g64\u00e9", "plain ASCII", "kvarn_k4v2_g64"),
        ("kvarn_k4v2_g" + "9" * 5000, "longer than 64", "kvarn_k4v2_g128"),
    ],
)
def test_invalid_names_say_what_is_wrong(text, part, suggestion):
    with pytest.raises(kf.FormatError) as info:
        kf.parse_format(text)
    message = str(info.value)
    assert part in message
    assert f"did you mean {suggestion!r}" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", [None, 4, b"kvarn_k4v2_g64", ["kvarn_k4v2_g64"]])
def test_non_strings_raise_format_error(value):
    with pytest.raises(kf.FormatError, match="must be a string"):
        kf.parse_format(value)


def _near_misses():
    letters = st.sampled_from(["k", "v", "g", "_", "mla", "kvarn", "K", "V", "G", " ", "0"])
    numbers = st.integers(min_value=-5, max_value=10**30).map(str)
    return st.lists(st.one_of(letters, numbers), max_size=12).map("".join)


def _mutations():
    def mutate(args):
        name, pos, insert = args
        pos = pos % (len(name) + 1)
        return name[:pos] + insert + name[pos + 1 :]

    return st.tuples(
        st.sampled_from(kf.all_format_names()), st.integers(0, 40), st.text(max_size=3)
    ).map(mutate)


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.text(max_size=80), _near_misses(), _mutations()))
def test_fuzz_only_format_error_escapes(text):
    try:
        fmt = kf.parse_format(text)
    except kf.FormatError as exc:
        message = str(exc)
        assert "did you mean" in message or "must be a string" in message
        suggestion = message.rsplit("did you mean ", 1)[-1].strip("?)'")
        if "did you mean" in message:
            assert suggestion in kf.all_format_names()
        return
    assert fmt.name == text
    assert text in kf.all_format_names()
