"""The command-line tool and the promise that importing the package loads no heavy modules."""

import json
import subprocess
import sys

import pytest

from kvarn_formats.cli import main


def test_describe_dense(capsys):
    assert main(["describe", "kvarn_k4v2_g64", "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert "record bytes      7296" in out
    assert "v_codes           4736    2048  codes u2" in out


def test_describe_mla_defaults_geometry(capsys):
    assert main(["describe", "kvarn_mla_k5_g64"]) == 0
    out = capsys.readouterr().out
    assert "record bytes      30848" in out
    assert "rope             22656    8192  bfloat16" in out


def test_describe_json(capsys):
    assert main(["describe", "kvarn_k2v2_g128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["record_bytes"] == 9728
    assert data["head_dim"] == 128


def test_list(capsys):
    assert main(["list"]) == 0
    assert "kvarn_mla_k5_g64" in capsys.readouterr().out.split()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["describe", "kvarn_k4v3_g63"], "did you mean 'kvarn_k4v3_g64'"),
        (["describe", "kvarn_k4v2_g64", "--head-dim", "80"], "head_dim must be one of"),
        (["describe", "kvarn_mla_k4_g128"], "only for g64"),
    ],
)
def test_bad_names_exit_2(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_console_script_runs_as_a_process():
    proc = subprocess.run(
        [sys.executable, "-m", "kvarn_formats.cli", "describe", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown KV-cache dtype 'nope'" in proc.stderr


def test_import_loads_no_torch_or_numpy():
    code = (
        "import sys, kvarn_formats, kvarn_formats.cli, kvarn_formats.compat_template; "
        "heavy = sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_version_matches_metadata():
    from importlib.metadata import version

    import kvarn_formats

    assert kvarn_formats.__version__ == version("kvarn-formats")
