"""Offline compilation of every MLA kernel for sm_90a and sm_120a (no GPU needed): catches what
the interpreter cannot (tl.dot shape limits, layout conversions, fp8 conversions).

The kernels are compiled in a subprocess with ``TRITON_INTERPRET=0``: the interpreter tests in
the same pytest process import the modules with the interpreter on, which turns every
``@triton.jit`` (and the shared helpers they call) into interpreted functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two arch sweeps of ~1 min each: the package session only

TARGETS = [90, 120]
SHARED_LIMIT = {90: 232448, 120: 101376}
"""Largest dynamic shared memory per block (bytes): 227 KiB on sm_90, 99 KiB on sm_120."""


def _compile_all(arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    import kvarn_formats as kf
    from kvarn_ops.kernels import mla_decode, mla_gather, mla_pack, mla_pack_split, mla_scatter
    from kvarn_ops.kernels._common import pack_geometry
    from kvarn_ops.kernels.mla_common import field_offsets

    target = GPUTarget("cuda", arch, 32)
    results = {}

    def build(name, fn, sig, consts, **opts):
        full = {k: ("constexpr" if k in consts else sig[k]) for k in fn.arg_names}
        # Pointers 16-byte aligned, as a launch with torch tensors specializes them: without
        # this the compiler picks other layouts (the pack kernel's shared memory differed 4x).
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, a in enumerate(fn.arg_names)
            if a not in consts and full[a].startswith("*")
        }
        src = triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=target, options=dict(opts))
        ptx = k.asm.get("ptx", "")
        results[name] = {
            "ptx": bool(ptx),
            "cubin": "cubin" in k.asm,
            "shared": int(k.metadata.shared),
            # the split pack's synchronization (counted for every kernel, asserted for it)
            "release_add": ptx.count("atom.global.gpu.release.add"),
            "acquire_load": ptx.count("ld.acquire.gpu.global"),
            "acq_rel_add": ptx.count("atom.global.gpu.acq_rel.add"),
            # fp8 rounding: NaN-keeping max (the amax) and no NaN-dropping one
            "max_nan": ptx.count("max.NaN.f32"),
            "max_plain": ptx.count("max.f32"),
        }

    def fmt(bits):
        offs = field_offsets(kf.mla_layout(f"kvarn_mla_k{bits}_g64"))
        lg, nb, nbp = pack_geometry(bits)
        return offs, {"L": lg, "NB": nb, "NBP": nbp}

    pools = {"bf16": ("*bf16", "*bf16", False), "fp8": ("*fp8e4nv", "*fp32", True)}
    # One representative specialization per kernel and pool dtype (a full sweep of code widths
    # takes minutes on 2 cores); code width only changes constants in the unpack arithmetic.
    for pname, (pt, st, fp8) in pools.items():
        for ldt in ("*fp32",):
            build(
                f"scatter-{pname}-{ldt}",
                mla_scatter._mla_scatter_kernel,
                {
                    "lat_ptr": ldt,
                    "rope_ptr": ldt,
                    "slots_ptr": "*i64",
                    "pool_ptr": pt,
                    "pscale_ptr": st,
                    "prope_ptr": "*i16",
                    "T": "i32",
                    "num_slots": "i64",
                },
                {"BLOCK_T": 16, "EXACT_TF32": ldt != "*fp32", "FP8": fp8},
                num_warps=4,
            )
        for bits in (4,) if pname == "bf16" else (5,):
            offs, geo = fmt(bits)
            common = {
                "pool_ptr": pt,
                "pscale_ptr": st,
                "prope_ptr": "*i16",
                "rec_ptr": "*u8",
                "rec16_ptr": "*i16",
            }
            build(
                f"pack-k{bits}-{pname}",
                mla_pack._mla_pack_kernel,
                {**common, "src_ptr": "*i32", "dst_ptr": "*i32"},
                {"ITERS": 8, "STD_FLOOR": 1e-3, "FP8": fp8, **offs, **geo},
                num_warps=16,
            )
            build(
                f"rehydrate-k{bits}-{pname}",
                mla_pack._mla_rehydrate_kernel,
                {**common, "src_ptr": "*i32", "dst_ptr": "*i32"},
                {"BLOCK_T": 16, "FP8": fp8, **offs, **geo},
                num_warps=4,
            )
            for stage in (False,) if pname == "bf16" else (True,):
                build(
                    f"gather-stage{int(stage)}-k{bits}-{pname}",
                    mla_gather._mla_gather_kernel,
                    {
                        **common,
                        "slots_ptr": "*i64",
                        "N": "i32",
                        "num_slots": "i64",
                        "map_ptr": "*i32",
                        "out_ptr": "*u8" if stage else "*bf16",
                        "out8_ptr": "*fp8e4nv" if stage else "*bf16",
                        "out32_ptr": "*fp32" if stage else "*bf16",
                        "out16_ptr": "*i16",
                    },
                    {"STAGE": stage, "BLOCK_T": 16, "FP8": fp8, **offs},
                    num_warps=4,
                )
            # the full-context path at both widths kinds (word unpack k4, window unpack k5)
            for sparse, warps in (
                ((False, mla_decode.NUM_WARPS), (False, mla_decode.NUM_WARPS_MANY))
                if pname == "bf16"
                else ((False, mla_decode.NUM_WARPS), (True, mla_decode.NUM_WARPS))
            ):
                build(
                    f"decode-sparse{int(sparse)}-w{warps}-k{bits}-{pname}",
                    mla_decode._mla_decode_kernel,
                    {
                        **common,
                        "rec32_ptr": "*i32",
                        "q_ptr": "*bf16",
                        "qrot_ptr": "*fp32",
                        "map_ptr": "*i32",
                        "bt_ptr": "*i32",
                        "seq_ptr": "*i32",
                        "idx_ptr": "*i32",
                        "po_ptr": "*fp32",
                        "plse_ptr": "*fp32",
                        "H": "i32",
                        "S": "i32",
                        "bt_stride": "i32",
                        "idx_stride": "i32",
                        "max_blocks": "i32",
                        "sm_scale": "fp32",
                    },
                    {
                        "SPARSE": sparse,
                        "BLOCK_H": mla_decode.BLOCK_H,
                        "BLOCK_N": mla_decode.BLOCK_N,
                        "MIN_BLOCKS": mla_decode.MIN_BLOCKS_PER_SPLIT,
                        "FP8": fp8,
                        "ASM": True,
                        "NC": 512 // mla_decode.CHUNK,
                        **offs,
                    },
                    num_warps=warps,
                    maxnreg=mla_decode.MAXNREG,
                )
    # The widest codes (the pack kernel's byte loop is longest), bf16 pool.
    pack_types = {
        "pool_ptr": "*bf16",
        "pscale_ptr": "*bf16",
        "prope_ptr": "*i16",
        "rec_ptr": "*u8",
        "rec16_ptr": "*i16",
        "src_ptr": "*i32",
        "dst_ptr": "*i32",
    }
    offs, geo = fmt(8)
    build(
        "pack-k8-bf16",
        mla_pack._mla_pack_kernel,
        pack_types,
        {"ITERS": 8, "STD_FLOOR": 1e-3, "FP8": False, **offs, **geo},
        num_warps=16,
    )
    # A decode step's pack: each tile over 16 programs (the launcher's largest split).
    offs, geo = fmt(4)
    build(
        "pack-split-k4-bf16",
        mla_pack_split._mla_pack_split_kernel,
        {**pack_types, "scratch_ptr": "*fp32", "counter_ptr": "*i32"},
        {
            "ITERS": 8,
            "STD_FLOOR": 1e-3,
            "FP8": False,
            "PARTS": 16,
            "EMU": False,
            "SCRATCH": mla_pack_split.scratch_stride(16, 8),
            **offs,
        },
        num_warps=4,
    )
    build(
        "remap",
        mla_gather._mla_remap_kernel,
        {
            "idx_ptr": "*i32",
            "req_ptr": "*i32",
            "bt_ptr": "*i32",
            "out_ptr": "*i64",
            "K": "i32",
            "bt_stride": "i32",
            "max_blocks": "i32",
        },
        {"BLOCK_K": 128},
        num_warps=4,
    )
    build(
        "qrot",
        mla_decode._mla_qrot_kernel,
        {"q_ptr": "*bf16", "qrot_ptr": "*fp32", "BH": "i32"},
        {"BLOCK_H": 16},
        num_warps=4,
    )
    for odt, rows in (("*bf16", 16), ("*bf16", 1)):
        build(
            f"combine-{odt}-r{rows}",
            mla_decode._mla_combine_kernel,
            {
                "po_ptr": "*fp32",
                "plse_ptr": "*fp32",
                "out_ptr": odt,
                "BH": "i32",
                "S": "i32",
                "NS": "i32",
            },
            {"BLOCK_H": rows},
            num_warps=4,
        )
    return results


@pytest.mark.parametrize("arch", TARGETS, ids=lambda a: f"sm{a}")
def test_every_mla_kernel_compiles(arch):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, __file__, str(arch)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 18
    assert all(r["ptx"] for r in results.values()), results
    over = {n: r["shared"] for n, r in results.items() if r["shared"] > SHARED_LIMIT[arch]}
    assert not over, f"shared memory over the sm_{arch} limit {SHARED_LIMIT[arch]}: {over}"
    # The split pack: three exchange sites (steps 1-2, iterate 0, the iteration loop's body),
    # each one thread's release increment and an acquire polling loop (a load before and in
    # the loop); then the final acquire-release count.
    # fp8 pools and staging: a token holding NaN keeps the reference's scale (amax NaN, scale
    # 1.0) and its NaN (no max that drops NaN): the stored token stays non-finite
    for name in ("scatter-fp8-*fp32", "gather-stage1-k5-fp8"):
        assert results[name]["max_nan"] > 0 and results[name]["max_plain"] == 0, results[name]
    split = results["pack-split-k4-bf16"]
    assert (split["release_add"], split["acquire_load"], split["acq_rel_add"]) == (3, 6, 1), split


if __name__ == "__main__":
    print(json.dumps(_compile_all(int(sys.argv[1]))))
