"""Plots of a decode benchmark JSON (bench_decode.py --out): fraction of the copy bandwidth
and speed against bf16 SDPA for every measured geometry; for a ``--grid`` run also
``<name>_context.png``: both against context, one line per batch (Llama-3.1-8B geometry,
k4v2 g64).

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
    plt.close(fig)
    sweep = [
        r
        for r in rows
        if (r["hq"], r["hkv"], r["head_dim"], r["format"]) == (32, 8, 128, "kvarn_k4v2_g64")
    ]
    if len({r["context"] for r in sweep}) > 2:
        _plot_context(plt, sweep, data, Path(path))
    return out


def _plot_context(plt, rows: list[dict], data: dict, path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for b in sorted({r["batch"] for r in rows}):
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["context"])
        ctx = [r["context"] for r in rs]
        ax1.plot(ctx, [100 * r["frac_copy"] for r in rs], "o-", label=f"KVarN B={b}")
        ax1.plot(ctx, [100 * r["sdpa_frac_copy"] for r in rs], "x:", label=f"SDPA B={b}")
        ax2.plot(ctx, [r["speedup_vs_sdpa"] for r in rs], "o-", label=f"B={b}")
    ax1.axhline(80, color="r", ls="--", lw=1)
    ax2.axhline(1.0, color="k", lw=1)
    ax2.axhline(3.5, color="r", ls="--", lw=1)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
    ax1.set_ylabel("% of copy bandwidth")
    ax2.set_ylabel("speed vs bf16 SDPA")
    ax1.legend(fontsize=7, ncol=2)
    ax2.legend(fontsize=7)
    fig.suptitle(
        f"decode, 32 q / 8 KV heads, d128, k4v2 g64; copy {data['copy_bw'] / 1e12:.2f} TB/s",
        fontsize=9,
    )
    fig.tight_layout()
    out = path.with_name(path.stem + "_context.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1]))
