"""Reproduce the 64-row failure of the Triton decode kernel on a CUDA GPU.

``decode`` computes at most 32 query rows per KV head in one launch (longer runs, up to 64
rows, in chunks of query tokens) because the Triton kernel's 64-row tile (T * GQA from 33 to
64; ``wgmma`` on sm_90 at 4 and 8 warps) computed wrong results on an H200 (BENCHMARKS.md,
"2026-12-02, night" and "2026-12-04, night"). This script makes one launch take the whole
run in its own process and runs one case against the CPU suite's oracle and yardstick, so
the failure can be studied::

    python gpu/repro_rows64.py FORMAT D HKV GQA T POOL WARPS
    python gpu/repro_rows64.py kvarn_k4v2_g64 128 2 8 8 bf16 4    # T 8 at GQA 8

It prints PASS or FAIL (with the error and its bound); an illegal memory access raises.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

POOLS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def main() -> None:
    if len(sys.argv) != 8:
        sys.exit(__doc__)
    fmt, pool = sys.argv[1], sys.argv[6]
    d, hkv, gqa, t, warps = (int(x) for x in sys.argv[2:6] + sys.argv[7:8])
    if not torch.cuda.is_available():
        sys.exit("repro_rows64: needs a CUDA GPU")
    td = importlib.import_module("test_decode")
    kd = importlib.import_module("kvarn_ops.kernels.decode")
    rd = importlib.import_module("kvarn_ops.reference.decode")
    kd.DECODE_MAX_ROWS = rd.MAX_QUERY_ROWS = 64
    kd.DECODE_PROGRAM_ROWS, kd.DECODE_MMA_CHUNKS = 64, False  # one Triton launch, no chunks
    base = kd.kernel_config

    def config(*args, **kwargs):
        consts, opts = base(*args, **kwargs)
        return consts, dict(opts, num_warps=warps)

    kd.kernel_config = config
    try:
        td.run_and_check(
            np.random.default_rng(7), fmt, d, hkv, gqa, t, [t, 130, 2100], POOLS[pool],
            device="cuda", operand_precision="fp16_tf32",
        )  # fmt: skip
    except AssertionError as exc:
        print("FAIL", exc)
        return
    print("PASS")


if __name__ == "__main__":
    main()
