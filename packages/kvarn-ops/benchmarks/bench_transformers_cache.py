"""Generation with ``KvarnCache`` on a GPU: tokens/s and bytes held, against the exact cache.

A random-weight Llama with Llama-3.1-8B's attention and MLP geometry (hidden 4096, 32 query /
8 KV heads of head_dim 128, intermediate 14336) and ``--layers`` layers, bf16, fed a random
prompt of ``--prompt`` tokens, then ``--new`` greedy tokens; per cache (``exact``:
``DynamicCache``; ``packed``: ``KvarnCache`` under the ``"kvarn"`` attention, decode steps
through ``kvarn_ops.decode`` over the records; ``kernels`` and ``reference``: ``KvarnCache``'s
two backends under SDPA, the context dequantized every step) and batch size: the median of
``--reps`` timed ``generate`` calls after a warm-up, and the cache's bytes at the end.
Random weights: the tokens mean nothing, the times and bytes are those of the model's shape.

    python benchmarks/bench_transformers_cache.py --out results/x.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch


def _model(layers: int):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=16384, rope_theta=5e5,
    )  # fmt: skip
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, cfg


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if t is not None
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--format", default="kvarn_k4v2_g64")
    ap.add_argument("--caches", default="exact,packed,kernels,reference")
    ap.add_argument("--out")
    args = ap.parse_args()
    import transformers

    from kvarn_ops.transformers_cache import KvarnCache

    model, cfg = _model(args.layers)
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    make = {
        "exact": lambda: transformers.DynamicCache(config=cfg),
        "packed": lambda: KvarnCache(args.format, cfg),
        "kernels": lambda: KvarnCache(args.format, cfg, backend="kernels"),
        "reference": lambda: KvarnCache(args.format, cfg, backend="reference"),
    }
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in (int(x) for x in args.batches.split(",")):
        ids = torch.randint(0, cfg.vocab_size, (b, args.prompt), device="cuda", generator=gen)
        for name in args.caches.split(","):
            model.set_attn_implementation("kvarn" if name == "packed" else "sdpa")
            times, cache = [], None
            for rep in range(args.reps + 1):
                cache = make[name]()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=args.new, min_new_tokens=args.new, **{kw: cache},
                    )  # fmt: skip
                torch.cuda.synchronize()
                if rep:
                    times.append(time.perf_counter() - t0)
            sec = statistics.median(times)
            row = dict(
                cache=name, batch=b, prompt=args.prompt, new=args.new, seconds=sec,
                tokens_per_s=b * args.new / sec, bytes=_cache_bytes(cache),
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    exact = {r["batch"]: r for r in rows if r["cache"] == "exact"}
    print(f"\n{args.format}, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens")
    print("| cache | batch | s per generate | tokens/s | vs exact | cache MB | exact / it |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        e = exact.get(r["batch"])
        speed = f"{r['tokens_per_s'] / e['tokens_per_s']:.2f}x" if e else "-"
        ratio = f"{e['bytes'] / r['bytes']:.2f}x" if e else "-"
        print(f"| {r['cache']} | {r['batch']} | {r['seconds']:.3f} | {r['tokens_per_s']:.1f} | "
              f"{speed} | {r['bytes'] / 1e6:.1f} | {ratio} |")  # fmt: skip
    if args.out:
        env = dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__,
            transformers=transformers.__version__,
        )  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(dict(env=env, args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
