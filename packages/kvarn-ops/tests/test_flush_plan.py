"""The planned flush (``kernels/flush_plan.py``): plan, then finish, against the single pass.

Under the interpreter the plan is the Triton twin (``flush_plan._plan_kernel``): the same
functions in the same order as the single pass, so the records must be identical byte for
byte, in every rounding mode, pool type and geometry, with special tiles and with the sink
launch split (the unmarked blocks planned, the marked ones single pass). That the finish
really reads the plan is checked by corrupting it. The Gluon plan (``flush_rows.py``) is
compiled for sm_90a and sm_120a here and checked against the reference on a GPU
(``gpu/test_dense_parity.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from conftest import realistic_kv  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from kvarn_ops.kernels import flush  # noqa: E402
from test_flush import POISON, _fill_pool  # noqa: E402

FLUSH_MOD = importlib.import_module("kvarn_ops.kernels.flush")
PLAN_MOD = importlib.import_module("kvarn_ops.kernels.flush_plan")
FP8 = torch.float8_e4m3fn

CONFIGS = {
    "default": ref.DEFAULT_CONFIG,
    "window": ref.NormalizeConfig(rounding="unbiased_clip"),
    "mixed": ref.NormalizeConfig(rounding="rtn", rounding_v="unbiased_clip"),
    "rtn": ref.NormalizeConfig(rounding="rtn"),
}

CASES = [
    # (config, format, D, pool dtype, Hkv, N blocks flushed, P pool blocks, packed blocks)
    ("default", "kvarn_k4v2_g64", 128, torch.bfloat16, 2, 2, 3, 4),
    ("default", "kvarn_k2v2_g64", 128, FP8, 1, 2, 2, 3),
    ("default", "kvarn_k4v4_g64", 64, torch.float16, 2, 1, 2, 2),
    ("window", "kvarn_k2v4_g64", 128, torch.bfloat16, 1, 2, 3, 3),
    ("mixed", "kvarn_k3v5_g32", 64, FP8, 2, 2, 2, 3),
    ("rtn", "kvarn_k8v2_g32", 128, torch.float16, 1, 2, 2, 3),
]


@pytest.fixture
def force():
    def set_(plan=None, split=None):
        PLAN_MOD.FORCE_PLAN = plan
        FLUSH_MOD.FORCE_SINK_SPLIT = split

    yield set_
    PLAN_MOD.FORCE_PLAN = None
    FLUSH_MOD.FORCE_SINK_SPLIT = None
    FLUSH_MOD.FORCE_PARTS = None


def _both(force, args, lay, config, sink_rows=None, split=None):
    """Records of the planned and of the single-pass flush of the same blocks."""
    out = []
    for plan in ("triton", "off"):
        force(plan, split)
        packed = torch.full_like(args[-1], POISON)
        flush(*args[:-1], packed, lay, sink_rows, config=config)
        out.append(packed)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{str(c[3])[6:]}")
def test_planned_flush_equals_single_pass(case, gen, force):
    name, fmt, d, pdt, hkv, n, p, nb = case
    lay = kf.dense_layout(fmt, d)
    ek, ev, ks, vs = _fill_pool(gen, p, lay.block_size, hkv, d, pdt)
    src = torch.randperm(p, generator=gen)[:n].to(torch.int32)
    dst = torch.randperm(nb, generator=gen)[:n].to(torch.int32)
    packed = torch.empty(nb, hkv, lay.record_bytes, dtype=torch.uint8)
    planned, single = _both(force, (ek, ev, ks, vs, src, dst, packed), lay, CONFIGS[name])
    written = torch.zeros(nb, dtype=torch.bool)
    written[dst.long()] = True
    assert bool((planned[~written] == POISON).all()), "a record outside dst_blocks was written"
    assert bool((planned[written] != POISON).any())
    assert torch.equal(planned, single)


@pytest.mark.parametrize("cap", [4, 8, 10**6])
def test_planned_flush_in_chunks(gen, force, monkeypatch, cap):
    """A bulk flush of more tiles than ``PLAN_TILES_MAX`` runs in chunks (here of 1, 2 and all
    5 blocks at 2 KV heads): every record as the single pass writes it, with the sink launch
    split."""
    monkeypatch.setattr(FLUSH_MOD, "PLAN_TILES_MAX", cap)
    lay = kf.dense_layout("kvarn_k4v2_g64", 64)
    ek, ev, ks, vs = _fill_pool(gen, 6, 64, 2, 64, torch.bfloat16)
    src = torch.tensor([5, 0, 3, 1, 4], dtype=torch.int32)
    dst = torch.tensor([1, 6, 0, 2, 4], dtype=torch.int32)
    sink = torch.tensor([-1, 0, -1, -1, -1], dtype=torch.int32)
    packed = torch.empty(7, 2, lay.record_bytes, dtype=torch.uint8)
    args = (ek, ev, ks, vs, src, dst, packed)
    planned, single = _both(force, args, lay, ref.DEFAULT_CONFIG)
    assert torch.equal(planned, single)
    planned, single = _both(force, args, lay, ref.DEFAULT_CONFIG, sink, split=True)
    assert torch.equal(planned, single)


def test_planned_flush_special_tiles(gen, force):
    """Zero, constant, outlier, non-finite and 24-decade tiles: the single pass's bytes."""
    lay = kf.dense_layout("kvarn_k2v2_g64", 128)
    x = realistic_kv(gen, 1, 64, 4, 128)
    x[..., 0, :] = 0.0
    x[0, :, 1, 5] = 3.0
    x[0, 3, 2, 9] = 1.0e4
    x[0, 11, 3, 2] = float("nan")
    x[0, 20, 3, 7] = float("inf")
    x[..., 3, :] *= torch.logspace(-12, 12, 128)
    ek, ev = x.to(torch.float16), x.flip(1).to(torch.float16)
    src = torch.zeros(1, dtype=torch.int32)
    packed = torch.empty(1, 4, lay.record_bytes, dtype=torch.uint8)
    planned, single = _both(force, (ek, ev, None, None, src, src, packed), lay, ref.DEFAULT_CONFIG)
    assert torch.equal(planned, single)


def test_planned_flush_with_sink_rows_split(gen, force):
    """Sink rows with the launch split: the unmarked blocks planned, the marked ones through
    the single pass's sink steps; every record as the single pass writes it."""
    lay = kf.dense_layout("kvarn_k2v2_g64", 128)
    ek, ev, ks, vs = _fill_pool(gen, 4, 64, 2, 128, torch.bfloat16)
    src = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    dst = torch.tensor([1, 3, 0, 2], dtype=torch.int32)
    sink = torch.tensor([-1, 0, -1, -1], dtype=torch.int32)
    packed = torch.empty(4, 2, lay.record_bytes, dtype=torch.uint8)
    args = (ek, ev, ks, vs, src, dst, packed)
    planned, single = _both(force, args, lay, ref.DEFAULT_CONFIG, sink, split=True)
    assert torch.equal(planned, single)
    # and the split itself is the unsplit single pass's result
    force("off", False)
    whole = torch.full_like(packed, POISON)
    flush(ek, ev, ks, vs, src, dst, whole, lay, sink, config=ref.DEFAULT_CONFIG)
    assert torch.equal(planned, whole)


def test_finish_reads_the_plan(gen, force, monkeypatch):
    """A plan whose K rows' clipping ranges are zeroed changes the K codes and nothing of V:
    the finish rounds on the planned ranges."""
    lay = kf.dense_layout("kvarn_k4v2_g64", 128)
    ek, ev, ks, vs = _fill_pool(gen, 1, 64, 1, 128, torch.bfloat16)
    src = torch.zeros(1, dtype=torch.int32)
    packed = torch.empty(1, 1, lay.record_bytes, dtype=torch.uint8)
    base, _ = _both(force, (ek, ev, ks, vs, src, src, packed), lay, ref.DEFAULT_CONFIG)
    real = PLAN_MOD.launch_plan
    stride = PLAN_MOD.plan_stride(64, 128)

    def minmax_plan(*args, **kw):
        real(*args, **kw)
        plan = args[7].view(-1, stride)
        r, c = 128, 64  # the K tile: its rows' (z, s) become min/max
        plan[0, r + c : 3 * r + c] = 0.0  # z = 0, s = -0: every code 0

    monkeypatch.setattr(FLUSH_MOD, "launch_plan", minmax_plan)
    force("triton")
    got = torch.full_like(packed, POISON)
    flush(ek, ev, ks, vs, src, src, got, lay, config=ref.DEFAULT_CONFIG)
    codes = lay.field("k_codes")
    assert not torch.equal(
        got[0, 0, codes.offset : codes.end], base[0, 0, codes.offset : codes.end]
    )
    vc = lay.field("v_codes")
    assert torch.equal(got[0, 0, vc.offset : vc.end], base[0, 0, vc.offset : vc.end])


def test_plan_engine_choice(force):
    x = torch.zeros(1, 64, 1, 128)
    assert PLAN_MOD.plan_engine(x, 64, 128) is None  # a CPU tensor: the single pass
    force("triton")
    assert PLAN_MOD.plan_engine(x, 64, 128) == "triton"
    force("off")
    assert PLAN_MOD.plan_engine(x, 64, 128) is None
    force("fused")
    assert PLAN_MOD.plan_engine(x, 64, 128) == "fused"


@pytest.mark.parametrize(
    ("fmt", "dim", "want"),
    [
        ("kvarn_k4v2_g64", 128, True),
        ("kvarn_k2v2_g64", 64, True),
        ("kvarn_k4v4_g128", 256, True),
        ("kvarn_k8v8_g64", 128, True),
        ("kvarn_k5v5_g64", 128, False),  # 5-bit codes cross 32-bit words
        ("kvarn_k3v6_g64", 128, False),
        ("kvarn_k4v5_g64", 128, False),
    ],
)
def test_onepass_supported(fmt, dim, want):
    consts = FLUSH_MOD.record_constants(kf.dense_layout(fmt, dim))
    assert PLAN_MOD.onepass_supported(consts) is want


def test_plan_engine_rejects_an_unknown_engine(gen):
    ek, ev, ks, vs = _fill_pool(gen, 1, 64, 1, 128, torch.bfloat16)
    src = torch.zeros(1, dtype=torch.int32)
    plan = torch.empty(2 * PLAN_MOD.plan_stride(64, 128))
    with pytest.raises(ValueError, match="engine"):
        PLAN_MOD.launch_plan(
            "cuda",
            ek,
            ev,
            ek,
            ev,
            src,
            src,
            plan,
            k_bits=4,
            v_bits=2,
            k_round=2,
            v_round=2,
            pattern_id=2,
            iters=2,
            std_floor=1e-3,
            marked=0,
        )


class _Recorder:
    """Stands in for a Gluon kernel: ``k[grid](*args, **kwargs)`` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize(
    ("fmt", "config", "marked"),
    [
        ("kvarn_k4v2_g64", ref.DEFAULT_CONFIG, False),
        (
            "kvarn_k2v4_g64",
            ref.NormalizeConfig(rounding="rtn", rounding_v="unbiased_clip", sink_token=True),
            True,
        ),
    ],
)
def test_onepass_launches_name_each_field(gen, force, monkeypatch, fmt, config, marked):
    """The one pass's launcher (Gluon does not run here, so its kernel is replaced by a
    recorder): one launch per tile kind over ``(N, Hkv)``, each with the tile's shape, code
    width, rounding and the offsets of its record fields as the format names them (K: rows
    are channels, so the row side is ``k_col_scale`` / ``k_zero_point`` and the column side
    ``k_row_scale``; V: rows are tokens), the unmarked blocks only where sink rows split the
    launch, and nothing else launched for those blocks."""
    lay = kf.dense_layout(fmt, 64)
    n, hkv = 3, 2
    ek, ev, ks, vs = _fill_pool(gen, 4, lay.block_size, hkv, 64, torch.bfloat16)
    one = types.SimpleNamespace(flush_kernel=_Recorder())
    rows = importlib.import_module("kvarn_ops.kernels.flush_rows")
    real = PLAN_MOD.gluon_modules

    def fake(*names):
        return (one, rows) if names == ("flush_onepass", "flush_rows") else real(*names)

    monkeypatch.setattr(PLAN_MOD, "gluon_modules", fake)
    force("fused", True if marked else None)
    src = torch.tensor([2, 0, 3], dtype=torch.int32)
    dst = torch.tensor([1, 4, 2], dtype=torch.int32)
    packed = torch.full((5, hkv, lay.record_bytes), POISON, dtype=torch.uint8)
    sink = torch.tensor([0, -1, -1], dtype=torch.int32) if marked else None
    flush(ek, ev, ks, vs, src, dst, packed, lay, config=config, sink_rows=sink)
    launches = one.flush_kernel.launches
    assert [grid for grid, _, _ in launches] == [(n, hkv), (n, hkv)]
    k_round, v_round = FLUSH_MOD.check_config(config)
    g, d = lay.block_size, 64
    for (_, args, kw), side, (r, c), rnd in zip(
        launches, "kv", ((d, g), (g, d)), (k_round, v_round), strict=True
    ):
        pool, scale, s_, d_, sink_arg, out = args[:6]
        assert pool is (ek if side == "k" else ev) and out is packed
        assert torch.equal(s_, src) and torch.equal(d_, dst)
        assert (kw["R"], kw["C"], kw["TOKENS_ON_ROWS"]) == (r, c, side == "v")
        assert kw["BITS"] == lay.field(f"{side}_codes").bits
        assert kw["SEARCH"] == (rnd != "rtn") and kw["MARKED"] == (1 if marked else 0)
        if marked:
            assert torch.equal(sink_arg, sink)
        row_side = ("col_scale", "zero_point") if side == "k" else ("row_scale", "zero_point")
        col_side = "row_scale" if side == "k" else "col_scale"
        assert kw["CODES_OFF"] == lay.field(f"{side}_codes").offset
        assert kw["ROW_SCALE_OFF"] == lay.field(f"{side}_{row_side[0]}").offset
        assert kw["ROW_ZP_OFF"] == lay.field(f"{side}_{row_side[1]}").offset
        assert kw["COL_SCALE_OFF"] == lay.field(f"{side}_{col_side}").offset
        assert kw["RECORD_BYTES"] == lay.record_bytes
    # the fused launches write nothing here; only a marked block's single pass may
    written = (packed != POISON).flatten(1).any(1)
    assert written.tolist() == [False, marked, False, False, False]


def test_gluon_plan_launches_each_tile_kind(gen, monkeypatch):
    """The two passes' Gluon plan launcher (its kernel replaced by a recorder): a K launch
    (``[D, G]`` tiles) and a V launch (``[G, D]``), each with its code width and search."""
    rows = importlib.import_module("kvarn_ops.kernels.flush_rows")
    fake = types.SimpleNamespace(plan_consts=rows.plan_consts, plan_kernel=_Recorder())
    monkeypatch.setattr(PLAN_MOD, "gluon_modules", lambda *names: (fake,))
    ek, ev, ks, vs = _fill_pool(gen, 2, 64, 2, 128, torch.bfloat16)
    src = torch.tensor([1, 0], dtype=torch.int32)
    plan = torch.empty(2 * 2 * 2 * PLAN_MOD.plan_stride(64, 128))
    PLAN_MOD.launch_plan(
        "gluon", ek, ev, ek, ev, src, src, plan, k_bits=4, v_bits=2, k_round=0, v_round=2,
        pattern_id=2, iters=2, std_floor=1e-3, marked=0,
    )  # fmt: skip
    keys = ("R", "C", "WHICH", "LEVELS", "SEARCH")
    launches = fake.plan_kernel.launches
    got = [
        (grid, args[0] is pool, {k: kw[k] for k in keys})
        for (grid, args, kw), pool in zip(launches, (ek, ev), strict=True)
    ]
    assert got == [
        ((2, 2), True, dict(R=128, C=64, WHICH=0, LEVELS=15, SEARCH=False)),
        ((2, 2), True, dict(R=64, C=128, WHICH=1, LEVELS=3, SEARCH=True)),
    ]


# ---------------------------------------------------------------- the Gluon plan, offline


def _rows():
    mod = importlib.import_module("kvarn_ops.kernels._common").gluon_modules("flush_rows")
    assert mod is not None, "this Triton has no Gluon: the GPU plan cannot be built"
    return mod[0]


@pytest.mark.parametrize(
    ("shape", "warps", "want"),
    [
        ((128, 64), None, (1, 2, 4)),  # K tile, d128 g64: a row per thread
        ((64, 128), None, (2, 1, 4)),  # V tile
        ((64, 64), None, (1, 1, 2)),
        ((256, 64), None, (1, 4, 8)),
        ((64, 256), None, (4, 1, 8)),
        ((128, 128), None, (2, 2, 8)),
        ((64, 32), None, (1, 2, 2)),
        ((32, 64), None, None),  # one warp cannot hold a column per thread
        ((32, 512), None, None),
        ((128, 64), 8, (2, 4, 8)),
        ((64, 128), 8, (4, 2, 8)),
        ((64, 128), 3, None),
        ((64, 128), 32, None),
        ((64, 128), 1, None),
    ],
)
def test_plan_geometry(shape, warps, want):
    assert _rows().geometry(*shape, warps) == want


def test_plan_warps_knob(monkeypatch):
    monkeypatch.delenv("KVARN_FLUSH_PLAN_WARPS", raising=False)
    assert PLAN_MOD.plan_warps() is None
    monkeypatch.setenv("KVARN_FLUSH_PLAN_WARPS", "8")
    assert PLAN_MOD.plan_warps() == 8
    for bad in ("3", "0", "eight", "-4"):
        monkeypatch.setenv("KVARN_FLUSH_PLAN_WARPS", bad)
        with pytest.raises(ValueError, match="KVARN_FLUSH_PLAN_WARPS"):
            PLAN_MOD.plan_warps()


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from cubin_info import cubin_resources
from kvarn_ops.kernels import flush_plan, flush_rows as rows

res = []
for arch, r, c, which, bits, pattern, fp8, warps in json.loads(sys.argv[1]):
    k = rows.plan_kernel
    g, d = (r, c) if which == 1 else (c, r)
    consts = dict(
        G=g, H=8, D=d, R=r, C=c, TOKENS_ON_ROWS=which == 1, WHICH=which, FP8=fp8,
        LEVELS=(1 << bits) - 1, SEARCH=True, PATTERN=pattern, ITERS=2, STD_FLOOR=1e-3,
        STRIDE=flush_plan.plan_stride(g, d), MARKED=1, **rows.plan_consts(r, c, warps),
    )
    types = dict(pool_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32", src_ptr="*i32",
                 sink_ptr="*i32", plan_ptr="*fp32", num_pool_blocks="i32")
    sig = {n: "constexpr" if n in consts else types[n] for n in k.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if "_ptr" in n}
    src = GluonASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=consts["WARPS"]))
    regs, frame = cubin_resources(ck.asm["cubin"])
    ptx = ck.asm["ptx"]
    res.append(dict(regs=regs, frame=frame, which=which, warps=warps, div=ptx.count("div.rn.f32"),
                    ld=ptx.count("ld.global"), st=ptx.count("st.global")))
print(json.dumps(res))
"""


def _compile_offline(script: str, builds: list) -> list[dict]:
    """Run a compile script over ``builds`` in a process with the interpreter off (Gluon does
    not run under it); its last line of output, a JSON list, one entry per build."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(builds)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PLAN_BUILDS = [
    # (arch, R, C, K 0 / V 1, bits, pattern search, fp8 pool, warps: None = a row per thread)
    (90, 128, 64, 0, 4, False, False, None),  # k4v2's K tile, window
    (90, 64, 128, 1, 2, True, True, None),  # its V tile, pattern, fp8 pool
    (120, 128, 64, 0, 2, True, False, None),  # k2v2's K tile
    (120, 64, 128, 1, 4, False, False, None),  # k4v4's V tile
    (90, 128, 64, 0, 4, False, False, 8),  # 8 warps: rows and columns over more threads
    (90, 64, 128, 1, 2, True, False, 8),
    (80, 128, 64, 0, 4, False, False, None),  # Ampere: plan_engine takes compute capability 8.0+
    (80, 64, 128, 1, 2, True, False, None),
]


@pytest.mark.slow
def test_gluon_plan_compiles_offline():
    """The Gluon plan builds for sm_80, sm_90a and sm_120a (in a process with the interpreter off:
    Gluon does not run under it), within the register file and a spill frame of what was
    measured (K 104-128 B, V 392-480 B with triton 3.6; none at 8 warps, 185-189 registers),
    with the reference's IEEE quotients and its loads and stores."""
    for got in _compile_offline(_COMPILE, PLAN_BUILDS):
        assert got["regs"] <= 255, got
        assert got["frame"] <= (0 if got["warps"] else 160 if got["which"] == 0 else 512), got
        assert got["div"] > 0 and got["ld"] > 0 and got["st"] > 0, got


_COMPILE_ONEPASS = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from cubin_info import cubin_resources
import kvarn_formats as kf
from kvarn_ops.kernels import flush_onepass as one, flush_rows as rows
from kvarn_ops.kernels.flush import record_constants

res = []
for arch, fmt, dim, which, search, pattern, fp8 in json.loads(sys.argv[1]):
    lay = kf.dense_layout(fmt, dim)
    rc = record_constants(lay)
    g = lay.block_size
    r, c = (dim, g) if which == 0 else (g, dim)
    names = ("K", "KC", "KS", "KZ", "KR") if which == 0 else ("V", "VC", "VR", "VZ", "VS")
    side, codes, rs, rz, cs = names
    consts = dict(
        G=g, H=8, D=dim, R=r, C=c, TOKENS_ON_ROWS=which == 1, FP8=fp8, BITS=rc[side + "_BITS"],
        SEARCH=search, PATTERN=pattern, ITERS=2, STD_FLOOR=1e-3, MARKED=1,
        RECORD_BYTES=rc["RECORD_BYTES"], CODES_OFF=rc[codes + "_OFF"],
        ROW_SCALE_OFF=rc[rs + "_OFF"], ROW_ZP_OFF=rc[rz + "_OFF"], COL_SCALE_OFF=rc[cs + "_OFF"],
        **rows.plan_consts(r, c),
    )
    k = one.flush_kernel
    types = dict(pool_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32", src_ptr="*i32",
                 dst_ptr="*i32", sink_ptr="*i32", packed_ptr="*u8", num_pool_blocks="i32",
                 num_blocks="i32")
    sig = {n: "constexpr" if n in consts else types[n] for n in k.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if "_ptr" in n}
    src = GluonASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=consts["WARPS"]))
    regs, frame = cubin_resources(ck.asm["cubin"])
    ptx = ck.asm["ptx"]
    res.append(dict(regs=regs, frame=frame, which=which, fmt=fmt, arch=arch,
                    div=ptx.count("div.rn.f32"), st32=ptx.count("st.global.b32"),
                    st16=ptx.count("st.global.b16"), ld=ptx.count("ld.global")))
print(json.dumps(res))
"""

ONEPASS_BUILDS = [
    # (arch, format, head_dim, K 0 / V 1, search, pattern search, fp8 pool)
    (90, "kvarn_k4v2_g64", 128, 0, True, False, False),  # the bench's format: K, window
    (90, "kvarn_k4v2_g64", 128, 1, True, True, False),  # its V tile, pattern
    (90, "kvarn_k2v2_g64", 128, 0, True, True, True),  # 2-bit K, fp8 pool
    (120, "kvarn_k4v4_g64", 128, 1, True, False, False),
    (120, "kvarn_k4v2_g64", 64, 0, False, False, False),  # min/max RTN, d64 (2 warps)
    (80, "kvarn_k8v8_g128", 128, 1, True, False, False),  # 8-bit codes, 8 warps, Ampere
]


@pytest.mark.slow
def test_gluon_onepass_compiles_offline():
    """The one-pass flush builds for sm_80, sm_90a and sm_120a within the register file and a
    spill frame of what was measured (K 192 B, V 496 B at d128 with triton 3.6, sm_90a),
    packs its codes in 32-bit word stores (a thread's words: ``R * C * BITS / 32`` in all, over
    the program's threads) and stores its three fp16 fields."""
    for got in _compile_offline(_COMPILE_ONEPASS, ONEPASS_BUILDS):
        assert got["regs"] <= 255, got
        assert got["frame"] <= (256 if got["which"] == 0 else 640), got
        assert got["div"] > 0 and got["ld"] > 0 and got["st32"] > 0 and got["st16"] >= 3, got
