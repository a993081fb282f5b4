"""``kvarn-eval``: accuracy of KV-cache formats on a real model, offline.

Examples
--------
kvarn-eval setup                                   # build SmolLM2-135M into the user cache
kvarn-eval run --out results/                      # the default comparison (see --help)
kvarn-eval run --formats kvarn_k4v2_g64 --methods published,kvarn_mse --sink on
kvarn-eval run --texts pydoc --detail none         # pooled over six more shipped texts
kvarn-eval run --texts code --detail none          # six windows of Python source code
kvarn-eval report results/results.json             # tables again from a saved run
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from importlib import import_module
from pathlib import Path
from typing import Any

__all__ = ["main"]

DEFAULT_FORMATS = ("kvarn_k4v4_g64", "kvarn_k4v2_g64", "kvarn_k2v2_g64")
DEFAULT_METHODS = ("fp8", "kivi", "kivi_h", "published", "kvarn_rtn", "kvarn")
DEFAULT_DETAIL = ("fp8", "published/kvarn_k4v2_g64", "kvarn/kvarn_k4v2_g64")


def _machine() -> str:
    import os

    import torch

    return (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def _variants(formats: list[str], methods: list[str], sinks: tuple[bool, ...]) -> list:
    from kvarn_ops.evaluation.variants import make_variant

    out: list = []
    for m in methods:
        for sink in sinks:
            if m == "fp8":
                out.append(make_variant("fp8", None, sink))
            else:
                out.extend(make_variant(m, f, sink) for f in formats)
    return out


def _run(args: argparse.Namespace) -> int:
    import torch

    tqdm = import_module("tqdm").tqdm

    from kvarn_ops.evaluation import report
    from kvarn_ops.evaluation.cli_checks import check_texts, load_text_ids
    from kvarn_ops.evaluation.harness import (
        Harness,
        code_text_set,
        default_token_ids,
        pool_exact,
        pool_texts,
        pydoc_text_set,
        save_json,
    )
    from kvarn_ops.evaluation.model_setup import ensure_smollm2

    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        model_dir, model_name = (
            ensure_smollm2(log=lambda s: print(s, file=sys.stderr)),
            "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
        )
    else:
        model_dir, model_name = Path(args.model), Path(args.model).name
    if args.text_ids:
        try:
            texts, text = load_text_ids(args.text_ids)
        except ValueError as exc:
            print(f"kvarn-eval run: {exc}", file=sys.stderr)
            return 2
    elif args.texts == "pydoc":
        texts, text = pydoc_text_set()
    elif args.texts == "code":
        texts, text = code_text_set()
    else:
        ids, text = default_token_ids()
        texts = [ids]
    problem = check_texts(texts, args.tokens, args.group, args.sink)
    if problem:
        print(f"kvarn-eval run: {problem}", file=sys.stderr)
        return 2
    texts = [t[: args.tokens] for t in texts]
    sinks = {"on": (True,), "off": (False,), "both": (False, True)}[args.sink]
    variants = _variants(args.formats.split(","), args.methods.split(","), sinks)
    try:
        harnesses = [
            Harness(
                model_dir,
                ids,
                group=args.group,
                gen_prompt=args.gen_prompt,
                gen_tokens=args.gen_tokens if i == 0 else 0,
                static_queries=args.static_queries,
                threads=args.threads,
            )
            for i, ids in enumerate(texts)
        ]
    except ValueError as exc:  # token ids outside the model's vocabulary
        print(f"kvarn-eval run: {exc}", file=sys.stderr)
        return 2
    h = harnesses[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "meta": {
            "model": model_name,
            "text": text,
            "texts": len(texts),
            "tokens": len(texts[0]),
            "group": args.group,
            "date": datetime.date.today().isoformat(),
            "machine": _machine(),
            "gen_prompt": h.gen_prompt,
            "gen_tokens": args.gen_tokens,
            "static_queries": args.static_queries,
        },
        "exact": pool_exact([x.exact_summary() for x in harnesses]),
        "variants": [],
    }
    bar = tqdm(variants, desc="variants", unit="variant", file=sys.stderr)
    detail = set(args.detail.split(",")) if args.detail != "all" else None
    for v in bar:
        bar.set_postfix_str(v.name)
        key = v.method if v.fmt is None else f"{v.method}/{v.fmt}"
        full = detail is None or key in detail
        runs = [  # details (static error, generation, split) on the first text only
            x.run_variant(
                v,
                generation=full and args.gen_tokens > 0 and i == 0,
                static=full and not args.no_static and i == 0,
                accumulated_split=full and args.split and i == 0,
            )
            for i, x in enumerate(harnesses)
        ]
        if len(runs) == 1:
            results["variants"].append(runs[0])
        else:
            results["variants"].append(pool_texts([x.exact_summary() for x in harnesses], runs))
        save_json(out / "results.json", results)  # partial results survive an interruption
    results["comparisons"] = report.comparisons(results)
    save_json(out / "results.json", results)
    (out / "table.md").write_text(report.markdown_tables(results))
    if not args.no_plot:
        report.plot(results, out / "ppl_vs_bits.png")
    print(report.markdown_tables(results))
    return 0


def _report(args: argparse.Namespace) -> int:
    from kvarn_ops.evaluation import report
    from kvarn_ops.evaluation.cli_checks import read_json

    def load(path: str) -> Any:
        try:
            data = read_json(path, f"kvarn-eval report: {path}")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        missing = (
            [k for k in ("meta", "exact", "variants") if k not in data]
            if isinstance(data, dict)
            else ["an object"]
        )
        if missing:
            raise SystemExit(f"kvarn-eval report: {path}: not a results.json (missing {missing})")
        return data

    results = load(args.results[0])
    for extra in args.results[1:]:  # runs of the same model and text, merged
        more = load(extra)
        if more["exact"].get("chunk_nll_sums") != results["exact"].get("chunk_nll_sums"):
            raise SystemExit(f"{extra}: not the same model and text as {args.results[0]}")
        names = {v["name"] for v in results["variants"]}
        results["variants"] += [v for v in more["variants"] if v["name"] not in names]
    try:
        results["comparisons"] = report.comparisons(results)
        tables = report.markdown_tables(results)
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit(
            f"kvarn-eval report: {args.results[0]}: a results.json of another layout ({exc!r})"
        ) from None
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(tables)
    if args.plot:
        report.plot(results, Path(args.plot))
    return 0


def _setup(args: argparse.Namespace) -> int:
    from kvarn_ops.evaluation.model_setup import ModelSetupError, ensure_smollm2

    try:
        print(
            ensure_smollm2(
                Path(args.root) if args.root else None,
                force=args.force,
                log=lambda s: print(s, file=sys.stderr),
            )
        )
    except ModelSetupError as exc:
        print(f"kvarn-eval setup: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvarn-eval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="build the SmolLM2-135M model directory (user cache)")
    s.add_argument("--root", help="models directory (default: the user cache)")
    s.add_argument("--force", action="store_true", help="convert again")
    r = sub.add_parser("run", help="measure cache variants against the exact cache")
    r.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (built by setup if needed) or a model directory",
    )
    r.add_argument(
        "--formats", default=",".join(DEFAULT_FORMATS), help="comma-separated dense kvarn formats"
    )
    r.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated: fp8 or keys of kvarn_ops.evaluation.variants.METHODS "
        "(kivi, kivi_h, published, kvarn, kvarn_rtn, kvarn_mse, ...)",
    )
    r.add_argument(
        "--sink",
        choices=("on", "off", "both"),
        default="both",
        help="first tile exact: on, off or both (default)",
    )
    r.add_argument(
        "--texts",
        choices=("license", "pydoc", "code"),
        default="license",
        help="shipped token ids: 'license' (default: CPython's LICENSE, 2048 tokens, the "
        "reference setup), 'pydoc' (six 2048-token texts of Python's library reference, "
        "pooled: about 2.5x smaller standard errors) or 'code' (six 2048-token windows of "
        "CPython's standard-library source)",
    )
    r.add_argument(
        "--text-ids",
        help="JSON file {'ids': [...], 'source': ...} or {'texts': [[...], ...], 'source': ...} "
        "(overrides --texts)",
    )
    r.add_argument("--tokens", type=int, default=2048, help="context length (default 2048)")
    r.add_argument(
        "--group", type=int, default=None, help="tile size G (default: the formats' G; 64)"
    )
    r.add_argument("--gen-prompt", type=int, default=1024, help="prompt tokens for greedy")
    r.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens (0: skip)")
    r.add_argument(
        "--static-queries",
        type=int,
        default=512,
        help="queries (the last ones) for the static attention error",
    )
    r.add_argument("--no-static", action="store_true", help="skip the static attention error")
    r.add_argument(
        "--detail",
        default=",".join(DEFAULT_DETAIL),
        help="variants (method[/format], both sink settings) that also get the "
        "static attention error, greedy generation and --split; 'all' for "
        "every variant (the others get PPL and the accumulated error)",
    )
    r.add_argument(
        "--split",
        action="store_true",
        help="also run K-only and V-only caches (accumulated error split)",
    )
    r.add_argument("--no-plot", action="store_true")
    r.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a busy shared machine more threads "
        "were measured up to 20x slower)",
    )
    r.add_argument("--out", default="kvarn-eval-results", help="output directory")
    t = sub.add_parser("report", help="print the tables of a saved results.json")
    t.add_argument("results", nargs="+", help="results.json files (merged)")
    t.add_argument("--json", help="write the merged results here")
    t.add_argument("--plot", help="also write the PNG plot here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from kvarn_ops.evaluation.cli_checks import check_run_args

        problem = check_run_args(args, ",".join(DEFAULT_DETAIL))
        if problem:
            parser.error(problem)  # exit status 2, with the usage line
    return {"setup": _setup, "run": _run, "report": _report}[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
