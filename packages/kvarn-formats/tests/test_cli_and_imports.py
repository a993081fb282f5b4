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


def test_capacity_dense_counts_whole_blocks_after_the_pools(capsys):
    args = ["capacity", "kvarn_k4v2_g64", "--memory-gib", "40", "--layers", "32"]
    assert main([*args, "--kv-heads", "8"]) == 0
    out = capsys.readouterr().out
    # bf16: 2 (K, V) x 128 x 2 B x 8 heads x 32 layers = 131072 B a token
    assert "bfloat16                 327,680         1.00x" in out
    assert "float8                   655,360         2.00x" in out
    # 256 pools of 64 bf16 tokens = 2 GiB; the other 38 GiB in records of 7296 B x 8 x 32
    pools = 256 * 64 * 131072
    blocks = (40 * 2**30 - pools) // (7296 * 8 * 32)
    assert pools == 2 * 2**30 and blocks == 21845
    assert f"kvarn_k4v2_g64         {blocks * 64:,}         4.27x" in out
    assert "exact pools       2,048.0 MiB (256 requests x 1 block(s) of bfloat16)" in out


def test_capacity_mla_and_pool_options(capsys):
    args = ["capacity", "kvarn_mla_k4_g64", "--memory-gib", "1", "--layers", "2"]
    assert main([*args, "--max-requests", "3", "--pool-dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    # pool token: 512 fp8 + 64 bf16 RoPE + a float32 scale = 644 B, 3 x 64 tokens x 2 layers
    pools = 3 * 64 * 644 * 2
    record = 256 * 64 + 512 * 2 * 2 + 64 * 2 + 64 * 64 * 2  # codes, cs + zp, rs, RoPE
    tokens = (2**30 - pools) // (record * 2) * 64
    assert f"{'kvarn_mla_k4_g64':<18}{tokens:>14,}" in out
    assert f"{'bfloat16':<18}{2**30 // (1152 * 2 * 64) * 64:>14,}" in out
    assert f"exact pools       {pools / 2**20:,.1f} MiB (3 requests" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["kvarn_k4v2_g64", "--memory-gib", "1", "--layers", "4"], "--kv-heads is required"),
        (["kvarn_mla_k4_g64", "--memory-gib", "1", "--layers", "4", "--kv-heads", "8"],
         "--kv-heads is for dense formats"),
        (["kvarn_k4v2_g64", "--memory-gib", "0.01", "--layers", "32", "--kv-heads", "8"],
         "max_requests=256: the exact pools need"),
        (["kvarn_k4v3_g63", "--memory-gib", "1", "--layers", "4", "--kv-heads", "8"],
         "did you mean"),
    ],
)  # fmt: skip
def test_capacity_bad_input_exits_2(args, message, capsys):
    assert main(["capacity", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--memory-gib=-1", "--memory-gib=nan", "--layers=0"])
def test_capacity_rejects_non_positive_numbers(flag, capsys):
    base = {"--memory-gib": "1", "--layers": "4"}
    name = flag.split("=")[0]
    rest = [x for k, v in base.items() if k != name for x in (k, v)]
    with pytest.raises(SystemExit) as exc:
        main(["capacity", "kvarn_k4v2_g64", "--kv-heads", "8", flag, *rest])
    assert exc.value.code == 2
    assert "must be a positive" in capsys.readouterr().err
