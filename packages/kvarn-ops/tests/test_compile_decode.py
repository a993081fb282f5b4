"""Offline compilation of every decode kernel specialization that matters for sm_90a and
sm_120a (no GPU needed). Catches what the interpreter cannot: tl.dot shape limits, layout
conversion failures, unsupported conversions, register-hungry tiles that fail to compile."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget

import kvarn_ops
from cubin_info import cubin_resources

_DECODE_PY = Path(kvarn_ops.__file__).parent / "kernels" / "decode.py"


def _load_compiled_module():
    """decode.py imported with the interpreter off, so its kernels are JITFunctions even when
    the interpreter tests (which set TRITON_INTERPRET=1) run in the same process."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        spec = importlib.util.spec_from_file_location("_kvarn_decode_offline", _DECODE_PY)
        mod = importlib.util.module_from_spec(spec)
        # the custom op name is already registered by the interpreted import: skip it here
        src = _DECODE_PY.read_text().split("@torch.library.custom_op")[0]
        exec(compile(src, str(_DECODE_PY), "exec"), mod.__dict__)
        return mod
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


KD = _load_compiled_module()

SPLIT_PTRS = {
    "q_ptr": None,
    "rec_ptr": "*u8",
    "rec16_ptr": "*fp16",
    "rec32_ptr": "*i32",
    "bt_ptr": "*i32",
    "seq_ptr": "*i32",
    "ek_ptr": None,
    "ev_ptr": None,
    "ks_ptr": None,
    "vs_ptr": None,
    "tail_ptr": "*i32",
    "ws_ptr": "*fp32",
    "qk_scale": "fp32",
    "bt_stride": "i32",
    "num_kv_heads": "i32",
    "num_q_heads": "i32",
    "lse_numel": "i32",
}
POOL = {"float16": "*fp16", "bfloat16": "*bf16", "float8_e4m3fn": "*fp8e4nv"}
Q = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}

# (format, head_dim, gqa, T, pool dtype, q dtype)
CASES = [
    ("kvarn_k4v2_g64", 128, 4, 1, "bfloat16", "bfloat16"),  # the benchmark target
    ("kvarn_k4v2_g64", 128, 4, 8, "float8_e4m3fn", "bfloat16"),
    ("kvarn_k4v4_g128", 128, 8, 1, "float16", "float16"),
    ("kvarn_k2v2_g64", 128, 1, 1, "bfloat16", "bfloat16"),
    ("kvarn_k8v8_g32", 64, 2, 3, "float16", "float32"),
    ("kvarn_k4v2_g64", 64, 3, 1, "bfloat16", "bfloat16"),
    ("kvarn_k5v5_g64", 128, 4, 1, "bfloat16", "bfloat16"),  # generic path
    ("kvarn_k3v6_g64", 64, 4, 2, "float8_e4m3fn", "float16"),
    ("kvarn_k4v4_g64", 256, 4, 1, "bfloat16", "bfloat16"),
    ("kvarn_k4v2_g64", 512, 8, 1, "bfloat16", "bfloat16"),
    ("kvarn_k2v2_g128", 512, 1, 1, "float16", "float16"),
    ("kvarn_k4v2_g64", 128, 16, 2, "bfloat16", "bfloat16"),  # 32 rows: GQA 16, T 2
]
TARGETS = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 120, 32)]
#: Case -> stack frame (spill) bytes allowed: the larger of sm_90a and sm_120a measured offline
#: with aligned pointers, rounded up to 64 B. Cases not listed compile without spilling. The score
#: operand's second fp16 part (``_common.f16_parts``) raised them first (T 8 with an fp8 pool 512
#: -> 576, d512 1.1-1.6 KB -> 2.9-3.7 KB); then 2 warps instead of 4 at d <= 128 and 4 instead of
#: 8 at d256 (at most 16 rows; faster on the H200 despite these spills, see kernel_config) gave
#: the kernels more live values per thread: d128 GQA 4 0 -> 184, k4v4 g128 GQA 8 104 -> 600,
#: d64 GQA 3 168 -> 216, k5v5 256 -> 888 (sm_120a; 8 on sm_90a), k3v6 d64 fp8 T 2 128 -> 744
#: (sm_120a; 0 on sm_90a), d256 0 -> 160. The d512 cases keep 8 warps.
SPILL_ALLOWANCE = {
    ("kvarn_k4v2_g64", 128, 4, 1, "bfloat16", "bfloat16"): 192,
    ("kvarn_k4v2_g64", 128, 4, 8, "float8_e4m3fn", "bfloat16"): 640,
    ("kvarn_k4v4_g128", 128, 8, 1, "float16", "float16"): 640,
    ("kvarn_k2v2_g64", 128, 1, 1, "bfloat16", "bfloat16"): 64,
    ("kvarn_k4v2_g64", 64, 3, 1, "bfloat16", "bfloat16"): 256,
    ("kvarn_k5v5_g64", 128, 4, 1, "bfloat16", "bfloat16"): 896,
    ("kvarn_k3v6_g64", 64, 4, 2, "float8_e4m3fn", "float16"): 768,
    ("kvarn_k4v4_g64", 256, 4, 1, "bfloat16", "bfloat16"): 192,
    ("kvarn_k4v2_g64", 512, 8, 1, "bfloat16", "bfloat16"): 3648,
    ("kvarn_k2v2_g128", 512, 1, 1, "float16", "float16"): 3712,
    ("kvarn_k4v2_g64", 128, 16, 2, "bfloat16", "bfloat16"): 832,
}


def _split_source(fmt, d, gqa, t, pool, qdt, pdl=False, lag=0):
    consts, opts = KD.kernel_config(fmt, d, gqa, t, 16, pool == "float8_e4m3fn", lag)
    consts["PDL"] = pdl
    sig = {}
    for name in KD._decode_split_kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "q_ptr":
            sig[name] = Q[qdt]
        elif name in ("ek_ptr", "ev_ptr"):
            sig[name] = POOL[pool]
        elif name in ("ks_ptr", "vs_ptr"):
            sig[name] = "*fp32" if pool == "float8_e4m3fn" else POOL[pool]
        else:
            sig[name] = SPLIT_PTRS[name]
    # 16-byte aligned pointers, as the JIT specializes torch tensors.
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(KD._decode_split_kernel.arg_names)
        if sig[name].startswith("*")
    }
    return triton.compiler.ASTSource(
        fn=KD._decode_split_kernel, signature=sig, constexprs=consts, attrs=attrs
    ), opts


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-gqa{c[2]}-T{c[3]}-{c[4]}")
def test_split_kernel_compiles(case, target):
    src, opts = _split_source(*case)
    k = triton.compile(src, target=target, options=opts)
    assert "ptx" in k.asm
    regs, frame = cubin_resources(k.asm["cubin"])
    print(f"{case} sm{target.arch}: {regs} registers, {frame} B stack frame")
    assert 0 < regs <= 255
    assert frame <= SPILL_ALLOWANCE.get(case, 0), f"{case}: {frame} B of spills"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("splits", [16, 128])
@pytest.mark.parametrize(
    "d,out,tail,pool",
    [
        (64, "bfloat16", False, "bfloat16"),
        (128, "bfloat16", False, "bfloat16"),
        (128, "float32", False, "bfloat16"),
        (256, "float16", False, "float16"),
        (512, "bfloat16", False, "bfloat16"),
        # the exact tail folded in (the MMA kernels' calls), 16-bit and fp8 pools
        (128, "bfloat16", True, "bfloat16"),
        (128, "float16", True, "float8_e4m3fn"),
        (64, "float32", True, "float16"),
        (256, "bfloat16", True, "bfloat16"),
        (256, "float16", True, "float8_e4m3fn"),
    ],
)
def test_combine_kernel_compiles(d, out, tail, pool, splits, target):
    """Every configuration the launcher picks compiles without spilling (pointers 16-byte
    aligned as the JIT sees them), including one tile of all 128 splits at d128."""
    _compile_combine(d, out, tail, pool, splits, target, 64)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize(
    "d,splits,tail,g,warps",
    [
        # a few splits (batches of 32 and more) beside the MMA kernels' 64-token exact tail
        # at head_dim 64 and 128: 2 warps
        (128, 2, True, 64, 2),
        (128, 4, True, 64, 2),
        (64, 8, True, 64, 2),
        # a larger tail, a larger row tile, or no tail (the Triton split kernel's calls): 4
        (256, 2, True, 64, 4),
        (128, 2, True, 128, 4),
        (64, 2, True, 128, 4),
        (128, 8, True, 64, 4),
        (128, 2, False, 64, 4),
    ],
)
def test_combine_warps_for_few_splits(d, splits, tail, g, warps, target):
    """``combine_config`` gives the combine 2 warps where a row's partial tile is at most 512
    elements beside an exact tail of 64-token records at head_dim 64 or 128, 4 elsewhere;
    every such choice compiles without spilling (one warp would: 160 B of spill frame with a
    [64, 128] tail)."""
    assert KD.combine_config(d, splits, g, tail)[1]["num_warps"] == warps
    _compile_combine(d, "bfloat16", tail, "bfloat16", splits, target, g)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("pool", ["bfloat16", "float8_e4m3fn"])
def test_combine_kernel_compiles_g128_tail(pool, target):
    """The MMA kernels' calls with 128-token records: a [128, 128] exact tail beside all 128
    splits' partial rows, still without spilling."""
    _compile_combine(128, "bfloat16", True, pool, 128, target, 128)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
def test_programmatic_dependent_launch_compiles(target):
    """sm_90+ launches the combine as the main kernel's programmatic dependent: every main
    kernel signals it (``griddepcontrol.launch_dependents``) and the combine waits for the main
    grid (``griddepcontrol.wait``) before it reads the workspace; without PDL neither
    instruction is there (sm_80 has neither)."""
    for pdl in (False, True):
        split_src, split_opts = _split_source(
            "kvarn_k4v2_g64", 128, 4, 1, "bfloat16", "bfloat16", pdl=pdl
        )
        mains = [
            triton.compile(split_src, target=target, options=split_opts),
            triton.compile(
                _mma_source(*MMA_CASES[0], nbuf=2, pdl=pdl), target=target, options={"num_warps": 1}
            ),
            triton.compile(
                _mma_source(*MMA_CASES[0], nbuf=2, transposed=True, pdl=pdl),
                target=target,
                options={"num_warps": 1},
            ),
        ]
        for k in mains:
            assert k.asm["ptx"].count("griddepcontrol.launch_dependents") == int(pdl)
            assert "griddepcontrol.wait" not in k.asm["ptx"]
        for tail, pool in ((True, "bfloat16"), (True, "float8_e4m3fn"), (False, "bfloat16")):
            comb = _compile_combine(128, "bfloat16", tail, pool, 128, target, 64, pdl=pdl)
            ptx = comb.asm["ptx"]
            assert ptx.count("griddepcontrol.wait") == int(pdl)
            assert "launch_dependents" not in ptx
            assert comb.metadata.launch_pdl == pdl
            if pdl and tail:
                # the tail's pool loads are issued before the wait, the workspace's after it
                wait = ptx.index("griddepcontrol.wait")
                assert ptx[:wait].count("ld.global") >= 3
                assert "ld.global" in ptx[wait:]  # the workspace, not hoisted above the wait
                assert "ex2.approx" in ptx[:wait]  # the tail's softmax before the wait


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
def test_chunk_launches_compile(target):
    """The launches of a chunk of a long verify run (keys ending ``LAG`` tokens before the
    run's last): the Triton kernel's 32-row tile (``mma.sync``, never ``wgmma``, which computed
    wrong results as the 64-row tile on sm_90), both MMA kernels and the combine; the masks
    that ``LAG`` switches on for a chunk of one token are there."""
    src, opts = _split_source("kvarn_k4v2_g64", 128, 8, 4, "bfloat16", "bfloat16", lag=4)
    k = triton.compile(src, target=target, options=opts)
    assert "wgmma" not in k.asm["ptx"] and "mma.sync" in k.asm["ptx"]
    plain = triton.compile(
        _mma_source("kvarn_k4v2_g64", 16, 1, "*bf16", nbuf=2), target=target,
        options={"num_warps": 1},
    )  # fmt: skip
    lagged = triton.compile(
        _mma_source("kvarn_k4v2_g64", 16, 1, "*bf16", nbuf=2, lag=3), target=target,
        options={"num_warps": 1},
    )  # fmt: skip
    # a one-token chunk followed by 3 more tokens masks its keys (a comparison per score)
    assert lagged.asm["ptx"].count("setp.") > plain.asm["ptx"].count("setp.")
    triton.compile(
        _mma_source("kvarn_k4v2_g64", 4, 2, "*bf16", nbuf=2, transposed=True, lag=2),
        target=target, options={"num_warps": 1},
    )  # fmt: skip
    _compile_combine(128, "bfloat16", True, "bfloat16", 16, target, 64, lag=4)


def _compile_combine(d, out, tail, pool, splits, target, g, pdl=False, lag=0):
    cc, copts = KD.combine_config(d, splits, g, tail)
    if d == 128 and splits == 128:
        # the whole row in one round trip; 8 warps only beside a 128-token exact tail
        assert cc["SC"] == 128 and copts["num_warps"] == (8 if tail and g == 128 else 4)
    consts = dict(
        D=d,
        G=g,
        S=splits,
        S_P2=splits,
        MIN_UNITS=KD.DECODE_MIN_UNITS_PER_SPLIT,
        TAIL=tail,
        T=2,
        GQA=4,
        POOL_FP8=pool == "float8_e4m3fn",
        PDL=pdl,
        LAG=lag,
        **cc,
    )
    types = {
        "ws_ptr": "*fp32",
        "seq_ptr": "*i32",
        "out_ptr": Q[out],
        "lse_numel": "i32",
        "rows_per_request": "i32",
        "q_ptr": Q[out],
        "ek_ptr": POOL[pool],
        "ev_ptr": POOL[pool],
        "ks_ptr": "*fp32" if pool == "float8_e4m3fn" else POOL[pool],
        "vs_ptr": "*fp32" if pool == "float8_e4m3fn" else POOL[pool],
        "tail_ptr": "*i32",
        "qk_scale": "fp32",
        "num_kv_heads": "i32",
        "num_q_heads": "i32",
    }
    names = KD._decode_combine_kernel.arg_names
    sig = {n: "constexpr" if n in consts else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*"}
    src = triton.compiler.ASTSource(
        fn=KD._decode_combine_kernel, signature=sig, constexprs=consts, attrs=attrs
    )
    k = triton.compile(src, target=target, options=dict(copts, launch_pdl=pdl))
    regs, frame = cubin_resources(k.asm["cubin"])
    print(f"combine d{d} G{g} S{splits} tail={tail} {pool} sm{target.arch}: {regs} regs, {frame} B")
    assert 0 < regs <= 255
    assert frame == 0, f"{frame} B of spill frame"
    return k


# --------------------------------------------------------------------------------------------
# the Gluon MMA kernel (decode_mma.py): compiles for both targets, every layout conversion is a
# register renaming (assert_trivial inside the kernel), no shared memory, no spills
# --------------------------------------------------------------------------------------------
MMA_CASES = [
    ("kvarn_k4v2_g64", 4, 1, "*bf16"),
    ("kvarn_k4v4_g64", 8, 1, "*fp16"),
    ("kvarn_k4v2_g64", 4, 4, "*fp32"),
    ("kvarn_k4v2_g128", 4, 4, "*bf16"),  # 128-token records, two 64-token halves
    ("kvarn_k4v2_g64", 16, 1, "*bf16"),  # GQA 16 (Llama-3.1-405B, GLM-4): 16 rows
    ("kvarn_k2v2_g64", 8, 2, "*bf16"),  # 2-bit K, 16 rows (a 2-token verify at GQA 8)
    ("kvarn_k2v4_g128", 16, 1, "*fp16"),
]
#: spill frame allowed (bytes, the larger of sm_90a / sm_120a measured offline, rounded up):
#: the benchmark target spills nothing on sm_90a (32 B on sm_120a), 4-bit V 32 B, T > 1 with
#: the causal mask 112-136 B (with 128-token records, bf16 q: 8 B on sm_90a), 2-bit K 8-16 B
MMA_SPILL = {
    MMA_CASES[0]: 64,
    MMA_CASES[1]: 64,
    MMA_CASES[2]: 192,
    MMA_CASES[3]: 192,
    MMA_CASES[5]: 64,  # 2-bit K at 16 rows: 8 B on sm_90a
    MMA_CASES[6]: 64,  # 16 B on both targets
}


def _mma_source(fmt, gqa, t, qdt, nbuf=3, transposed=False, pdl=False, lag=0, d=128):
    """The Gluon MMA decode kernel's source (``d`` 64: the transposed kernel on head pairs)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvarn_ops.kernels import decode_mma, decode_mma_d256, decode_mma_t

    kern = decode_mma_t.mma_decode_t_kernel if transposed else decode_mma.mma_decode_kernel
    if d == 256:
        kern = decode_mma_d256.mma_decode_t256_kernel

    c = KD._layout_consts(fmt, d)
    consts = dict(
        T=t, GQA=gqa, VB=c["VB"], REC=c["REC"], S=16, MIN_UNITS=2, NBUF=nbuf, G=c["G"], PDL=pdl,
        LAG=lag,
    )  # fmt: skip
    if transposed and d != 256:
        consts["PAIR"] = KD.mma_heads_per_program(d, t * gqa)
    if "KB" in kern.arg_names:
        consts["KB"] = c["KB"]
    for name in ("K_OFF", "KCS_OFF", "KZP_OFF", "KRS_OFF", "V_OFF", "VCS_OFF", "VRS_OFF"):
        consts[name] = c[name]
    consts["VZP_OFF"] = c["VZP_OFF"]
    ptrs = {
        "q_ptr": qdt,
        "rec16_ptr": "*fp16",
        "rec32_ptr": "*i32",
        "bt_ptr": "*i32",
        "seq_ptr": "*i32",
        "ws_ptr": "*fp32",
        "qk_scale": "fp32",
        "bt_stride": "i32",
        "num_kv_heads": "i32",
        "num_q_heads": "i32",
        "lse_numel": "i32",
    }
    names = kern.arg_names
    sig = {n: "constexpr" if n in consts else ptrs[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*"}
    return GluonASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)


@pytest.mark.parametrize("nbuf", [2, 3], ids=["cp_async2", "cp_async3"])
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{c[0]}-gqa{c[1]}-T{c[2]}")
def test_mma_decode_compiles_without_operand_trips(target, case, nbuf):
    """Codes go from a cp.async stage into MMA operand registers with no shared-memory store
    and no layout shuffle: every conversion inside is a register renaming
    (``assert_trivial``), which this compile also checks."""
    k = triton.compile(_mma_source(*case, nbuf=nbuf), target=target, options=dict(num_warps=1))
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    vb = KD._layout_consts(case[0], 128)["VB"]
    assert "st.shared" not in ptx
    # one record per stage: K words 4 KB, V words 2 or 4 KB, scales 1,152 B
    assert k.metadata.shared == nbuf * (4096 + 1024 * vb + 1152)
    assert ptx.count("cp.async") >= 48
    print(f"{case} sm{target.arch} nbuf {nbuf}: {regs} registers, {frame} B spill frame")
    assert frame <= MMA_SPILL.get(case, 0), f"{frame} B of spill frame"
    assert regs <= 255
    # per 64-token block: 4 x 16 score MMAs for each of the two fp16 parts of q * s_col_K,
    # 4 x 16 value MMAs, 4 for the ones column of 2-bit V; q is rotated by a Walsh-Hadamard
    # transform, not by MMAs (4 x 32 more before), so no sign is generated either
    vb = KD._layout_consts(case[0], 128)["VB"]
    from kvarn_ops.kernels import decode_mma

    ones = 4 if vb == 2 and not decode_mma.SUBNORMAL_CODES else 0  # no ones column then
    assert ptx.count("mma.sync.aligned.m16n8k16") == 2 * 64 + 64 + ones
    assert ptx.count("shfl.sync.bfly.b32") >= 128  # the transform's two cross-lane stages
    assert "popc" not in ptx and "cvt.rn.f16.s32" not in ptx
    # one prmt per byte pair: K 16 per chunk (each feeds two operand registers), 2-bit V 8 per
    # chunk (four registers each); 4-bit V keeps one per register, 32 per chunk
    # (2-bit K: one per byte of two channels' words, 8 per chunk)
    kb = KD._layout_consts(case[0], 128)["KB"]
    assert ptx.count("prmt.b32") == 4 * (16 if kb == 4 else 8) + 4 * (8 if vb == 2 else 32)


T_CASES = [
    MMA_CASES[0],
    MMA_CASES[1],
    ("kvarn_k4v2_g64", 4, 2, "*bf16"),
    # 128-token records, read as two 64-token halves
    ("kvarn_k4v2_g128", 4, 1, "*bf16"),
    ("kvarn_k4v4_g128", 8, 1, "*fp16"),
    # 2-bit K (KB = 2): the same staging and MMAs, another unpack
    ("kvarn_k2v2_g64", 4, 1, "*bf16"),
    ("kvarn_k2v4_g128", 8, 1, "*fp16"),
    ("kvarn_k2v2_g64", 4, 2, "*fp32"),
]
#: the transposed kernel: no spill frame on sm_90a; sm_120a measured offline, rounded up
T_SPILL = {}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", T_CASES, ids=lambda c: f"{c[0]}-gqa{c[1]}-T{c[2]}")
def test_mma_decode_transposed_compiles(target, case):
    """The kernel with the query rows in the MMA's N dimension (<= 8 rows): no shared-memory
    store besides the per-block transpose of the softmax weights and the once-per-program
    move of q, half the per-block MMAs of the 16-row kernel."""
    from kvarn_ops.kernels import decode_mma

    kb = KD._layout_consts(case[0], 128)["KB"]
    if kb == 2 and decode_mma.SUBNORMAL_CODES:
        # 2-bit K runs on normal fp16 codes only: refused in the subnormal mode, and the
        # kernel's compile-time check stops a launch that bypasses the refusal
        assert not decode_mma.mma_decode_supported(2, 2, 64, 128, case[1] * case[2])
        with pytest.raises(Exception, match="KB == 4 or"):
            triton.compile(
                _mma_source(*case, nbuf=2, transposed=True), target=target,
                options=dict(num_warps=1),
            )  # fmt: skip
        return
    src = _mma_source(*case, nbuf=2, transposed=True)
    k = triton.compile(src, target=target, options=dict(num_warps=1))
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    vb = KD._layout_consts(case[0], 128)["VB"]
    print(f"{case} sm{target.arch}: {regs} registers, {frame} B spill frame")
    assert frame <= T_SPILL.get((case, target.arch), 0), f"{frame} B of spill frame"
    assert regs <= 255
    assert ptx.count("cp.async") >= 48
    from kvarn_ops.kernels import decode_mma_t

    sub = decode_mma_t.SUBNORMAL_CODES
    print(f"{case} sm{target.arch}: {'subnormal' if sub else 'offset'} code operands")
    # per block: scores 4 x (2 x 8 for the two fp16 parts of q * s_col_K + 2 x 2 zero-point),
    # values 4 x 8 (+ 4 for the ones column of 2-bit V, unless its codes are subnormals); q is
    # rotated by a Walsh-Hadamard transform, not by MMAs (64 before). With at most four query
    # rows the two parts share one operand (fused columns): 4 x (8 + 2) for the scores
    ones = 4 if vb == 2 and not sub else 0
    fused = not sub and decode_mma_t.FUSED_COLUMNS and case[1] * case[2] <= 4
    assert ptx.count("mma.sync.aligned.m16n8k16") == (40 if fused else 80) + 32 + ones
    if sub:
        # K codes exact as fp16 subnormals: masked only (two ``and`` per byte pair), nothing
        # subtracted; 2-bit V likewise (4-bit V keeps the 1024 of its mantissa trick: one
        # subtraction per operand register, 128 per block)
        assert ptx.count("and.b32 %r") >= 2 * 16 * 4
        assert ptx.count("sub.f16x2") == (0 if vb == 2 else 128)
    elif KD._layout_consts(case[0], 128)["KB"] == 2:
        # 2-bit K exact (the 1 of 1 + c / F subtracted): one prmt per byte of two channels'
        # words (8 per chunk) and four subtractions; 2-bit V one prmt per byte pair (8 per
        # chunk), 4-bit V one per operand register (32); the rest is the q transform's
        assert ptx.count("sub.f16x2") >= 4 * 8 * 4
        assert ptx.count("prmt.b32") == 4 * 8 + 4 * (8 if vb == 2 else 32) + 16
    else:
        # K codes exact (the 1024 of the mantissa trick subtracted): two per byte pair
        assert ptx.count("sub.f16x2") >= 2 * 16 * 4
    # its two cross-lane stages: one butterfly shuffle per register each
    assert ptx.count("shfl.sync.bfly.b32") >= 64
    assert "popc" not in ptx  # no sign matrix


FUSED_CASES = [
    # record-order 4-bit K, 128-token records with 4-bit V, 2-bit K, two query tokens at GQA 2
    ("kvarn_k4v2_g64", 4, 1, "*bf16"),
    ("kvarn_k4v4_g128", 4, 1, "*fp16"),
    ("kvarn_k2v2_g64", 4, 1, "*bf16"),
    ("kvarn_k2v4_g128", 2, 2, "*fp32"),
]


# compiled in a child process with the switch set at import (a kernel's globals are read when
# it is first compiled in a process)
_FUSED_CHILD = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
import test_compile_decode as T
from cubin_info import cubin_resources
from kvarn_ops.kernels import decode_mma_t
from kvarn_ops.kernels import decode_mma_d256
case = tuple(json.loads(sys.argv[2]))
d = int(sys.argv[3])
out = dict(fused=decode_mma_t.FUSED_COLUMNS, sub=decode_mma_t.SUBNORMAL_CODES,
           fused256=decode_mma_d256.FUSED_COLUMNS_D256)
for arch in (90, 120):
    k = triton.compile(T._mma_source(*case, nbuf=2, transposed=True, d=d),
                       target=GPUTarget("cuda", arch, 32), options=dict(num_warps=1))
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    out[arch] = dict(regs=regs, frame=frame, mma=ptx.count("mma.sync.aligned.m16n8k16"),
                     sel=ptx.count(", 0xd8;"))
print(json.dumps(out))
"""


def _compile_child(case, d, **switches):
    """``_FUSED_CHILD``'s counts for ``case`` at head_dim ``d`` with ``switches`` set in the
    child's environment."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    env.pop("KVARN_DECODE_SUBNORMAL", None)
    for name, value in switches.items():  # None: unset, the module's default
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    proc = subprocess.run(
        [sys.executable, "-c", _FUSED_CHILD, str(Path(__file__).parent), json.dumps(case), str(d)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("switch", ["1", "0"], ids=["fused", "two_operands"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{c[0]}-gqa{c[1]}-T{c[2]}")
def test_mma_decode_fused_columns_compiles(case, switch):
    """``decode_mma_t.FUSED_COLUMNS`` (the default; ``KVARN_DECODE_FUSED_COLUMNS=0`` turns it
    off): at most four query rows, q's two fp16 parts in the columns of one score operand: 4 x
    (8 + 2) score and zero-point MMAs a block instead of 4 x (16 + 4), one column select per
    operand register, no spill frame (sm_90a and sm_120a); switched off, the two operands and
    no select."""
    got = _compile_child(case, 128, KVARN_DECODE_FUSED_COLUMNS=switch)
    print(case, switch, got)
    fused = switch == "1"
    assert got["fused"] == fused and not got["sub"]
    vb = KD._layout_consts(case[0], 128)["VB"]
    for arch in ("90", "120"):
        assert got[arch]["regs"] <= 255 and got[arch]["frame"] == 0, (arch, got[arch])
        assert got[arch]["mma"] == (40 if fused else 80) + 32 + (4 if vb == 2 else 0), got[arch]
        # the even / odd column select, one lop3 per register (4 a chunk): the block's score
        # operands and, once a program, the zero-point operand
        assert got[arch]["sel"] == (2 * 16 if fused else 0), (arch, got[arch])


D256_FUSED_CASES = [
    # Gemma's GQA 2 with 2-bit K; GQA 4 (at the four-row limit); 8 rows: never fused
    ("kvarn_k2v2_g64", 2, 1, "*bf16"),
    ("kvarn_k4v2_g64", 4, 1, "*bf16"),
    ("kvarn_k4v2_g128", 8, 1, "*fp32"),
]


@pytest.mark.parametrize("switch", [None, "1", "0"], ids=["default", "fused", "two_operands"])
@pytest.mark.parametrize("case", D256_FUSED_CASES, ids=lambda c: f"{c[0]}-gqa{c[1]}-T{c[2]}")
def test_mma_decode_d256_fused_columns_compiles(case, switch):
    """``decode_mma_d256.FUSED_COLUMNS_D256`` (the default; ``KVARN_DECODE_FUSED_COLUMNS_D256=0``
    turns it off): at most four query rows, each half's score and zero-point MMAs 80 -> 40 a
    block (values and the ones column unchanged), one column select per register of each
    chunk's score operand and fused zero-point operand, no spill frame (sm_90a and sm_120a);
    8 rows keep two operands, as does every case with the switch at 0."""
    got = _compile_child(case, 256, KVARN_DECODE_FUSED_COLUMNS_D256=switch)
    print(case, switch, got)
    on = switch != "0"
    assert got["fused256"] == on and got["fused"] and not got["sub"]
    fused = on and case[1] * case[2] <= 4
    ones = 4 if KD._layout_consts(case[0], 256)["VB"] == 2 else 0
    for arch in ("90", "120"):
        assert got[arch]["regs"] <= 255 and got[arch]["frame"] == 0, (arch, got[arch])
        assert got[arch]["mma"] == 2 * (40 if fused else 80) + 64 + ones, (arch, got[arch])
        assert got[arch]["sel"] == (8 * (4 + 4) if fused else 0), (arch, got[arch])


def test_mma_decode_scope_and_splits():
    """Which geometries the MMA kernels take (4-bit K, 2/4-bit V, G 64/128; d128 up to 16
    query rows a KV head, d64 up to 8: head pairs up to 4 rows each; 2-bit K alike), and the
    workspace's split count sized for the programs of two heads at d64."""
    from kvarn_ops.kernels import decode_mma

    ok = decode_mma.mma_decode_supported
    assert ok(2, 2, 64, 128, 16) and ok(2, 4, 128, 128, 1) and not ok(2, 2, 64, 128, 17)
    assert ok(2, 2, 64, 64, 4) and ok(2, 2, 64, 256, 8) and not ok(2, 2, 64, 256, 9)
    assert not ok(2, 2, 32, 128, 4) and not ok(3, 2, 64, 128, 4) and not ok(2, 2, 64, 96, 4)
    assert ok(4, 2, 64, 128, 16) and not ok(4, 2, 64, 128, 17)
    assert ok(4, 2, 64, 64, 4) and ok(4, 4, 128, 64, 8) and not ok(4, 2, 64, 64, 9)
    assert not ok(4, 3, 64, 64, 4) and not ok(4, 2, 32, 64, 4)
    assert ok(4, 2, 64, 256, 8) and ok(4, 4, 128, 256, 1) and not ok(4, 2, 64, 256, 9)
    assert not ok(4, 2, 64, 96, 4) and not ok(4, 2, 64, 512, 4) and not ok(4, 2, 64, 64, 0)

    def splits(b, t, hq, hkv, d):
        ws = KD.decode_workspace(b, t, hq, hkv, d, 32768, 64, device="cpu")
        return ws.numel() // (b * t * hq * (d + 1))

    # 8 one-warp programs per SM on 132 SMs: 1,056 / (batch x programs per step)
    assert splits(32, 1, 32, 8, 64) == KD.decode_num_splits(32, 4, 32768, 64) == 8
    assert splits(32, 1, 32, 8, 128) == KD.decode_num_splits(32, 8, 32768, 64) == 4
    assert splits(8, 1, 9, 3, 64) == KD.decode_num_splits(8, 2, 32768, 64) == 66
    # 5-8 rows a head: one head a program
    assert splits(32, 1, 32, 4, 64) == KD.decode_num_splits(32, 4, 32768, 64)
    assert splits(32, 2, 32, 8, 64) == KD.decode_num_splits(32, 8, 32768, 64)


PAIR_CASES = [
    ("kvarn_k4v2_g64", 4, 1, "*bf16"),  # Llama-3.2-1B
    ("kvarn_k4v4_g64", 2, 2, "*fp16"),  # 4-bit V, 2-token causal rows (4 a head)
    ("kvarn_k4v2_g128", 3, 1, "*bf16"),  # SmolLM2's GQA 3, 128-token records
    ("kvarn_k4v4_g128", 1, 4, "*fp32"),
    ("kvarn_k4v2_g64", 8, 1, "*bf16"),  # TinyLlama's GQA 8: one head a program
    ("kvarn_k4v4_g64", 7, 1, "*fp16"),  # Qwen2.5-0.5B's GQA 7
    ("kvarn_k2v2_g64", 4, 1, "*bf16"),  # 2-bit K, head pairs
    ("kvarn_k2v4_g128", 8, 1, "*bf16"),  # 2-bit K, one head a program
]


D256_CASES = [
    ("kvarn_k4v2_g64", 4, 1, "*bf16"),
    ("kvarn_k4v4_g64", 2, 2, "*fp16"),  # Gemma-2/3's GQA 2, 2-token causal rows
    ("kvarn_k4v2_g128", 8, 1, "*fp32"),
    ("kvarn_k4v4_g128", 4, 1, "*bf16"),
    ("kvarn_k2v2_g64", 2, 1, "*bf16"),  # 2-bit K
    ("kvarn_k2v4_g128", 4, 2, "*fp16"),
]


def _compile_transposed(case, target, d):
    """The transposed kernel (or the d256 one) for ``case`` at head_dim ``d``, compiled and
    checked to have no spill frame: ``(kernel, ptx, V bits, MMAs a block should have)``."""
    from kvarn_ops.kernels import decode_mma_t

    src = _mma_source(*case, nbuf=2, transposed=True, d=d)
    k = triton.compile(src, target=target, options=dict(num_warps=1))
    regs, frame = cubin_resources(k.asm["cubin"])
    print(f"{case} d{d} sm{target.arch}: {regs} registers, {frame} B spill frame")
    assert frame == 0, f"{frame} B of spill frame"
    vb = KD._layout_consts(case[0], d)["VB"]
    ones = 4 if vb == 2 and not decode_mma_t.SUBNORMAL_CODES else 0
    # a 128-channel block: scores 80 (two fp16 parts + zero points), values 32, ones column
    return k, k.asm["ptx"], vb, 80 + 32 + ones


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", D256_CASES, ids=lambda c: f"{c[0]}-gqa{c[1]}-T{c[2]}")
def test_mma_decode_d256_compiles(target, case):
    """head_dim 256 (``decode_mma_d256``): a block as two 128-channel halves, scores of both
    into one accumulator, values into eight; the q parts read from shared memory in the loop
    (``ldmatrix``), no spill (offline: 168-252 registers). With the fused score columns (the
    default, at most four rows a KV head) each half's scores and zero points take 40 MMAs
    instead of 80 (``test_mma_decode_d256_fused_columns_compiles`` has both builds)."""
    from kvarn_ops.kernels import decode_mma_d256

    k, ptx, vb, mmas = _compile_transposed(case, target, 256)
    # a stage: twice the 128-channel record's words and channel vectors, one head's token
    # vectors; the q parts 16 x [32, 8] fp16
    assert k.metadata.shared == 2 * (8192 + 2048 * vb + 1024 + 512 + 3 * 128) + 8192
    fused = decode_mma_d256._FUSED256.value and case[1] * case[2] <= 4
    scores = 40 if fused else 80
    # the first half (mmas: 80 score and zero-point MMAs, 32 value MMAs, the ones column),
    # then the second half's scores and values
    assert ptx.count("mma.sync.aligned.m16n8k16") == mmas - 80 + 2 * scores + 32
    assert ptx.count("ldmatrix") >= 16  # the q parts, in the loop
    assert "popc" not in ptx


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"{c[0]}-gqa{c[1]}-T{c[2]}")
def test_mma_decode_head_pairs_compile(target, case):
    """head_dim 64 through the transposed kernel, two KV heads a program up to 4 rows a head,
    else one (``decode_mma_pair``): the 128-channel kernel's MMAs and unpack, both records'
    token vectors staged (twice the [8, 8] tiles), no spill (offline: 206-255 registers)."""
    k, ptx, vb, mmas = _compile_transposed(case, target, 64)
    # a stage: the virtual 128-channel record's words and vectors, token vectors of both heads
    assert k.metadata.shared == 2 * (4096 + 1024 * vb + 1152 + 3 * 128)
    assert ptx.count("mma.sync.aligned.m16n8k16") == mmas
    # the 64-channel rotation: one cross-lane stage (the 128-channel kernel has two)
    assert 32 <= ptx.count("shfl.sync.bfly.b32") < 64
    assert "popc" not in ptx


# --------------------------------------------------------------------------------------------
# the Gluon MLA decode kernel (mla_decode_mma.py): both pools, both targets
# --------------------------------------------------------------------------------------------
#: spill frame allowed (bytes; measured offline, rounded up to 64 B), by (arch, pool)
MLA_MMA_SPILL = {(90, "bf16"): 192, (90, "fp8"): 192, (120, "bf16"): 448, (120, "fp8"): 448}


def _mla_mma_source(pool: str, nbuf: int | None, bits: int = 4, wide: bool = False):
    """The Gluon MLA decode kernel's source: ``mla_decode_mma`` with ``nbuf`` stages, or
    ``mla_decode_wgmma`` with ``nbuf=None`` (``bits``-bit codes; ``wide``: the 64-head kernel
    of ``mla_decode_wgmma64``)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    import kvarn_formats as kf
    from kvarn_ops.kernels import mla_decode_mma, mla_decode_wgmma, mla_decode_wgmma64
    from kvarn_ops.kernels.mla_common import field_offsets

    offs = field_offsets(kf.mla_layout(f"kvarn_mla_k{bits}_g64"))
    width = offs.pop("BITS")
    consts = dict(offs, FP8=pool == "fp8", MIN_BLOCKS=2)
    if nbuf is None:
        wgmma = mla_decode_wgmma64.mla_wgmma64_kernel if wide else None
        kern = wgmma or mla_decode_wgmma.mla_wgmma_kernel
        consts["BITS"] = width
    else:
        kern = mla_decode_mma.mla_mma_kernel
        consts["NBUF"] = nbuf
    types = {
        "q_ptr": "*bf16",
        "qrot_ptr": "*fp32",
        "rec16_ptr": "*fp16",
        "rec32_ptr": "*i32",
        "recbf_ptr": "*bf16",
        "map_ptr": "*i32",
        "pool_ptr": "*fp8e4nv" if pool == "fp8" else "*bf16",
        "pscale_ptr": "*fp32",
        "prope_ptr": "*bf16",
        "bt_ptr": "*i32",
        "seq_ptr": "*i32",
        "po_ptr": "*fp32",
        "plse_ptr": "*fp32",
        "H": "i32",
        "S": "i32",
        "bt_stride": "i32",
        "max_blocks": "i32",
        "qk_scale": "fp32",
    }
    names = kern.arg_names
    sig = {n: "constexpr" if n in consts else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*"}
    return GluonASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
def test_mla_mma_decode_compiles(target, pool):
    """The MLA kernel's codes go from the cp.async stage into MMA operand registers (every
    conversion a register renaming, ``assert_trivial``); the only shared-memory stores are the
    warps' partial scores (``gl.sum`` over the warp axis), not code tiles."""
    from kvarn_ops.kernels import mla_decode

    nbuf = mla_decode.MMA_NBUF
    k = triton.compile(_mla_mma_source(pool, nbuf), target=target, options=dict(num_warps=4))
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    assert regs <= 255
    assert frame <= MLA_MMA_SPILL[(target.arch, pool)], f"{frame} B of spill frame"
    # per stage the whole record (codes 16 KB, channel scales and zero points 2 KB, row scales,
    # RoPE 8 KB); the score reduction 16 KB; within sm_120's 99 KB
    assert k.metadata.shared == nbuf * 26752 + 16384
    # packed-block loop, per warp: 4 x 2 x 16 score MMAs (the two fp16 parts of q * cs / cmax
    # on exact codes, no offset column) + 2 x 8 RoPE + 4 for the sum of the weights + 4 x 16
    # value MMAs = 212; the exact-pool loop 144
    print(f"mla {pool} sm{target.arch}: {regs} registers, {frame} B spill frame")
    assert ptx.count("mma.sync.aligned.m16n8k16") == 212 + 144
    # codes unpacked two per prmt: 32 words x 8 codes per lane, twice (scores, values)
    assert ptx.count("prmt.b32") >= 256
    # the only shared-memory stores: the partial scores summed over the warps, in each loop
    assert ptx.count("st.shared") <= 2 * 64 + 8
    assert ptx.count("cp.async") >= 3


# --------------------------------------------------------------------------------------------
# the sm_90 MLA decode kernel (mla_decode_wgmma.py): wgmma exists on sm_90a only
# --------------------------------------------------------------------------------------------
def _ptxas_info(ptx: str, arch: str) -> str:
    """ptxas's messages (``-v``) for ``ptx``, with the ptxas Triton ships."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [get_ptxas(int(arch[3:5])).path, f"-arch={arch}", "-v", str(src), "-o",
             str(Path(d) / "k.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return res.stdout + res.stderr


MLA_WGMMA_SPILL = 96
"""Spill frame allowed (bytes; 32 / 24 measured offline for the bf16 / fp8 pool at 4 bits,
16 / 8 at 5 bits, 16 / 72 at 2 bits, mostly values kept from the prologue for the
epilogue; the fp8 2-bit build reloads four values a block). With the shared-memory views
indexed outside the loop the compiler hoisted all 72 wgmma descriptors and spilled 216 B of
them, reloaded every block."""


@pytest.mark.parametrize("bits", [2, 4, 5])
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
def test_mla_wgmma_decode_compiles(pool, bits):
    """Each block's codes are unpacked once (one ``fma.rn.f16x2`` per two codes) into one
    shared-memory tile that both products read with ``wgmma`` (the tile transposed for the
    scores), and the launcher sends only sm_90 devices there."""
    from kvarn_ops.kernels import mla_decode, mla_decode_wgmma

    src = _mla_mma_source(pool, None, bits)
    nw = mla_decode_wgmma.NUM_WARPS
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw))
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    print(f"mla wgmma k{bits} {pool} sm90: {regs} registers, {frame} B spill frame")
    assert regs <= 255 and frame <= MLA_WGMMA_SPILL
    # the fp16 tile [512, 64] (64 KB), the query latent (16 KB), RoPE rows (8 KB), the
    # weights and the query's two RoPE terms; two programs fit an SM
    assert 96 * 1024 <= k.metadata.shared <= 227 * 1024 // 2
    # scores: 32 K steps over the tile (transposed A, two independent chains of 16) + 2 x 4
    # RoPE; values: 8 M tiles x 4 K steps, all m64n16k16 from shared-memory descriptors
    wg = [x for x in ptx.splitlines() if "wgmma.mma_async" in x]
    assert len(wg) == 32 + 8 + 32
    assert all("m64n16k16.f32" in x for x in wg)
    if bits == 4:
        # one unpack per block: 4 chunks x 8 words x 4 code pairs per thread (nibbles k and
        # k + 4, 16 bits apart: a shift but for k = 0, no byte permute)
        assert ptx.count("fma.rn.f16x2") == 128
        assert ptx.count("prmt.b32") == 0
    elif bits == 2:
        # 4 chunks x 4 words x 8 code pairs (16 bits apart in a word): a sub and an fma each
        assert ptx.count("fma.rn.f16x2") == 128
        assert ptx.count("sub.f16x2") == 128
        assert ptx.count("prmt.b32") == 0
    else:
        # 4 chunks x 32 code pairs, two fmas each (the exact codes, then the scaling); of the
        # 16 pairs of a half-row, 12 straddle two words (a funnel shift), none needs a prmt
        assert ptx.count("fma.rn.f16x2") == 256
        assert ptx.count("shf.r.clamp.b32") == 96
        assert ptx.count("prmt.b32") == 0
    # the tile's stores are the same at both widths (vectors of a channel's 64 tokens)
    assert ptx.count("st.shared") <= 406
    # ptxas keeps the wgmmas asynchronous: it serializes every one of them (info C7514) when
    # it cannot prove the accumulators untouched while they run (so it did with the value
    # product split into four commit groups waited on one by one)
    assert "C7514" not in _ptxas_info(ptx, "sm_90a")
    # the launcher: sm_90 only (the Gluon mma.sync kernel elsewhere), not on the CPU
    import torch

    assert not mla_decode._use_wgmma_kernel(4, torch.zeros(1), False)
    supported = [b for b in range(2, 9) if mla_decode_wgmma.mla_wgmma_supported(b)]
    assert supported == [2, 4, 5]


MLA_WGMMA64_SPILL = 128
"""Spill frame allowed for the 64-head kernel (bytes; 24-80 measured offline at 2-5 bits, no
spill inside the block loop)."""


@pytest.mark.parametrize("bits", [2, 4, 5])
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
def test_mla_wgmma64_decode_compiles(pool, bits):
    """The 64-head kernel: eight warps unpack each tile once (half the code pairs per thread of
    the 16-head kernel); scores m64n32k16 per warpgroup (32 heads each), values with the heads
    on the M axis, m64n128k16 (two tile buffers, 128 channels of each per warpgroup);
    asynchronous ``wgmma``s; only sm_90 takes it, and only from ``WGMMA64_MIN_HEADS`` heads."""
    from kvarn_ops.kernels import mla_decode, mla_decode_wgmma64

    src = _mla_mma_source(pool, None, bits, wide=True)
    nw = mla_decode_wgmma64.NUM_WARPS
    assert nw == 8 and mla_decode_wgmma64.HEADS == mla_decode.WIDE_HEADS == 64
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw))
    regs, frame = cubin_resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    print(f"mla wgmma64 k{bits} {pool} sm90: {regs} registers, {frame} B spill frame")
    assert regs <= 255 and frame <= MLA_WGMMA64_SPILL
    # the tile (64 KB), the queries of 64 heads (64 + 16 KB), RoPE rows, the weights: one
    # program per SM
    assert 160 * 1024 <= k.metadata.shared <= 227 * 1024
    wg = [x.split()[0] for x in ptx.splitlines() if "wgmma.mma_async" in x]
    assert wg.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16") == 32
    assert wg.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 8
    # values: two [64, 256] accumulators (one per tile buffer), 128 channels a warpgroup each
    assert wg.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16") == 8
    assert len(wg) == 48
    # one unpack per block over 256 threads: 2 chunks x 8 words x 4 pairs (4-bit), 2 x 4 x 8
    # (2-bit), 2 x 32 pairs x 2 fmas (5-bit)
    assert ptx.count("fma.rn.f16x2") == (128 if bits == 5 else 64)
    assert "C7514" not in _ptxas_info(ptx, "sm_90a")
    import torch

    q = torch.zeros(1, 128, 576)
    assert not mla_decode._use_wgmma64_kernel(4, q, False)
    assert [b for b in range(2, 9) if mla_decode_wgmma64.mla_wgmma64_supported(b)] == [2, 4, 5]
