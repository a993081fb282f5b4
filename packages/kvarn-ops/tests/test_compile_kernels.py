"""Offline compilation of the rotate, store, flush and materialize kernels for sm_90a and
sm_120a (no GPU needed). Catches what the interpreter cannot: tl.dot shape and precision
limits, layout conversions, fp8 conversions, register spills on the big tiles.

Compiling is slow on a 2-core machine (flush about 60-120 s per specialization, materialize
about 20 s), so by default one specialization per kernel and architecture is compiled: the
benchmark geometry (kvarn_k4v2_g64, D = 128, bf16), plus the fp8 and D = 512 paths for rotate
and store, which compile in seconds, and flush with unbiased_clip rounding for K and V (its
candidate loop is the largest code in the kernel). ``KVARN_COMPILE_ALL=1`` compiles every case
below.

The kernel modules are re-executed here with the interpreter off (their custom-op
registrations are cut, the interpreted import already made them), so the kernels are
JITFunctions even when the interpreter tests run in the same process.
"""

from __future__ import annotations

import os
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

import kvarn_formats as kf
import kvarn_ops

_KERNELS = Path(kvarn_ops.__file__).parent / "kernels"
TARGETS = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 120, 32)]
POOL = {"float16": "*fp16", "bfloat16": "*bf16", "float8_e4m3fn": "*fp8e4nv"}
FLOAT = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}


def _exec_source(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    src = path.read_text().split("@torch.library.custom_op")[0]
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


def _load_offline():
    old_env = os.environ.get("TRITON_INTERPRET")
    old_common = sys.modules.get("kvarn_ops.kernels._common")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        common = _exec_source("_kvarn_common_offline", _KERNELS / "_common.py")
        sys.modules["kvarn_ops.kernels._common"] = common
        return {
            name: _exec_source(f"_kvarn_{name}_offline", _KERNELS / f"{name}.py")
            for name in ("rotate", "store", "flush", "materialize")
        }
    finally:
        if old_common is not None:
            sys.modules["kvarn_ops.kernels._common"] = old_common
        else:
            sys.modules.pop("kvarn_ops.kernels._common", None)
        if old_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old_env


M = _load_offline()
ALL = os.environ.get("KVARN_COMPILE_ALL") == "1"


def _cases(cases: list, default: int) -> list:
    """Every case with KVARN_COMPILE_ALL=1, else the first ``default`` of them."""
    return cases if ALL else cases[:default]


def _compile(fn, types_by_name: dict, consts: dict, target, num_warps: int):
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else types_by_name[name]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=target, options=dict(num_warps=num_warps))
    assert "ptx" in k.asm
    spills = getattr(k, "n_spills", 0) or 0
    return k, spills


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize(
    ("d", "x", "out"),
    _cases(
        [
            (128, "bfloat16", "bfloat16"),
            (512, "float32", "float16"),
            (64, "float16", "float32"),
            (128, "float32", "bfloat16"),
            (256, "bfloat16", "bfloat16"),
        ],
        2,
    ),
)
def test_rotate_compiles(d, x, out, target):
    mod = M["rotate"]
    consts = dict(D=d, BLOCK_M=mod.rows_per_program(d), EXACT_TF32=x != "float32")
    _, spills = _compile(
        mod._rotate_kernel,
        {"x_ptr": FLOAT[x], "out_ptr": FLOAT[out], "rows": "i32"},
        consts,
        target,
        4,
    )
    assert spills == 0


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize(
    ("d", "src", "pool"),
    _cases(
        [
            (128, "bfloat16", "bfloat16"),
            (128, "float16", "float8_e4m3fn"),
            (512, "bfloat16", "bfloat16"),
            (64, "float32", "float16"),
            (256, "bfloat16", "float8_e4m3fn"),
        ],
        3,
    ),
)
def test_store_compiles(d, src, pool, target):
    mod = M["store"]
    fp8 = pool == "float8_e4m3fn"
    scale = "*fp32" if fp8 else POOL[pool]
    consts = dict(
        H=8,
        D=d,
        BLOCK_T=mod.tokens_per_program(d, fp8),
        EXACT_K=src != "float32",
        EXACT_V=src != "float32",
        FP8=fp8,
        NATIVE_K=mod.native_dot(getattr(torch, src), d, interpret=False),
        NATIVE_V=mod.native_dot(getattr(torch, src), d, interpret=False),
    )
    types_ = {
        "k_ptr": FLOAT[src],
        "v_ptr": FLOAT[src],
        "slots_ptr": "*i64",
        "exact_k_ptr": POOL[pool],
        "exact_v_ptr": POOL[pool],
        "k_scale_ptr": scale,
        "v_scale_ptr": scale,
        "T": "i32",
        "num_slots": "i64",
    }
    _, spills = _compile(mod._store_kernel, types_, consts, target, mod.warps_per_program(d))
    assert spills == 0


FLUSH_CASES = [
    # (format, D, pool dtype, K rounding, V rounding); rounding ids of flush.ROUNDING_IDS
    ("kvarn_k4v2_g64", 128, "bfloat16", "rtn", "rtn"),  # the benchmark target
    ("kvarn_k4v2_g64", 128, "bfloat16", "unbiased_clip", "unbiased_clip"),
    ("kvarn_k4v4_g128", 128, "float8_e4m3fn", "rtn", "rtn"),
    ("kvarn_k3v5_g64", 64, "float16", "rtn", "unbiased_clip"),
    ("kvarn_k7v6_g32", 256, "bfloat16", "unbiased_clip", "unbiased_clip"),
]


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize(
    "case", _cases(FLUSH_CASES, 2), ids=lambda c: f"{c[0]}-d{c[1]}-{c[2]}-{c[3]}-{c[4]}"
)
def test_flush_compiles(case, target):
    fmt, d, pool, k_rounding, v_rounding = case
    mod = M["flush"]
    lay = kf.dense_layout(fmt, d)
    fp8 = pool == "float8_e4m3fn"
    scale = "*fp32" if fp8 else POOL[pool]
    consts = dict(
        G=lay.block_size,
        H=8,
        D=d,
        FP8=fp8,
        ITERS=8,
        STD_FLOOR=1e-3,
        K_ROUNDING=mod.ROUNDING_IDS[k_rounding],
        V_ROUNDING=mod.ROUNDING_IDS[v_rounding],
        **mod.record_constants(lay),
    )
    types_ = {
        "exact_k_ptr": POOL[pool],
        "exact_v_ptr": POOL[pool],
        "k_scale_ptr": scale,
        "v_scale_ptr": scale,
        "src_ptr": "*i32",
        "dst_ptr": "*i32",
        "packed_ptr": "*u8",
        "num_pool_blocks": "i32",
        "num_blocks": "i32",
    }
    k, _ = _compile(mod._flush_kernel, types_, consts, target, mod.warps_for(d, lay.block_size))
    regs, frame = _cubin_resources(k.asm["cubin"])
    print(
        f"flush {case} sm{target.arch}: {regs} registers, {frame} B stack frame (spills), "
        f"{k.metadata.shared} B shared memory"
    )
    assert 0 < regs <= 255


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack frame bytes) of the kernel in a cubin, read from its ``.nv.info``
    attributes (EIATTR_REGCOUNT 0x2f, EIATTR_FRAME_SIZE 0x11): offline, the compiled kernel's
    ``n_regs``/``n_spills`` exist only once loaded on a GPU. A nonzero frame here is spill space
    (these kernels have no local arrays or calls)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)
    ]
    names = headers[shstrndx][4]
    found = {}
    for h in headers:
        name = cubin[names + h[0] : cubin.index(b"\0", names + h[0])]
        if name != b".nv.info":
            continue
        data = cubin[h[4] : h[4] + h[5]]
        pos = 0
        while pos + 4 <= len(data):
            fmt, attr, size = struct.unpack_from("<BBH", data, pos)
            if fmt != 0x04:  # attributes without a payload
                pos += 4
                continue
            if attr in (0x2F, 0x11) and size == 8:
                found[attr] = struct.unpack_from("<II", data, pos + 4)[1]
            pos += 4 + size
    return found.get(0x2F, 0), found.get(0x11, 0)


MATERIALIZE_CASES = [
    ("kvarn_k4v2_g64", 128, "bfloat16", "bfloat16"),
    ("kvarn_k4v4_g128", 128, "float8_e4m3fn", "bfloat16"),
    ("kvarn_k5v3_g32", 64, "float16", "float16"),
    ("kvarn_k4v2_g64", 256, "bfloat16", "bfloat16"),
    ("kvarn_k2v6_g64", 512, "float16", "float16"),
]


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize(
    "case", _cases(MATERIALIZE_CASES, 1), ids=lambda c: f"{c[0]}-d{c[1]}-{c[2]}"
)
def test_materialize_compiles(case, target):
    fmt, d, pool, out = case
    mod = M["materialize"]
    lay = kf.dense_layout(fmt, d)
    fp8 = pool == "float8_e4m3fn"
    scale = "*fp32" if fp8 else POOL[pool]
    consts = dict(
        G=lay.block_size,
        H=8,
        D=d,
        BT=mod.tokens_per_chunk(d, lay.block_size),
        FP8=fp8,
        **mod.record_offsets(lay),
    )
    types_ = {
        "packed_ptr": "*u8",
        "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "exact_k_ptr": POOL[pool],
        "exact_v_ptr": POOL[pool],
        "k_scale_ptr": scale,
        "v_scale_ptr": scale,
        "tail_ptr": "*i32",
        "cu_ptr": "*i32",
        "k_out_ptr": FLOAT[out],
        "v_out_ptr": FLOAT[out],
        "num_blocks": "i32",
        "num_pool_blocks": "i32",
        "total_rows": "i32",
        "max_blocks": "i32",
        "cols": "i32",
    }
    _compile(mod._materialize_kernel, types_, consts, target, 4)
