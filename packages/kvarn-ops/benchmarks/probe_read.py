"""What bandwidth the decode's read pattern allows, without any of the decode's arithmetic.

The dense decode reads, per (request, KV head, split) program, one record of each of its
logical blocks through the block table (``packed[block_table[b, i], h]``: a few KB at a random
place). This probe reads exactly those bytes in the same grid (one XOR per 32-bit word, one
value written per program) and reports them against the device-to-device copy bandwidth of the
same run, as ``bench_decode.py`` reports the decode. Variants: warps per program, pipeline
stages of the block loop, split counts, sorted instead of random block tables, and a plain
streaming read of one large buffer.

    python benchmarks/probe_read.py --out results/probe_read.json

Needs a CUDA GPU. Reading: if the probe reaches ~X% in the decode's grid, no decode kernel with
this record layout and grid reads faster than X%; what the decode loses below X% is its own
work (unpack, MMAs, softmax, staging), and what the probe loses below the streaming read is
the access pattern.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402

import kvarn_formats as kf  # noqa: E402


@triton.jit
def _probe_blocks(packed32, bt, out, n_blk, per, bt_stride, HKV, S,
                  REC_W: tl.constexpr, PAD: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    lo = split * per
    hi = tl.minimum(lo + per, n_blk)
    offs = tl.arange(0, PAD)
    acc = tl.zeros([PAD], tl.int32)
    for i in tl.range(lo, hi, num_stages=STAGES):
        blk = tl.load(bt + b * bt_stride + i).to(tl.int64)
        w = tl.load(packed32 + (blk * HKV + h) * REC_W + offs, mask=offs < REC_W, other=0)
        acc = acc ^ w
    tl.store(out + pid * S + split, tl.xor_sum(acc, 0))


@triton.jit
def _probe_stream(x32, out, n_words, CH: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, CH)
    acc = tl.zeros([CH], tl.int32)
    base = pid.to(tl.int64) * CH * ITERS
    for i in tl.range(0, ITERS, num_stages=3):
        o = base + i * CH + offs
        acc = acc ^ tl.load(x32 + o, mask=o < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(acc, 0))


def probe_blocks(packed, bt, n_blk, splits, warps, stages):
    """Launch the block probe; returns ``(fn, out)`` (``fn`` re-launches it)."""
    nb, hkv, rec = packed.shape
    if rec % 4:
        raise ValueError(f"packed: record bytes must be a multiple of 4, got {rec}")
    b = bt.shape[0]
    p32 = packed.view(torch.int32)
    out = torch.empty(b * hkv * splits, dtype=torch.int32, device=packed.device)
    per = -(-n_blk // splits)
    pad = triton.next_power_of_2(rec // 4)

    def fn():
        _probe_blocks[(b * hkv, splits)](
            p32, bt, out, n_blk, per, bt.stride(0), hkv, splits, rec // 4, pad, stages,
            num_warps=warps,
        )  # fmt: skip

    return fn, out


def expected_xor(packed, bt, n_blk, splits) -> torch.Tensor:
    """The probe's output computed with torch (for the check)."""
    nb, hkv, rec = packed.shape
    b = bt.shape[0]
    per = -(-n_blk // splits)
    w = packed.view(torch.int32)
    res = torch.zeros(b * hkv * splits, dtype=torch.int32, device=packed.device)
    for bi in range(b):
        for h in range(hkv):
            for s in range(splits):
                lo, hi = s * per, min(s * per + per, n_blk)
                acc = torch.zeros(rec // 4, dtype=torch.int32, device=packed.device)
                for i in range(lo, hi):
                    acc ^= w[int(bt[bi, i]), h]
                x = 0
                for v in acc.tolist():
                    x ^= v
                res[(bi * hkv + h) * splits + s] = x
    return res


def stream_read(bw: float) -> dict:
    """A plain streaming read of 2 GiB (the same XOR), for scale."""
    x = torch.randint(0, 256, (1 << 31,), dtype=torch.uint8, device="cuda").view(torch.int32)
    ch, iters = 4096, 16
    grid = -(-x.numel() // (ch * iters))
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    ms = bd.bench(lambda: _probe_stream[(grid,)](x, out, x.numel(), ch, iters, num_warps=8), True)
    return dict(case="stream 2 GiB", ms=ms, pct=100 * x.numel() * 4 / (ms * 1e-3) / bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON report path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_read: needs a CUDA GPU")
    bw = bd.copy_bandwidth()
    rows = []

    # one small case checked against torch
    lay = kf.dense_layout("kvarn_k4v2_g64", 128)
    packed = torch.randint(0, 256, (40, 8, lay.record_bytes), dtype=torch.uint8, device="cuda")
    bt = torch.randperm(36, device="cuda", dtype=torch.int64).to(torch.int32).view(2, 18)
    for warps, stages in ((1, 1), (2, 3), (4, 4)):
        fn, out = probe_blocks(packed, bt, 18, 4, warps, stages)
        out.fill_(0x5A5A5A5A)
        fn()
        if not torch.equal(out, expected_xor(packed, bt, 18, 4)):
            sys.exit(f"probe_read: probe kernel wrong (warps {warps}, stages {stages})")

    rows.append(stream_read(bw))
    print(f"{'stream 2 GiB':>40} {rows[-1]['ms'] * 1e3:9.1f} us {rows[-1]['pct']:6.1f}%")

    for b, ctx, hkv, fmt in (
        (64, 32768, 8, "kvarn_k4v2_g64"),
        (8, 32768, 8, "kvarn_k4v2_g64"),
        (1, 32768, 8, "kvarn_k4v2_g64"),
        (64, 32768, 8, "kvarn_k4v4_g64"),
    ):
        lay = kf.dense_layout(fmt, 128)
        nfull = ctx // lay.block_size
        packed = torch.randint(
            0, 256, (b * nfull + 1, hkv, lay.record_bytes), dtype=torch.uint8, device="cuda"
        )
        nbytes = b * hkv * nfull * lay.record_bytes
        dec_splits = bd.kd.decode_num_splits(b, hkv, ctx, lay.block_size, "cuda")
        perm = torch.randperm(b * nfull, device="cuda", dtype=torch.int64).to(torch.int32)
        for order, btv in (("random", perm), ("sorted", torch.sort(perm).values)):
            bt = btv.view(b, nfull)
            for splits in sorted({dec_splits, 4 * dec_splits}):
                for warps in (1, 2, 4):
                    for stages in (1, 2, 3):
                        if order == "sorted" and (warps, stages) != (1, 3):
                            continue
                        fn, _ = probe_blocks(packed, bt, nfull, splits, warps, stages)
                        ms = bd.bench(fn, True)
                        r = dict(case=f"B={b} {ctx} {fmt}", order=order, splits=splits,
                                 warps=warps, stages=stages, ms=ms,
                                 pct=100 * nbytes / (ms * 1e-3) / bw)  # fmt: skip
                        rows.append(r)
                        print(f"{r['case']:>28} {order:>6} s{splits:<3} w{warps} st{stages} "
                              f"{ms * 1e3:9.1f} us {r['pct']:6.1f}%", flush=True)  # fmt: skip
        del packed
    props = torch.cuda.get_device_properties(0)
    meta = dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, copy_Bps=bw)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
