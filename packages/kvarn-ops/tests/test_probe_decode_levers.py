"""The decode lever probe (``benchmarks/probe_decode_levers.py``) times patched copies of the
MMA decode kernel on a GPU. This checks, offline, that every patch still applies to the kernel
as it is (a stale patch must stop the probe, not time something else) and that each variant
compiles for sm_90a into what its description says: record-order K read by ``ldmatrix.trans``
(the kernel as it is), the lane-major words it replaced, 16-byte V copies only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_PROBE = HERE.parent / "benchmarks" / "probe_decode_levers.py"

# compiled in a child process: the interpreter off, the variant's tree first on sys.path
_CHILD = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
import triton
from triton.backends.compiler import GPUTarget
import kvarn_ops
import test_compile_decode as T
from cubin_info import cubin_resources
src = T._mma_source("kvarn_k4v2_g64", 4, 1, "*bf16", nbuf=2, transposed=True)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
ptx = k.asm["ptx"]
regs, frame = cubin_resources(k.asm["cubin"])
print(json.dumps(dict(
    where=kvarn_ops.__file__, mma=ptx.count("mma.sync.aligned.m16n8k16"),
    cp4=ptx.count(", 0x4,"), cp8=ptx.count(", 0x8,"), cp16=ptx.count(", 0x10,"),
    trans=ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans"), regs=regs, frame=frame,
)))
"""


def _probe():
    spec = importlib.util.spec_from_file_location("probe_decode_levers", _PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="variant must be one of"):
        _probe().make_tree("faster", tmp_path)


def test_a_stale_patch_stops_the_probe(tmp_path, monkeypatch):
    mod = _probe()
    monkeypatch.setitem(mod.VARIANTS, "stale", ([(mod._T, "no such text", "x")], {}))
    with pytest.raises(RuntimeError, match="found its text 0 times"):
        mod.make_tree("stale", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, mma, cp4, cp8, cp16, trans",
    [
        # per block: scores 32 (q's two fp16 parts in the columns of one operand) + zero
        # points 8, values 32, ones 4 (two operands: scores 2 x 32, zero points 16).
        # Copies (two stages issued in the code): per stage record-order K 8 16-byte ones
        # (lane-major K words: 32 4-byte ones), 2-bit V 16 4-byte or 4 16-byte, the scale
        # vectors 3 16-byte and 3 8-byte ones (lane-major: 6 16-byte ones); ldmatrix.trans of
        # record-order K: 8 a block (+2 of the weights' transpose)
        # None: 76 or 116 MMAs as decode_mma_t.FUSED_COLUMNS's default says
        ("base", None, 32, 6, 22, 10),
        ("fused", 76, 32, 6, 22, 10),  # q's parts in the columns of one operand
        ("two_operands", 116, 32, 6, 22, 10),  # q's parts as two score operands
        ("lane_k", None, 96, 0, 12, 0),  # the K words of the kernel before record order
        ("subnormal", 112, 96, 0, 12, 0),  # subnormal operands: no ones column
        ("copy16v", None, 0, 6, 30, 10),  # the V words by 16-byte copies
        ("record_v", None, 0, 6, 30, 10),  # no 4-byte copy left
        ("lazy_rescale", None, 32, 6, 22, 10),  # the rescale skipped where no maximum moves
    ],
)
def test_variant_compiles_to_what_it_claims(tmp_path, name, mma, cp4, cp8, cp16, trans):
    mod = _probe()
    tree = mod.make_tree(name, tmp_path)
    env = dict(os.environ, TRITON_INTERPRET="0", **mod.VARIANTS[name][1])
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tree), str(HERE)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if mma is None:
        from kvarn_ops.kernels import decode_mma_t

        mma = 76 if decode_mma_t.FUSED_COLUMNS else 116
    assert got["where"].startswith(str(tree)), got["where"]
    assert got["frame"] == 0 and got["regs"] <= 255
    assert (got["mma"], got["cp4"], got["cp8"], got["cp16"], got["trans"]) == (
        mma,
        cp4,
        cp8,
        cp16,
        trans,
    )
