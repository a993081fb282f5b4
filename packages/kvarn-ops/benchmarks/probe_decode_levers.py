"""How much each lever of the dense decode's block loop is worth, measured before it is built.

The transposed MMA decode kernel (``kernels/decode_mma_t.py``, GQA <= 8 at head_dim 128) misses
its 80% target by 18-23 points (BENCHMARKS.md). Each lever below is a copy of the installed
``kvarn_ops`` package with one source patch (exact text replacements that must apply once, so a
changed kernel stops the probe instead of timing something else), timed by ``bench_decode.py``
in its own process, each variant in turn in one run:

- ``copy16``: each 64-token half's K and V code words staged with 16-byte ``cp.async`` copies in
  record order (18 copies a block instead of 48 4-byte ones and 6 16-byte ones); the reads stay
  as they are, so lanes get other lanes' words: **outputs are wrong, timing only**. What the
  L1 pipe's load of 4-byte copies costs; ``copy16k`` and ``copy16v`` change the K words or
  the V words only (an ``ldmatrix.trans`` of record-order K gives each lane the code pairs of
  its operand registers; built that way it measured slower, BENCHMARKS.md);
- ``single``: one fp16 score operand ``q * s_col_K`` instead of two (half the score MMAs and no
  split product): **wrong on ill-conditioned records** (``gpu/test_dense_parity.py``'s), timing
  only; the bound of what the two-part operand costs;
- ``ilp``: the same arithmetic in independent chains: the zero-point sums of the two fp16
  parts and the score sums of the two parts in four accumulators, added once per block,
  instead of one chain of 32 dependent MMAs (``qz`` then every score MMA). Exact up to fp32
  summation order: a candidate to keep; ``ilp2`` also moves each chunk's zero-point MMAs
  after its score MMAs in program order, which is what makes ptxas interleave the chains;
- ``subnormal``: ``KVARN_DECODE_SUBNORMAL=1`` (the opt-in operands, no patch);
- ``record_k``, ``record_v``, ``record_kv``: correct builds kept as diffs in
  ``benchmarks/patches/`` (applied with ``git apply``): 4-bit K codes staged in record order
  by coalesced 16-byte copies and read by ``ldmatrix.trans`` (``decode_mma_rec.py``; its
  first build, with uncoalesced copies, measured 7-9% slower), 2-bit V words staged as token
  rows by 16-byte copies and read conflict-free (row ``4 i + c`` holds token ``16 c + i``),
  and both: no 4-byte copy left. Run GPU parity on their trees before trusting a timing
  (``PYTHONPATH=OUT/trees/record_kv:... python3 gpu/parity.py -k "dense_parity and decode"``);
- ``all``: ``copy16`` + ``single`` + ``subnormal``.

    python benchmarks/probe_decode_levers.py --out results/levers --geoms 0,1,2,3
        [--variants base,copy16k,copy16v,record_k,record_v,record_kv,base]

The ``ilp`` variants change ``decode_mma_t._qs_t``, which the head_dim 256 kernel also calls:
their trees serve head_dim 128 (and 64) only. First run: BENCHMARKS.md "2026-12-06, evening".

writes ``OUT/decode_<variant>.json`` (``bench_decode.py``'s format) and ``OUT/levers.json``
(the table printed last). Needs a CUDA GPU for the timing; ``--trees-only DIR`` writes the
patched packages (what ``tests/test_probe_decode_levers.py`` compiles offline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kvarn_formats
import kvarn_ops

HERE = Path(__file__).resolve().parent

_T = "kernels/decode_mma_t.py"
_M = "kernels/decode_mma.py"


def _per_chunk(old: str, new: str) -> list:
    """One patch of the transposed kernel per score chunk ``i`` (``{i}`` in both texts)."""
    return [(_T, old.format(i=i), new.format(i=i)) for i in range(4)]


_COPY16 = [
    (
        _M,
        """    koff = k_word_offsets(G, KB)
    kbase = r32 + K_OFF // 4 + half * (2 * KB)
    async_copy.async_copy_global_to_shared(sk, kbase + koff, mask=(koff >= 0) & ok)""",
        """    CP16K: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[8, 4], threads_per_warp=[4, 8], warps_per_cta=[1, 1], order=[1, 0]
    )
    kr = gl.arange(0, 32, layout=gl.SliceLayout(1, CP16K))
    kc = gl.arange(0, 32, layout=gl.SliceLayout(0, CP16K))
    koff = kr[:, None] * 32 + kc[None, :]
    kmask = ((kr >= 0)[:, None] & (kc >= 0)[None, :]) & ok
    async_copy.async_copy_global_to_shared(sk, r32 + K_OFF // 4 + koff, mask=kmask)""",
    ),
    (
        _M,
        """    vr = gl.arange(0, 16 * HV, layout=gl.SliceLayout(1, CPV))
    vl = gl.arange(0, 32, layout=gl.SliceLayout(0, CPV))
    tok = (vl[None, :] & 3) * 16 + vr[:, None] // HV
    voff = tok * WV + (vl[None, :] >> 2) * HV + vr[:, None] % HV
    vbase = r32 + V_OFF // 4 + half * (64 * WV)
    async_copy.async_copy_global_to_shared(sv, vbase + voff, mask=(voff >= 0) & ok)""",
        """    CP16V: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[2 * HV, 4], threads_per_warp=[4, 8], warps_per_cta=[1, 1], order=[1, 0]
    )
    vr = gl.arange(0, 16 * HV, layout=gl.SliceLayout(1, CP16V))
    vl = gl.arange(0, 32, layout=gl.SliceLayout(0, CP16V))
    voff = vr[:, None] * 32 + vl[None, :]
    vmask = ((vr >= 0)[:, None] & (vl >= 0)[None, :]) & ok
    async_copy.async_copy_global_to_shared(sv, r32 + V_OFF // 4 + voff, mask=vmask)""",
    ),
]

_SINGLE = [
    (_T, "    hi, lo = _split_product(qhl, qll, kcs2)\n", "    hi = qhl * kcs2\n    lo = hi\n"),
    *_per_chunk(
        "s = mma_v2(ka, qs{i}, mma_v2(ka, qt{i}, s))",
        "s = mma_v2(ka, qs{i}, s)",
    ),
]

_ILP = [
    (
        _T,
        "def _qs_t(qz, qh, ql, kcs_run, kzp_run, QB: gl.constexpr):",
        "def _qs_t(qz, qzl, qh, ql, kcs_run, kzp_run, QB: gl.constexpr):",
    ),
    (_T, "    qz = mma_v2(za, ql, qz)\n", "    qzl = mma_v2(za, ql, qzl)\n"),
    (_T, "    return qs_hi, qs_lo, qz\n", "    return qs_hi, qs_lo, qz, qzl\n"),
    (
        _T,
        "        qz = gl.full([16, 8], 0.0, gl.float32, _MMA)\n",
        "        qz = gl.full([16, 8], 0.0, gl.float32, _MMA)\n"
        "        qzl = gl.full([16, 8], 0.0, gl.float32, _MMA)\n",
    ),
    *_per_chunk(
        "qs{i}, qt{i}, qz = _qs_t(qz, qh{i}, ql{i}",
        "qs{i}, qt{i}, qz, qzl = _qs_t(qz, qzl, qh{i}, ql{i}",
    ),
    (_T, "qzg = _equal_rows(qz) * _C_IN", "qzg = _equal_rows(qz + qzl) * _C_IN"),
    (
        _T,
        """        if KB == 2:
            s = _rows_like(qzg, 64) * _k_row_factors(False, KB)[:, None]
        else:
            odd = _tok_rows(_run_consts(gl.constexpr(_RUNG8), 8, 0.0, 1.0, 0.0, 1.0)) > 0.5
            s = gl.where(odd[:, None], _rows_like(16.0 * qzg, 64), _rows_like(qzg, 64))""",
        """        s = gl.full([64, 8], 0.0, gl.float32, _MMA)
        sl = gl.full([64, 8], 0.0, gl.float32, _MMA)""",
    ),
    *_per_chunk(
        "s = mma_v2(ka, qs{i}, mma_v2(ka, qt{i}, s))",
        "s = mma_v2(ka, qs{i}, s)\n        sl = mma_v2(ka, qt{i}, sl)",
    ),
    (
        _T,
        "        kf = _k_row_factors(True, KB)\n",
        """        if KB == 2:
            s0 = _rows_like(qzg, 64) * _k_row_factors(False, KB)[:, None]
        else:
            odd = _tok_rows(_run_consts(gl.constexpr(_RUNG8), 8, 0.0, 1.0, 0.0, 1.0)) > 0.5
            s0 = gl.where(odd[:, None], _rows_like(16.0 * qzg, 64), _rows_like(qzg, 64))
        s = (s + sl) + s0
        kf = _k_row_factors(True, KB)
""",
    ),
]

# on top of ``_ILP``: each chunk's zero-point MMAs after its score MMAs in program order, so
# that ptxas interleaves the two chains (with ``_ILP`` alone it still issues the 16 zero-point
# MMAs first)
_ILP2 = [
    (
        _T,
        """    qz = mma_v2(za, qh, qz)
    qzl = mma_v2(za, ql, qzl)
    qs_hi = gl.convert_layout(hi, _OPB, assert_trivial=True)
    qs_lo = gl.convert_layout(lo, _OPB, assert_trivial=True)
    return qs_hi, qs_lo, qz, qzl""",
        """    qs_hi = gl.convert_layout(hi, _OPB, assert_trivial=True)
    qs_lo = gl.convert_layout(lo, _OPB, assert_trivial=True)
    return qs_hi, qs_lo, za""",
    ),
    *_per_chunk(
        "qs{i}, qt{i}, qz, qzl = _qs_t(qz, qzl, qh{i}, ql{i}",
        "qs{i}, qt{i}, za{i} = _qs_t(qz, qzl, qh{i}, ql{i}",
    ),
    (_T, "        qzg = _equal_rows(qz + qzl) * _C_IN\n", ""),
    *_per_chunk(
        "        sl = mma_v2(ka, qt{i}, sl)\n",
        "        sl = mma_v2(ka, qt{i}, sl)\n"
        "        qz = mma_v2(za{i}, qh{i}, qz)\n"
        "        qzl = mma_v2(za{i}, ql{i}, qzl)\n",
    ),
    (
        _T,
        "        if KB == 2:\n            s0 = ",
        "        qzg = _equal_rows(qz + qzl) * _C_IN\n        if KB == 2:\n            s0 = ",
    ),
]

PATCHES = HERE / "patches"

#: variant -> (patches, extra environment); a patch is (file, old text, new text) or
#: ("diff", name of a diff in ``PATCHES``)
VARIANTS: dict[str, tuple[list, dict]] = {
    "base": ([], {}),
    "copy16": (_COPY16, {}),
    "copy16k": (_COPY16[:1], {}),
    "copy16v": (_COPY16[1:], {}),
    "single": (_SINGLE, {}),
    "ilp": (_ILP, {}),
    "ilp2": (_ILP + _ILP2, {}),
    "subnormal": ([], {"KVARN_DECODE_SUBNORMAL": "1"}),
    "all": (_COPY16 + _SINGLE, {"KVARN_DECODE_SUBNORMAL": "1"}),
    "record_k": ([("diff", "record_k.diff", "")], {}),
    "record_v": ([("diff", "record_v.diff", "")], {}),
    "record_kv": ([("diff", "record_kv.diff", "")], {}),
}


def make_tree(name: str, dest: Path) -> Path:
    """A copy of the installed ``kvarn_ops`` under ``dest/name`` with the variant's patches;
    returns the directory to put on ``PYTHONPATH``. Each patch must apply exactly once."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    root = dest / name
    pkg = root / "kvarn_ops"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(
        Path(kvarn_ops.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__")
    )
    for rel, old, new in VARIANTS[name][0]:
        if rel == "diff":  # paths a/packages/kvarn-ops/src/kvarn_ops/...: strip four
            proc = subprocess.run(
                ["git", "apply", "-p4", str(PATCHES / old)],
                cwd=root,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"variant {name}: {old} does not apply (the kernel changed since the "
                    f"probe was written): {proc.stderr.strip()[:500]}"
                )
            continue
        path = pkg / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise RuntimeError(
                f"variant {name}: a patch of {rel} found its text {text.count(old)} times "
                "(the kernel changed since the probe was written)"
            )
        path.write_text(text.replace(old, new))
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON files")
    ap.add_argument("--geoms", default="0,1,2,3", help="bench_decode.py GEOMS indices")
    ap.add_argument("--variants", default="base,copy16k,copy16v,record_k,record_v,record_kv,base")
    ap.add_argument("--trees-only", action="store_true", help="write the patched trees, no run")
    a = ap.parse_args()
    out = Path(a.out)
    trees = out / "trees"
    names = [v for v in a.variants.split(",") if v]
    made = {n: make_tree(n, trees) for n in dict.fromkeys(names)}
    if a.trees_only:
        print("\n".join(str(p) for p in made.values()))
        return
    fmt_src = str(Path(kvarn_formats.__file__).parents[1])
    table: dict[str, dict] = {}
    for i, name in enumerate(names):
        tag = f"{name}_{i}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", **VARIANTS[name][1])
        env["PYTHONPATH"] = os.pathsep.join([str(made[name]), fmt_src])
        res = out / f"decode_{tag}.json"
        cmd = [sys.executable, str(HERE / "bench_decode.py"), "--graph", "--geoms", a.geoms]
        proc = subprocess.run(
            cmd + ["--out", str(res)], env=env, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 or not res.exists():
            print(f"{tag}: failed\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            continue
        for r in json.loads(res.read_text())["rows"]:
            key = f"B={r['batch']} {r['context'] // 1024}K {r['format']}"
            table.setdefault(key, {})[tag] = (r["ms"], r["frac_copy"])
    (out / "levers.json").write_text(json.dumps(table, indent=1))
    tags = [f"{n}_{i}" for i, n in enumerate(names)]
    print("case".ljust(28) + "".join(t.rjust(18) for t in tags))
    for key, row in table.items():
        cells = [
            f"{row[t][0] * 1e3:8.1f} {100 * row[t][1]:5.1f}%" if t in row else "-" for t in tags
        ]
        print(key.ljust(28) + "".join(c.rjust(18) for c in cells))


if __name__ == "__main__":
    main()
