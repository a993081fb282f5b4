"""Decode benchmark on a CUDA GPU: KVarN Triton decode vs copy bandwidth vs bf16 SDPA.

Bytes read per step (the roofline): for each request and KV head, ``seq_len // G`` records of
``record_bytes`` plus the ``seq_len % G`` exact tail tokens (K and V, pool element size), plus
q and out (``B * T * Hq * D`` elements each). The workspace round trip is not counted (it is
overhead of split-K, not data the step needs). SDPA reads ``2 * B * Hkv * seq_len * D`` bf16
elements plus q and out. Copy bandwidth: a device-to-device ``copy_`` of 1 GiB, (read +
write) bytes / time, measured in the same run. Times are medians of
``triton.testing.do_bench`` (back-to-back calls: host launch cost shows when the GPU work is
short) or, with ``--graph``, of CUDA-graph replay (GPU time). Results written before this
docstring said "medians" were means (do_bench's default).

    python bench_decode.py --out results/decode.json [--check] [--quick | --grid | --geoms 0,2]
        [--variants fast=0,asm=0,maxnreg=168,splits=128,pdl=0] [--graph] [--query-len T]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

import kvarn_formats as kf

# the kernels package exports a function named "decode": import the module by name
kd = importlib.import_module("kvarn_ops.kernels.decode")

GEOMS = [  # (batch, context, Hq, Hkv, D, format)
    (1, 32768, 32, 8, 128, "kvarn_k4v2_g64"),
    (8, 32768, 32, 8, 128, "kvarn_k4v2_g64"),
    (32, 16384, 32, 8, 128, "kvarn_k4v2_g64"),
    (64, 32768, 32, 8, 128, "kvarn_k4v2_g64"),
    (1, 131072, 32, 8, 128, "kvarn_k4v2_g64"),
    (16, 131072, 32, 8, 128, "kvarn_k4v2_g64"),
    (64, 4096, 32, 8, 128, "kvarn_k4v2_g64"),
    (32, 16384, 32, 8, 128, "kvarn_k4v4_g64"),
    (32, 16384, 32, 8, 128, "kvarn_k4v2_g128"),
    (32, 16384, 32, 8, 128, "kvarn_k5v5_g64"),
    (32, 16384, 16, 8, 64, "kvarn_k4v2_g64"),
    (32, 16384, 32, 8, 256, "kvarn_k4v2_g64"),
    # more than 8 query heads per KV head: GQA 16 (Llama-3.1-405B on 8 GPUs: 16 query heads
    # and one KV head per GPU; the 16-row MMA kernel), GQA 32 (32 rows: the Triton kernel)
    (32, 16384, 16, 1, 128, "kvarn_k4v2_g64"),
    (8, 32768, 16, 1, 128, "kvarn_k4v2_g64"),
    (1, 32768, 16, 1, 128, "kvarn_k4v2_g64"),
    (32, 16384, 64, 2, 128, "kvarn_k4v2_g64"),
    # GQA 8 (Qwen-style 64 / 8 heads), for verify runs of more than 16 rows per KV head
    (8, 32768, 64, 8, 128, "kvarn_k4v2_g64"),
    # head_dim 64 (head pairs in the MMA kernel): Llama-3.2-1B (32 / 8 heads), SmolLM2 (9 / 3)
    (64, 32768, 32, 8, 64, "kvarn_k4v2_g64"),
    (32, 16384, 32, 8, 64, "kvarn_k4v2_g64"),
    (8, 32768, 32, 8, 64, "kvarn_k4v2_g64"),
    (1, 32768, 32, 8, 64, "kvarn_k4v2_g64"),
    (32, 16384, 32, 8, 64, "kvarn_k4v4_g64"),
    (64, 16384, 9, 3, 64, "kvarn_k4v2_g64"),
    # head_dim 64 with 5-8 query rows per KV head (one head a program): TinyLlama (32 / 4),
    # Qwen2.5-0.5B (14 / 2)
    (32, 16384, 32, 4, 64, "kvarn_k4v2_g64"),
    (64, 16384, 14, 2, 64, "kvarn_k4v2_g64"),
    # head_dim 256 (the two-half MMA kernel): Gemma-3-12B (16 / 8 heads)
    (64, 16384, 16, 8, 256, "kvarn_k4v2_g64"),
    (8, 32768, 16, 8, 256, "kvarn_k4v2_g64"),
    (1, 32768, 16, 8, 256, "kvarn_k4v2_g64"),
    # 2-bit K (the transposed MMA kernel with KB = 2): k2v2 and k2v4, GQA 4 and 8
    (64, 32768, 32, 8, 128, "kvarn_k2v2_g64"),
    (32, 16384, 32, 8, 128, "kvarn_k2v2_g64"),
    (8, 32768, 32, 8, 128, "kvarn_k2v2_g64"),
    (1, 32768, 32, 8, 128, "kvarn_k2v2_g64"),
    (32, 16384, 32, 8, 128, "kvarn_k2v4_g64"),
    (32, 16384, 64, 8, 128, "kvarn_k2v2_g128"),
    # 2-bit K at head_dim 64 (head pairs: Llama-3.2-1B) and 256 (two halves: Gemma-3-12B)
    (64, 32768, 32, 8, 64, "kvarn_k2v2_g64"),
    (64, 16384, 16, 8, 256, "kvarn_k2v2_g64"),
    # 2-bit K with 16 rows (GQA 16: the 16-row MMA kernel)
    (32, 16384, 16, 1, 128, "kvarn_k2v2_g64"),
]
QUICK = [GEOMS[0], GEOMS[2], GEOMS[3]]
#: ``--grid``: the issue's sweep. Llama-3.1-8B geometry, k4v2 g64, every context x batch; the
#: other formats and model geometries at two operating points (B=8 32K, B=32 16K):
#: Qwen-style d128 GQA 8 (64 q / 8 KV heads, as Qwen2.5-72B), d64 (16/8), d256 (32/8).
GRID_CONTEXTS = [1024, 4096, 16384, 32768, 131072]
GRID_BATCHES = [1, 8, 32, 64]
GRID = [(b, c, 32, 8, 128, "kvarn_k4v2_g64") for c in GRID_CONTEXTS for b in GRID_BATCHES] + [
    (b, c, hq, hkv, d, fmt)
    for (b, c) in ((8, 32768), (32, 16384))
    for (hq, hkv, d, fmt) in (
        (32, 8, 128, "kvarn_k4v4_g64"),
        (32, 8, 128, "kvarn_k4v2_g128"),
        (32, 8, 128, "kvarn_k4v4_g128"),
        (64, 8, 128, "kvarn_k4v2_g64"),
        (16, 8, 64, "kvarn_k4v2_g64"),
        (32, 8, 256, "kvarn_k4v2_g64"),
    )
]


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def make_inputs(b, ctx, hq, hkv, d, fmt, pool_dtype=torch.bfloat16, tail=0, t=1):
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    seq = ctx + tail
    nfull = seq // g
    nblocks = b * nfull + 1
    packed = torch.randint(
        0, 256, (nblocks, hkv, lay.record_bytes), dtype=torch.uint8, device="cuda"
    )
    h16 = packed.view(torch.float16)
    for name, lo, hi in (
        ("k_col_scale", 0.05, 0.15),
        ("k_zero_point", -1.2, -0.8),
        ("k_row_scale", 0.5, 1.5),
        ("v_col_scale", 0.5, 1.5),
        ("v_row_scale", 0.2, 0.6),
        ("v_zero_point", -1.2, -0.8),
    ):
        f = lay.field(name)
        sl = h16[:, :, f.offset // 2 : f.offset // 2 + f.count]
        sl.uniform_(lo, hi)
    bt = torch.randperm(b * nfull, device="cuda", dtype=torch.int64).to(torch.int32)
    bt = bt.view(b, nfull) if nfull else torch.zeros(b, 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((b,), seq, dtype=torch.int32, device="cuda")
    ek = torch.randn(b + 1, g, hkv, d, device="cuda").to(pool_dtype)
    ev = torch.randn(b + 1, g, hkv, d, device="cuda").to(pool_dtype)
    tailb = torch.arange(b, dtype=torch.int32, device="cuda")
    q = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ws = kd.decode_workspace(b, t, hq, hkv, d, seq, g, device="cuda")
    args = (q, packed, bt, seq_lens, ek, ev, None, None, tailb, lay, 1 / math.sqrt(d), out, ws)
    nbytes = (
        b * hkv * (nfull * lay.record_bytes + (seq % g) * d * 2 * ek.element_size())
        + 2 * q.numel() * q.element_size()
    )
    return args, nbytes


def bench(fn, graph: bool) -> float:
    """Median ms of ``fn``: back-to-back calls (``do_bench``, includes host launch cost when
    the GPU work is shorter), or CUDA-graph replay (``graph``: GPU time only)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    return triton.testing.do_bench(fn, return_mode="median")


def sdpa_time(b, ctx, hq, hkv, d, graph=False, t=1):
    """bf16 SDPA of ``t`` query tokens over ``ctx`` keys (for ``t > 1`` without the causal mask
    among the new tokens: torch's ``is_causal`` aligns it top-left, and the mask moves at most
    ``t - 1`` of ``ctx`` keys)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            f(q, k, v, enable_gqa=True)
            ms = bench(lambda: f(q, k, v, enable_gqa=True), graph)
        backend = "flash"
    except RuntimeError:
        ms = bench(lambda: f(q, k, v, enable_gqa=True), graph)
        backend = "default"
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    return ms, nbytes, backend


def check_gpu() -> list[dict]:
    """Kernel vs the fp64 oracle of the CPU tests, on the GPU, plus CUDA-graph replay. The
    yardstick is the reference with the GPU's operand roundings (``fp16_tf32``), as in
    ``gpu/test_dense_parity.py``; with the interpreter's (``fp16``) the tf32 tail dots of
    the fp8-pool and 8-bit cases measured 1.1x and 1.4x over the bound (the run of
    ``results/decode_h200_2026-11-30_grid.json``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import os

    import numpy as np

    os.environ["TRITON_INTERPRET"] = "0"  # the test module defaults it to 1 for CPU runs
    import test_decode as td

    rng = np.random.default_rng(int(time.time()))
    cases = [
        ("kvarn_k4v2_g64", 128, 2, 4, 1, [1, 63, 64, 65, 130, 700], torch.bfloat16),
        ("kvarn_k4v2_g64", 128, 2, 4, 3, [3, 65, 700, 5000], torch.float8_e4m3fn),
        ("kvarn_k5v5_g64", 128, 2, 4, 1, [70, 700], torch.float16),
        ("kvarn_k3v6_g32", 64, 3, 3, 2, [2, 63, 130], torch.bfloat16),
        ("kvarn_k2v2_g128", 256, 1, 8, 1, [300, 1000], torch.bfloat16),
        ("kvarn_k4v4_g64", 512, 1, 1, 8, [520, 64], torch.float16),
        ("kvarn_k8v8_g64", 64, 4, 1, 1, [4000, 17], torch.float16),
    ]
    res = []
    base_cfg = kd.kernel_config

    def plain_cfg(*xs, **kw):  # the plain-Triton twin of the inline-PTX unpack
        consts, opts = base_cfg(*xs, **kw)
        consts["ASM"] = False
        return consts, opts

    for c in cases + [("asm=0",) + c for c in cases[:2]]:
        name = str(c[:5])
        if c[0] == "asm=0":
            kd.kernel_config = plain_cfg
            c = c[1:]
        try:
            # the GPU's yardstick: its fp32-operand dots (exact tail, generic path) are tf32
            td.run_and_check(rng, *c, device="cuda", operand_precision="fp16_tf32")
            res.append({"case": name, "ok": True})
        except Exception as e:  # report and keep going
            res.append({"case": name, "ok": False, "error": repr(e)[:400]})
        finally:
            kd.kernel_config = base_cfg
        print("check", res[-1], flush=True)
    # CUDA graph capture + replay
    try:
        args, _ = make_inputs(4, 4096, 32, 8, 128, "kvarn_k4v2_g64", tail=37)
        out = args[11]
        kd.decode(*args)
        torch.cuda.synchronize()
        want = out.clone()
        out.fill_(float("nan"))
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            kd.decode(*args)
        gr.replay()
        torch.cuda.synchronize()
        ok = bool(torch.equal(out, want))
        res.append({"case": "cuda_graph_replay", "ok": ok})
    except Exception as e:
        res.append({"case": "cuda_graph_replay", "ok": False, "error": repr(e)[:400]})
    print("check", res[-1], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", action="store_true")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--variants",
        default="",
        help="comma list of num_warps=N, rpad=N, stages=N, maxnreg=N, fast=0 (the "
        "byte-load loop), asm=0 (plain-Triton unpack on the GPU), splits=N "
        "(workspace split count; batch-1 geometries only), pdl=0 (the combine launched "
        "after the main kernel, not as its programmatic dependent), pdl_trigger=0 (the main "
        "kernel's programs signal the combine at their exit, not their start), mma_chunks=0 (runs "
        "of more than 16 query rows per KV head in one Triton launch of up to 32 rows, not in "
        "16-row chunks through the MMA kernel), dense_mma=0 (the Triton split kernel instead "
        "of the MMA kernels)",
    )
    which.add_argument("--geoms", default="", help="comma list of indices into GEOMS")
    which.add_argument(
        "--grid",
        action="store_true",
        help="the full sweep (GRID: contexts 1K-128K x batch 1-64, formats, geometries)",
    )
    ap.add_argument(
        "--query-len",
        type=int,
        default=1,
        help="query tokens per request (T > 1: a speculative verify run), every geometry",
    )
    ap.add_argument(
        "--graph",
        action="store_true",
        help="time CUDA-graph replay (GPU time) instead of back-to-back calls",
    )
    a = ap.parse_args()
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "timing": "cuda_graph_replay" if a.graph else "do_bench",
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    checks = check_gpu() if a.check else []
    bw = copy_bandwidth()
    rows = []
    base_cfg = kd.kernel_config
    variants = [("default", None)] + [(v, v) for v in a.variants.split(",") if v]
    todo = QUICK if a.quick else GRID if a.grid else GEOMS
    if a.geoms:
        todo = [GEOMS[int(i)] for i in a.geoms.split(",")]
    # One untimed measurement first: the first timing of a run read up to 2x slow on the H200
    # (B=8 32K 0.293 ms, 0.147 ms re-timed in the same run; tune_launch.py does the same).
    warm_args, _ = make_inputs(*todo[0], t=a.query_len)
    bench(lambda: kd.decode(*warm_args), False)
    warm_args = None
    for geom in todo:
        b, ctx, hq, hkv, d, fmt = geom
        args, nbytes = make_inputs(*geom, t=a.query_len)
        sd_ms, sd_bytes, backend = sdpa_time(b, ctx, hq, hkv, d, a.graph, a.query_len)
        for vname, v in variants:
            vargs = args
            if v and v.startswith("splits="):
                ws = kd.decode_workspace(
                    b,
                    a.query_len,
                    hq,
                    hkv,
                    d,
                    ctx,
                    args[9].block_size,
                    device="cuda",
                    num_splits=int(v.split("=")[1]),
                )
                vargs = args[:12] + (ws,)

            kd._MMA_STAGES, kd._MMA_MAXNREG, kd._MMA_TRANSPOSED = 2, None, True
            kd._PDL_TRIGGER = v != "pdl_trigger=0"
            kd.DECODE_MMA_CHUNKS = v != "mma_chunks=0"
            os.environ.pop("KVARN_DECODE_PDL", None)
            if v == "pdl=0":
                os.environ["KVARN_DECODE_PDL"] = "0"
            if v == "mma_t=0":
                kd._MMA_TRANSPOSED = False
            os.environ.pop("KVARN_DECODE_MMA", None)
            if v == "dense_mma=0":  # the Triton split kernel where an MMA kernel would serve
                os.environ["KVARN_DECODE_MMA"] = "0"
            if v and v.startswith("mma_stages="):
                kd._MMA_STAGES = int(v.split("=")[1])
            if v and v.startswith("mma="):  # mma=STAGES:MAXNREG
                st, mr = v.split("=")[1].split(":")
                kd._MMA_STAGES, kd._MMA_MAXNREG = int(st), int(mr)

            def cfg(*xs, _v=v, **kw):
                consts, opts = base_cfg(*xs, **kw)
                if _v:
                    k, val = _v.split("=")
                    if k == "num_warps":
                        opts["num_warps"] = int(val)
                    elif k == "rpad":
                        consts["R_PAD"] = max(int(val), consts["T"] * consts["GQA"])
                    elif k == "stages":
                        opts["num_stages"] = int(val)
                    elif k == "fast":
                        consts["FAST"] = consts["FAST"] and bool(int(val))
                        consts["ASM"] = consts["ASM"] and consts["FAST"]
                    elif k == "asm":
                        consts["ASM"] = consts["ASM"] and bool(int(val))
                    elif k == "maxnreg":
                        opts["maxnreg"] = int(val)
                return consts, opts

            kd.kernel_config = cfg
            try:
                if a.graph:
                    kd.decode(*vargs)  # compile outside the capture
                ms = bench(lambda a=vargs: kd.decode(*a), a.graph)
            except Exception as e:
                print("variant", vname, "failed", repr(e)[:300])
                continue
            finally:
                kd.kernel_config = base_cfg
                kd._PDL_TRIGGER = True
                os.environ.pop("KVARN_DECODE_PDL", None)
            rows.append(
                dict(
                    batch=b,
                    context=ctx,
                    hq=hq,
                    hkv=hkv,
                    head_dim=d,
                    query_len=a.query_len,
                    format=fmt,
                    variant=vname,
                    ms=ms,
                    bytes=nbytes,
                    gbps=nbytes / ms / 1e6,
                    frac_copy=nbytes / (ms * 1e-3) / bw,
                    sdpa_ms=sd_ms,
                    sdpa_backend=backend,
                    sdpa_frac_copy=sd_bytes / (sd_ms * 1e-3) / bw,
                    speedup_vs_sdpa=sd_ms / ms,
                    splits=vargs[12].numel() // (b * a.query_len * hq * (d + 1)),
                )
            )
            print("row", rows[-1], flush=True)
        torch.cuda.empty_cache()
        # written after every geometry so a run cut short still leaves its numbers
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps({"info": info, "copy_bw": bw, "checks": checks, "rows": rows}, indent=1)
        )
    print(f"{info}  copy BW {bw / 1e12:.2f} TB/s")
    print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} ok")
    print(
        "B     ctx  Hq Hkv   D T format           variant      ms   %copy  sdpa_ms sdpa% x_sdpa S"
    )
    for r in rows:
        print(
            f"{r['batch']:<3} {r['context']:>6} {r['hq']:>3} {r['hkv']:>3} {r['head_dim']:>3} "
            f"{r['query_len']} "
            f"{r['format']:<16} {r['variant']:<10} {r['ms']:7.3f} {100 * r['frac_copy']:6.1f} "
            f"{r['sdpa_ms']:7.3f} {100 * r['sdpa_frac_copy']:5.1f} {r['speedup_vs_sdpa']:5.2f} "
            f"{r['splits']}"
        )


if __name__ == "__main__":
    main()
