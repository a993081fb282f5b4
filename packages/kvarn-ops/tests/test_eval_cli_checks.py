"""``kvarn-eval`` refuses options and inputs it cannot measure with a usage error naming the
option (exit status 2), never a traceback or a silently smaller or empty measurement."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the eval extra is not installed")
pytest.importorskip("gguf", reason="the eval extra is not installed")

from kvarn_ops.evaluation.cli import main  # noqa: E402
from kvarn_ops.evaluation.model_setup import write_tiny_llama  # noqa: E402

QUIET = ["--gen-tokens", "0", "--no-static", "--no-plot", "--detail", "none", "--sink", "off"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


def _usage_error(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--threads", "0"], "--threads: must be at least 1"),
        (["--tokens", "0"], "--tokens: must be at least 1"),
        (["--gen-tokens", "-1"], "--gen-tokens: must be >= 0"),
        (["--methods", "foo"], "unknown method 'foo'"),
        (["--methods", "kvarn", "--formats", "kvarn_k9v9_g64"], "--formats: unknown KV-cache"),
        (["--methods", "kvarn", "--formats", ""], "--formats: no format"),
        (["--methods", "kvarn", "--formats", "kvarn_mla_k4_g64"], "only dense kvarn formats"),
        (["--formats", "kvarn_k4v2_g64", "--group", "128"], "--group 128: the formats' tiles"),
        (["--group", "0", "--methods", "fp8"], "--group: must be at least 1"),
        (["--formats", "kvarn_k4v2_g64,kvarn_k4v2_g128"], "tile sizes [64, 128] mixed"),
        (["--detail", "kvarn/kvarn_k4v2_g46"], "--detail: 'kvarn/kvarn_k4v2_g46'"),
    ],
)
def test_run_options_are_checked(tiny_dir, tmp_path, capsys, extra, needle):
    argv = ["run", "--model", tiny_dir, "--out", str(tmp_path), *QUIET, *extra]
    _usage_error(capsys, argv, needle)


def test_missing_model_directory_is_not_a_hub_name(tmp_path, capsys):
    argv = ["run", "--model", str(tmp_path / "missing"), "--out", str(tmp_path), *QUIET]
    _usage_error(capsys, argv, "no such directory")


@pytest.mark.parametrize(
    ("content", "args", "needle"),
    [
        ("{not json", [], "not valid JSON"),
        ("[1, 2]", [], "expected an object with 'ids' or 'texts'"),
        ('{"ids": []}', [], "text 0 is not a non-empty list"),
        ('{"texts": []}', [], "no texts"),
        ('{"ids": [1.7, 2]}', [], "holds 1.7, not a token id"),
        ('{"ids": ["a"]}', [], "holds 'a', not a token id"),
        ('{"ids": [-1, 2]}', [], "holds -1"),
        (json.dumps({"ids": [5] * 40}), ["--tokens", "300"], "text 0 has only 40 tokens"),
        (json.dumps({"ids": [5] * 100}), ["--tokens", "64"], "at least 65 are needed"),
        (json.dumps({"ids": [99_999_999] * 200}), ["--tokens", "200"], "token ids must be in [0, "),
        (json.dumps({"texts": [[5] * 300, [5] * 100]}), ["--tokens", "300"], "text 1 has only"),
    ],
)
def test_text_ids_are_checked(tiny_dir, tmp_path, capsys, content, args, needle):
    path = tmp_path / "ids.json"
    path.write_text(content)
    argv = ["run", "--model", tiny_dir, "--out", str(tmp_path), "--text-ids", str(path)]
    rc = main([*argv, *QUIET, "--methods", "kvarn", "--formats", "kvarn_k4v2_g64", *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_missing_text_ids_file(tiny_dir, tmp_path, capsys):
    argv = ["run", "--model", tiny_dir, "--out", str(tmp_path), "--text-ids", "nope.json"]
    assert main([*argv, *QUIET]) == 2
    assert "--text-ids nope.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content", ["{bad", "[]", "{}", '{"meta": {}, "exact": {}, "variants": [{"name": "x"}]}']
)
def test_report_refuses_what_is_not_a_results_file(tmp_path, content):
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["report", str(path)])
    assert str(exc.value).startswith("kvarn-eval report: ")
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "missing.json")])
    assert "missing.json" in str(exc.value)
