"""How much each lever of the dense decode's block loop is worth, measured before it is built.

The transposed MMA decode kernel (``kernels/decode_mma_t.py``, GQA <= 8 at head_dim 128) misses
its 80% target (BENCHMARKS.md). Each lever below is a copy of the installed ``kvarn_ops``
package with one source patch (exact text replacements that must apply once, or a diff that
must apply, so a changed kernel stops the probe instead of timing something else) or one
environment switch, timed by ``bench_decode.py`` in its own process, each variant in turn in
one run:

- ``base``: the kernel as it is (4-bit K codes staged in record order by 16-byte copies and
  read by ``ldmatrix.trans``, ``decode_mma_rec.py``);
- ``fused`` / ``two_operands``: ``KVARN_DECODE_FUSED_COLUMNS=1`` / ``=0``: q's fp16 high
  and low parts in the two columns of one score operand (at most four query rows a KV head,
  ``decode_mma_t.FUSED_COLUMNS``), or as two score operands that each code operand meets;
- ``lane_k``: ``KVARN_DECODE_RECORD_K=0``, the lane-major K words gathered by 4-byte copies
  (the kernel before record order);
- ``subnormal``: ``KVARN_DECODE_SUBNORMAL=1`` (the opt-in operands; lane-major K words);
- ``copy16v``: the 2-bit V words by 16-byte copies in record order, the reads left as they
  are: **outputs are wrong, timing only**; the bound of what ``record_v`` can gain;
- ``record_v``: a diff in ``benchmarks/patches/`` (applied with ``git apply``): 2-bit V words
  staged as token rows by 16-byte copies and read conflict-free (row ``4 i + c`` holds token
  ``16 c + i``), so no 4-byte copy is left at head_dim 128 (only the transposed kernel's
  2-bit V paths change). Not yet GPU-checked on its own (BENCHMARKS.md "2026-12-06, night"):
  run its parity before trusting a timing (``PYTHONPATH=OUT/trees/record_v:... python3
  gpu/parity.py -k "dense_parity and test_decode"``).
- ``lazy_rescale``: a diff in ``benchmarks/patches/``: the running softmax's rescale of the
  accumulators (32 multiplies, two ``ex2``) in a branch taken only in blocks where some row's
  maximum moves (a warp-uniform flag); elsewhere it multiplied by exactly 1, so the outputs
  are bit-identical.

    python benchmarks/probe_decode_levers.py --out results/levers --geoms 0,1,2,3
        [--variants base,two_operands,lazy_rescale,record_v,base]

The lever probes of the lane-major words (16-byte copies of K, one fp16 score operand,
independent MMA chains) were measured on the kernel before record order (BENCHMARKS.md
"2026-12-06, evening"); this file's history has them.

writes ``OUT/decode_<variant>_<i>.json`` (``bench_decode.py``'s format) and
``OUT/levers.json`` (the table printed last). Needs a CUDA GPU for the timing;
``--trees-only`` writes the patched packages (what ``tests/test_probe_decode_levers.py``
compiles offline).
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


# the V words of a 64-token half by 16-byte copies in record order (the reads left as they
# are: wrong outputs, timing only)
_COPY16V = [
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

PATCHES = HERE / "patches"

#: variant -> (patches, extra environment); a patch is (file, old text, new text) or
#: ("diff", name of a diff in ``PATCHES``)
VARIANTS: dict[str, tuple[list, dict]] = {
    "base": ([], {}),
    "fused": ([], {"KVARN_DECODE_FUSED_COLUMNS": "1"}),
    "two_operands": ([], {"KVARN_DECODE_FUSED_COLUMNS": "0"}),
    "lane_k": ([], {"KVARN_DECODE_RECORD_K": "0"}),
    "subnormal": ([], {"KVARN_DECODE_SUBNORMAL": "1"}),
    "copy16v": (_COPY16V, {}),
    "record_v": ([("diff", "record_v.diff", "")], {}),
    "lazy_rescale": ([("diff", "lazy_rescale.diff", "")], {}),
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
    ap.add_argument("--variants", default="base,two_operands,lazy_rescale,record_v,base")
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
