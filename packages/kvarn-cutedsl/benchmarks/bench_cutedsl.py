"""CuTe DSL decode vs the Triton decode of kvarn-ops, same inputs, on a CUDA GPU.

    KVARN_CUTEDSL_AOT_DIR=packages/kvarn-cutedsl/build/aot/sm_90a \
    PYTHONPATH=packages/kvarn-formats/src:packages/kvarn-ops/src:packages/kvarn-cutedsl/src \
    python packages/kvarn-cutedsl/benchmarks/bench_cutedsl.py --out bench_cutedsl.json

Bytes per call (the roofline): ``B * Hkv * (floor(L/G) * record_bytes + (L mod G) * 2 * D *
E)`` for the cache, plus q and out (``B*Hq*D*2`` each); workspace traffic is not counted.
GB/s is that divided by the median time (``triton.testing.do_bench``), and the fraction is
against a device-to-device copy measured in the same run. Records are random bytes with valid
fp16 scale fields (timing does not depend on the values). Table printed last.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

import kvarn_cutedsl
import kvarn_formats as kf
from kvarn_ops import kernels

SHAPES = [  # (format, batch, context); Llama-3.1-8B attention: Hq 32, Hkv 8, D 128
    ("kvarn_k4v2_g64", 1, 32768),
    ("kvarn_k4v2_g64", 8, 32768),
    ("kvarn_k4v2_g64", 32, 16384),
    ("kvarn_k4v2_g64", 64, 4096),
    ("kvarn_k4v2_g64", 1, 131072),
    ("kvarn_k4v4_g64", 8, 32768),
    ("kvarn_k4v4_g64", 32, 16384),
]
HQ, HKV, D = 32, 8, 128


def copy_bandwidth() -> float:
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3)


def make_case(fmt: str, batch: int, ctx: int):
    layout = kf.dense_layout(fmt, D)
    g = layout.block_size
    n_full = ctx // g
    tail = ctx - n_full * g
    nb = batch * n_full + 1
    packed = torch.randint(0, 256, (nb, HKV, layout.record_bytes), dtype=torch.uint8, device="cuda")
    half = packed.view(torch.float16)
    for name in (
        "k_col_scale",
        "k_zero_point",
        "k_row_scale",
        "v_col_scale",
        "v_row_scale",
        "v_zero_point",
    ):
        f = layout.field(name)
        half[..., f.offset // 2 : (f.offset + f.size) // 2] = (
            torch.rand(nb, HKV, f.size // 2, device="cuda") + 0.5
        ).half()
    table = torch.randperm(nb - 1, device="cuda").to(torch.int32)[: batch * n_full]
    table = (
        table.view(batch, max(n_full, 1))
        if n_full
        else torch.zeros(batch, 1, dtype=torch.int32, device="cuda")
    )
    pool = torch.randn(batch + 1, g, HKV, D, device="cuda").to(torch.bfloat16)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    tpb = torch.arange(batch, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, HQ, D, device="cuda").to(torch.bfloat16)
    args = (packed, table.contiguous(), seq, pool, pool.clone(), None, None, tpb, layout)
    nbytes = batch * HKV * (n_full * layout.record_bytes + tail * 2 * D * 2) + 2 * q.numel() * 2
    return q, args, nbytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_cutedsl.json")
    a = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    for fmt, batch, ctx in SHAPES:
        q, args, nbytes = make_case(fmt, batch, ctx)
        scale = 1 / math.sqrt(D)
        out_c = torch.empty_like(q)
        out_t = torch.empty_like(q)
        ws_c = kvarn_cutedsl.decode_workspace(batch, 1, HQ, HKV, D, ctx, 64, device="cuda")
        ws_t = kernels.decode_workspace(batch, 1, HQ, HKV, D, ctx, 64, device="cuda")
        ms_c = triton.testing.do_bench(lambda: kvarn_cutedsl.decode(q, *args, scale, out_c, ws_c))  # noqa: B023
        ms_t = triton.testing.do_bench(lambda: kernels.decode(q, *args, scale, out_t, ws_t))  # noqa: B023
        diff = float((out_c.float() - out_t.float()).norm() / out_t.float().norm())
        rows.append(
            dict(
                format=fmt,
                batch=batch,
                context=ctx,
                bytes=nbytes,
                cutedsl_ms=ms_c,
                triton_ms=ms_t,
                cutedsl_frac_copy_bw=nbytes / (ms_c * 1e-3) / bw,
                triton_frac_copy_bw=nbytes / (ms_t * 1e-3) / bw,
                speedup_vs_triton=ms_t / ms_c,
                rel_diff_vs_triton=diff,
            )
        )
        torch.cuda.empty_cache()
    result = dict(
        device=torch.cuda.get_device_name(),
        copy_bw_bytes_per_s=bw,
        geometry=dict(hq=HQ, hkv=HKV, head_dim=D, query_len=1),
        rows=rows,
    )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"device {result['device']}, copy bandwidth {bw / 1e12:.2f} TB/s; wrote {a.out}")
    print(
        f"{'format':16} {'B':>3} {'ctx':>7} {'cutedsl ms':>10} {'%bw':>5} {'triton ms':>10} "
        f"{'%bw':>5} {'speedup':>7} {'diff':>8}"
    )
    for r in rows:
        print(
            f"{r['format']:16} {r['batch']:>3} {r['context']:>7} {r['cutedsl_ms']:>10.3f} "
            f"{100 * r['cutedsl_frac_copy_bw']:>5.1f} {r['triton_ms']:>10.3f} "
            f"{100 * r['triton_frac_copy_bw']:>5.1f} {r['speedup_vs_triton']:>7.2f} "
            f"{r['rel_diff_vs_triton']:>8.1e}"
        )


if __name__ == "__main__":
    main()
