"""Plots of a decode benchmark JSON (bench_decode.py --out): fraction of the copy bandwidth
and speed against bf16 SDPA for every measured geometry.

    python plot_decode.py results/decode_h200_2026-11-30_final.json  # writes the .png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    rows = [r for r in data["rows"] if r.get("variant", "default") == "default"]
    labels = [
        f"B{r['batch']} {r['context'] // 1024}K\nd{r['head_dim']} {r['format'][6:]}" for r in rows
    ]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, len(rows) * 0.9), 7), sharex=True)
    ax1.bar(x, [100 * r["frac_copy"] for r in rows], label="KVarN Triton decode")
    ax1.plot(x, [100 * r["sdpa_frac_copy"] for r in rows], "k.", label="bf16 SDPA (flash)")
    ax1.axhline(80, color="r", ls="--", lw=1, label="target 80%")
    ax1.set_ylabel("% of copy bandwidth\n(bytes read / time)")
    ax1.legend(fontsize=8)
    ax2.bar(x, [r["speedup_vs_sdpa"] for r in rows])
    ax2.axhline(1.0, color="k", lw=1)
    ax2.axhline(3.5, color="r", ls="--", lw=1, label="target 3.5x at 32K")
    ax2.set_ylabel("speed vs bf16 SDPA")
    ax2.legend(fontsize=8)
    ax2.set_xticks(list(x), labels, fontsize=7, rotation=35, ha="right")
    info = data.get("info", {})
    fig.suptitle(
        f"decode, {info.get('gpu', '?')}, torch {info.get('torch', '?')}, triton "
        f"{info.get('triton', '?')}, copy {data['copy_bw'] / 1e12:.2f} TB/s, "
        f"{info.get('date', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1]))
