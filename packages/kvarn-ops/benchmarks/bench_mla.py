"""H200 benchmark of the MLA pack, fp8 staging and decode kernels.

For each case: bytes moved (formula below) / median time from ``triton.testing.do_bench``, as
GB/s and as a fraction of the device-to-device copy bandwidth measured in the same run
(``torch.Tensor.copy_`` of 1 GiB, read + write bytes). JSON to ``--out``; a short table last.

Bytes moved (R = record bytes, b = code bits):
- pack: read ``N*64*(512*E + s + 128)`` pool bytes, write ``N*R``.
- stage: per token read ``64*b + 128 + 4`` (codes, RoPE, amortized scales ~ 2050/64) and 8 slot
  bytes, write 656.
- decode: read ``B*L*R/64`` record bytes (+ pool tail rows), ``B*H*576*2`` query bytes, write
  ``B*H*512*2``; sparse: the same with L = the selected tokens (a token's share of its
  record; its scales are read once per token, so this undercounts the sectors touched).
Targets (issue 5): staging and decode >= 70% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import kvarn_formats as kf
from kvarn_ops.kernels import mla_decode, mla_decode_wgmma, mla_gather, mla_pack


def copy_bandwidth() -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3)


def random_cache(bits: int, num_blocks: int, pool_blocks: int, dtype):
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    dev = "cuda"
    pool_latent = (torch.randn(pool_blocks, 64, 512, device=dev) * 0.5).to(dtype)
    pool_scale = (
        torch.rand(pool_blocks, 64, device=dev) + 0.5 if dtype == torch.float8_e4m3fn else None
    )
    pool_rope = torch.randn(pool_blocks, 64, 64, device=dev).to(torch.bfloat16)
    packed = torch.zeros(num_blocks, layout.record_bytes, dtype=torch.uint8, device=dev)
    # Fill records by packing pool blocks round-robin (valid scales, realistic codes).
    step = 4096
    for s in range(0, num_blocks, step):
        n = min(step, num_blocks - s)
        src = (torch.arange(n, device=dev) % pool_blocks).int()
        dst = torch.arange(s, s + n, device=dev).int()
        mla_pack.mla_pack(pool_latent, pool_scale, pool_rope, src, dst, packed, layout)
    return layout, packed, pool_latent, pool_scale, pool_rope


def bench_pack(bits, n, dtype):
    layout, packed, pl, ps, pr = random_cache(bits, n, n, dtype)
    src = torch.randperm(n, device="cuda").int()
    dst = torch.arange(n, device="cuda").int()
    ms = triton.testing.do_bench(lambda: mla_pack.mla_pack(pl, ps, pr, src, dst, packed, layout))
    e, s = (1, 4) if dtype == torch.float8_e4m3fn else (2, 0)
    nbytes = n * 64 * (512 * e + s + 128) + n * layout.record_bytes
    return ms, nbytes


def bench_stage(bits, tokens, num_blocks):
    layout, packed, pl, ps, pr = random_cache(bits, num_blocks, 8, torch.bfloat16)
    bmap = torch.full((num_blocks,), -1, dtype=torch.int32, device="cuda")
    slots = torch.randint(0, num_blocks * 64, (tokens,), device="cuda")
    out = torch.empty(tokens, 656, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(
        lambda: mla_gather.mla_stage_fp8(packed, bmap, pl, ps, pr, slots, layout, out)
    )
    nbytes = tokens * (64 * bits + 128 + 2 * 1024 // 64 + 8 + 656)
    return ms, nbytes


def bench_decode(bits, batch, heads, context, splits, topk=None, graph=False):
    """Full-context decode, or with ``topk`` the sparse path over ``topk`` random distinct
    positions per request (DeepSeek-V3.2's DSA selects 2048)."""
    blocks_per = -(-context // 64)
    layout, packed, pl, ps, pr = random_cache(bits, batch * blocks_per, 8, torch.bfloat16)
    bt = torch.arange(batch * blocks_per, device="cuda", dtype=torch.int32).view(batch, -1)
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    bmap = torch.full((batch * blocks_per,), -1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    ws = mla_decode.mla_decode_workspace(batch, heads, splits, device="cuda")
    idx = None
    if topk is not None:
        idx = torch.stack([torch.randperm(context, device="cuda")[:topk] for _ in range(batch)]).to(
            torch.int32
        )

    def step():
        mla_decode.mla_decode(
            q, packed, bt, seq, bmap, pl, ps, pr, layout, 0.07, out, ws, indices=idx
        )

    if graph:
        # GPU time without the host's launch cost: the step captured once, replays timed
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        ms = triton.testing.do_bench(g.replay)
    else:
        ms = triton.testing.do_bench(step)
    tokens = context if topk is None else topk
    nbytes = batch * tokens * layout.record_bytes // 64 + batch * heads * (576 + 512) * 2
    return ms, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_mla.json")
    ap.add_argument("--ops", default="pack,stage,decode,sparse", help="comma list")
    ap.add_argument("--bits", default="4,5", help="code widths, comma list")
    ap.add_argument("--graph", action="store_true", help="time decode steps as CUDA-graph replays")
    ap.add_argument(
        "--kernels",
        default="default",
        help="decode kernels, comma list: default (the Gluon kernel where it applies: wgmma on "
        "sm_90), mma (the mma.sync Gluon kernel), wgmma (the wgmma kernels at 2, 4 and 5 bits), "
        "wgmma16 / wgmma64 (the 16- / 64-head wgmma kernel at every head count), triton",
    )
    args = ap.parse_args()
    ops = set(args.ops.split(","))
    bw = copy_bandwidth()
    rows = []

    def record(op, case, ms, nbytes):
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                "op": op,
                "case": case,
                "ms": ms,
                "bytes": nbytes,
                "GB/s": gbs,
                "fraction_of_copy_bw": nbytes / (ms * 1e-3) / bw,
            }
        )

    default_wgmma_bits = mla_decode.WGMMA_BITS
    default_min_heads = mla_decode.WGMMA64_MIN_HEADS
    for bits in (int(b) for b in args.bits.split(",")):
        for dt in (torch.bfloat16, torch.float8_e4m3fn) if "pack" in ops else ():
            record("pack", f"k{bits} N=2048 pool={str(dt)[6:]}", *bench_pack(bits, 2048, dt))
        if "stage" in ops:
            record("stage", f"k{bits} 65536 tokens", *bench_stage(bits, 65536, 8192))
        # (batch, heads, context, workspace splits; None: the workspace's own choice, enough
        # to fill the GPU): batch 1 also with the former default of 32 and with 128
        full = (
            (1, 16, 32768, 32),
            (1, 16, 32768, 128),
            (1, 16, 32768, None),
            (8, 16, 32768, None),
            (32, 128, 8192, None),
            (64, 16, 16384, None),
            (8, 128, 32768, None),
            (1, 128, 32768, None),
            (64, 128, 4096, None),
            (32, 64, 8192, None),
            (32, 32, 8192, None),
        )
        for kern in args.kernels.split(",") if "decode" in ops else ():
            mla_decode.MMA_KERNEL = kern != "triton"
            mla_decode.WGMMA_KERNEL = kern in ("default", "wgmma", "wgmma16", "wgmma64")
            mla_decode.WGMMA_BITS = (
                default_wgmma_bits if kern == "default" else mla_decode_wgmma.MLA_WGMMA_BITS
            )
            # wgmma16: the 16-head kernel at every head count; wgmma64: the 64-head kernel at
            # every head count
            mla_decode.WGMMA64_MIN_HEADS = {"wgmma16": None, "wgmma64": 1}.get(
                kern, default_min_heads
            )
            tag = ("" if kern == "default" else f" [{kern}]") + (" graph" if args.graph else "")
            for batch, heads, ctx, splits in full:
                ms, nbytes = bench_decode(bits, batch, heads, ctx, splits, graph=args.graph)
                s_used = (
                    splits or mla_decode.mla_decode_workspace(batch, heads, None, "cuda").num_splits
                )
                record("decode", f"k{bits} B={batch} H={heads} L={ctx} S={s_used}{tag}", ms, nbytes)
        mla_decode.MMA_KERNEL = mla_decode.WGMMA_KERNEL = True
        mla_decode.WGMMA_BITS = default_wgmma_bits
        mla_decode.WGMMA64_MIN_HEADS = default_min_heads
        for batch, heads in ((8, 16), (64, 16), (32, 128)) if "sparse" in ops else ():
            record(
                "sparse",
                f"k{bits} B={batch} H={heads} L=32768 top-2048",
                *bench_decode(bits, batch, heads, 32768, 32, topk=2048),
            )
    result = {"device": torch.cuda.get_device_name(), "copy_bw_bytes_per_s": bw, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    print(f"{'op':8} {'case':34} {'ms':>9} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        print(
            f"{r['op']:8} {r['case']:34} {r['ms']:9.4f} {r['GB/s']:8.1f} "
            f"{100 * r['fraction_of_copy_bw']:7.1f}"
        )


if __name__ == "__main__":
    main()
