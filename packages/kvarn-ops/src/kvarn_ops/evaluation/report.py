"""Reports of a harness run: markdown tables, paired comparisons between variants, the PNG
plot of PPL increase against bits per element."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any

from kvarn_ops.evaluation.harness import paired_stats

__all__ = ["comparisons", "markdown_tables", "plot"]

#: (better, baseline) method pairs compared in the report, per format and sink setting.
COMPARED = (
    ("kvarn", "published"),
    ("kvarn", "kvarn_rtn"),
    ("kvarn", "kvarn_ub_v"),
    ("kvarn", "published_ub_v"),
    ("kvarn", "kivi_h_ub"),
    ("kvarn_ub_v", "kvarn_rtn"),
    ("kvarn_mse_v", "kvarn_rtn"),
    ("kvarn_mse", "published"),
    ("kvarn_mse", "kvarn_rtn"),
    ("kvarn_rtn", "published"),
    ("kvarn_grid", "kvarn_rtn"),
    ("kvarn_refit", "kvarn_rtn"),
    ("kvarn_mse", "kivi_h_mse"),
    ("published", "kivi_h"),
    ("kivi_h", "kivi"),
)


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def _by_key(results: dict) -> dict:
    return {(r["method"], r["format"], r["sink"]): r for r in results["variants"]}


def comparisons(results: dict) -> list[dict]:
    """Paired PPL differences between variants of the same format and sink setting."""
    idx = _by_key(results)
    n = results["exact"]["tokens"]
    out = []
    for (m, fmt, sink), r in idx.items():
        for better, base in COMPARED:
            if m != better or (base, fmt, sink) not in idx:
                continue
            s = paired_stats(r["chunk_nll_sums"], idx[(base, fmt, sink)]["chunk_nll_sums"], n)
            out.append({"a": r["name"], "b": idx[(base, fmt, sink)]["name"], **s})
    for (m, fmt, sink), r in idx.items():  # what the exact first tile buys
        if sink and (m, fmt, False) in idx:
            s = paired_stats(r["chunk_nll_sums"], idx[(m, fmt, False)]["chunk_nll_sums"], n)
            out.append({"a": r["name"], "b": idx[(m, fmt, False)]["name"], **s})
    return out


def markdown_tables(results: dict) -> str:
    """The README tables: one row per variant, then the paired comparisons."""
    meta = results["meta"]
    lines = [
        f"Model {meta['model']}, text: {meta['text']}, context {meta['tokens']} tokens"
        f"{'' if meta.get('texts', 1) == 1 else ' in each of ' + str(meta['texts']) + ' texts'} "
        f"(G = {meta['group']}), exact PPL {results['exact']['ppl']:.4f}, {meta['date']}, "
        f"{meta['machine']}. PPL increase vs the exact cache with paired standard errors "
        f"over {len(results['exact']['chunk_nll_sums'])} chunks; (n.s.) = under 2 SE.",
        "",
        "| variant | bits/elem | PPL | PPL increase | attn err (accum., mean over layers) "
        "| static attn err K / V (mean) | greedy identical | first divergence |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["variants"]:
        s = r["vs_exact"]
        sig = "" if s["significant"] else " (n.s.)"
        acc = r["attn_error_accumulated"] or [float("nan")]
        st = r.get("attn_error_static")
        st_txt = (
            f"{sum(st['k']) / len(st['k']):.3f} / {sum(st['v']) / len(st['v']):.3f}" if st else ""
        )
        gen = r.get("generation")
        gen_txt = f"{100 * gen['identical_fraction']:.1f}%" if gen else ""
        div = gen["first_divergence"] if gen else ""
        lines.append(
            f"| {r['name']} | {r['bits_per_element']:.3f} | {r['ppl']:.4f} | "
            f"{_pct(s['ppl_increase'])} +- {100 * s['ppl_increase_se']:.2f}{sig} | "
            f"{sum(acc) / len(acc):.4f} | {st_txt} | {gen_txt} | {div} |"
        )
    comps = comparisons(results)
    if comps:
        lines += ["", "| variant | vs | PPL change | significant |", "|---|---|---|---|"]
        for c in comps:
            lines.append(
                f"| {c['a']} | {c['b']} | {_pct(c['ppl_increase'])} +- "
                f"{100 * c['ppl_increase_se']:.2f} | "
                f"{'yes' if c['significant'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """PPL increase (%) against bits per element, one marker per method, hollow = every full
    tile quantized, filled = first tile exact; error bars are one paired SE."""
    import_module("matplotlib").use("Agg")
    plt: Any = import_module("matplotlib.pyplot")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = sorted({r["method"] for r in results["variants"]})
    colors = {m: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}
    for m in methods:
        for sink in (False, True):
            rows = sorted(
                (r for r in results["variants"] if r["method"] == m and r["sink"] == sink),
                key=lambda r: r["bits_per_element"],
            )
            if not rows:
                continue
            x = [r["bits_per_element"] for r in rows]
            y = [100 * r["vs_exact"]["ppl_increase"] for r in rows]
            e = [100 * r["vs_exact"]["ppl_increase_se"] for r in rows]
            ax.errorbar(
                x,
                y,
                yerr=e,
                marker="o",
                linestyle="-" if sink else ":",
                color=colors[m],
                mfc=colors[m] if sink else "white",
                label=f"{m}{' +sink' if sink else ''}",
                capsize=2,
            )
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("cache bits per K/V element")
    ax.set_ylabel("PPL increase vs exact cache (%)")
    ax.set_title(f"{results['meta']['model']}, {results['meta']['tokens']} tokens")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
