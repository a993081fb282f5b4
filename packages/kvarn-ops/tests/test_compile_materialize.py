"""Offline compilation of the Gluon materialize kernel (``kernels/materialize_mma.py``) for
sm_90a and sm_120a (no GPU needed): it compiles (every layout conversion inside is checked to be
a renaming of registers, ``assert_trivial``), spills nothing (one measured exception), and has
the instruction mix its design says: 160 ``mma.sync`` (per K or V tile: 4 m-tiles x 2 n-tiles
x 8 group products, plus 2 x 8 for the zero-point / column-scale vector; head pairs alike), no
shared-memory traffic besides those vectors, one ``prmt`` per byte pair of codes, and 16-byte
global stores only."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget

import kvarn_formats as kf
from cubin_info import cubin_resources

TARGETS = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 120, 32)]
CASES = [
    ("kvarn_k4v2_g64", "*bf16"),  # the benchmark's format
    ("kvarn_k4v4_g64", "*fp16"),
    ("kvarn_k4v2_g128", "*bf16"),  # a 128-token record is read as two 64-token programs
    ("kvarn_k4v4_g128", "*fp16"),
    # 2-bit K: a word holds 16 tokens, lanes pick their byte by a per-lane prmt selector
    ("kvarn_k2v2_g64", "*bf16"),
    ("kvarn_k2v4_g128", "*fp16"),
    # head_dim 64: two KV heads a program (SmolLM2, Llama-3.2-1B, TinyLlama)
    ("kvarn_k4v2_g64", "*bf16", 64),
    ("kvarn_k4v4_g128", "*fp16", 64),
    ("kvarn_k2v2_g64", "*bf16", 64),
    # head_dim 256: two 128-channel input halves summed into each output n-tile (Gemma), a
    # program taking a 64-token half-block as two 32-token pairs (the default)
    ("kvarn_k4v2_g64", "*bf16", 256, 2),
    ("kvarn_k4v4_g128", "*fp16", 256, 2),
    ("kvarn_k2v2_g64", "*bf16", 256, 2),
    # one pair a program (KVARN_MATERIALIZE_D256_PAIRS=1)
    ("kvarn_k4v2_g64", "*bf16", 256, 1),
    ("kvarn_k2v4_g128", "*fp16", 256, 1),
]
#: spill frames allowed, measured offline (fmt, head_dim, arch, pairs a program): 2-bit K head
#: pairs on sm_120a 8 B (sm_90a none); at head_dim 256 with both pairs' codes loaded up front
#: 88 B (sm_90a) and 112 B (sm_120a) at 4-bit K (2-bit K none)
SPILL = {
    ("kvarn_k2v2_g64", 64, 120, 1): 8,
    **{(f, 256, a, 2): 128 for f in ("kvarn_k4v2_g64", "kvarn_k4v4_g128") for a in (90, 120)},
}
PTRS = {
    "rec16_ptr": "*fp16",
    "rec32_ptr": "*i32",
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "cu_ptr": "*i32",
    "num_blocks": "i32",
    "total_rows": "i32",
    "max_blocks": "i32",
    "H": "i32",
}


def _compile(fmt: str, out: str, target, d: int = 128, mps: int = 1):
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvarn_ops.kernels import materialize_mma
    from kvarn_ops.kernels.materialize import record_offsets

    kern = materialize_mma.mma_materialize_kernel
    lay = kf.dense_layout(fmt, d)
    offs = record_offsets(lay)
    consts = dict(G=lay.block_size, REC=lay.record_bytes, VB=offs["V_BITS"], KB=offs["K_BITS"],
                  PAIR=d == 64, D=d, MPS=mps)  # fmt: skip
    consts.update({k: v for k, v in offs.items() if k.endswith("_OFF")})
    ptrs = dict(PTRS, k_out_ptr=out, v_out_ptr=out)
    sig = {n: "constexpr" if n in consts else ptrs[n] for n in kern.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if sig[n][0] == "*"
    }
    src = GluonASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=1))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:1] + c[2:])))
def test_mma_materialize_compiles_without_trips(case, target):
    fmt, out, d, mps = (*case, 128, 1)[:4] if len(case) == 2 else (*case, 1)[:4]
    k = _compile(fmt, out, target, d, mps)
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    vb = kf.dense_layout(fmt, d).field("v_codes").bits
    print(f"{case} sm{target.arch}: {regs} registers, {frame} B spill frame")
    assert frame <= SPILL.get((fmt, d, target.arch, mps), 0), f"{frame} B of spill frame"
    assert regs <= 255
    # Per compiled tile program ("copy": K and V; at head_dim 256 K and V for each half of
    # the 64 tokens) its m-tiles, its output n-tiles per m-tile, and the input halves each
    # n-tile sums (head pairs: 128 channels, each head's n-tile in place of the second)
    copies, mts, nts, halves = (4 // mps, 2 * mps, 4, 2) if d == 256 else (2, 4, 2, 1)
    # the products: 8 groups per n-tile and input half, plus the per-tile vectors (8 per
    # n-tile and half; at 256 the first half's products of the two output halves' vectors
    # are the same and computed once: 48, not 64)
    vec = 48 if d == 256 else 16
    assert ptx.count("mma.sync.aligned.m16n8k16") == copies * (mts * nts * 8 * halves + vec)
    # shared memory holds the per-tile vectors only: 8 two-value stores per vector, 8
    # two-value loads per (m-tile, n-tile)
    assert ptx.count("st.shared") == copies * nts * 8
    assert ptx.count("ld.shared") == copies * mts * nts * 8
    # one prmt per byte pair: K 16 per m-tile (each feeds two operand registers); 2-bit V 16
    # per m-tile (two registers each); 4-bit V 32 per m-tile (one register each); per input
    # half
    per_mt = 16 + (16 if vb == 2 else 32)
    assert ptx.count("prmt.b32") == copies // 2 * mts * halves * per_mt
    # every output element leaves in a 16-byte store: 4 per lane and (m-tile, n-tile)
    assert ptx.count("st.global.v4.b32") == copies * mts * nts * 4
    assert ptx.count("st.global") == copies * mts * nts * 4
    assert "popc" not in ptx and "cvt.rn.f16.s32" not in ptx
