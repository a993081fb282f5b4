"""Triton materialize vs a float64 oracle built from the reference's record decoder, under the
Triton interpreter.

Tolerance per element: ``|out - oracle| <= EPS[dtype] * |oracle| + 1e-5 * max|oracle|``.

- bfloat16, EPS = 2**-8: one rounding to bf16 (half an ulp is 2**-9 relative) plus fp32
  accumulation of up to 512 terms in an order other than the oracle's.
- float16, EPS = 2**-10: the same with fp16's 2**-11 half ulp.

The 1e-5 term covers fp32 cancellation between the code and zero-point terms (the inverse
rotation is folded into the dequantization). The kernel must write every row of each request
and nothing else (NaN poison in the gaps between requests and after the last one).
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kvarn_formats as kf  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402
from kvarn_ops.kernels import materialize  # noqa: E402

EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
ATOL_REL = 1e-5
FP8 = torch.float8_e4m3fn


def oracle(cache, request: int):
    """float64 K, V ``[L, Hkv, D]`` of one request, model frame."""
    lay = cache.layout
    g, d = lay.block_size, lay.head_dim
    hkv = cache.packed.shape[1]
    length = int(cache.seq_lens[request])
    n_full, tail = divmod(length, g)
    h = ref.hadamard_matrix(d, torch.float64)
    ks, vs = [], []
    if n_full:
        blocks = cache.block_table[request, :n_full].long()
        fields = ref.record_fields(cache.packed[blocks].reshape(n_full * hkv, -1), lay)
        f64 = {k: v.double() for k, v in fields.items()}
        k = (
            f64["k_codes"] * f64["k_col_scale"][:, :, None] + f64["k_zero_point"][:, :, None]
        ) * f64["k_row_scale"][:, None, :]
        v = (
            f64["v_codes"] * f64["v_row_scale"][:, :, None] + f64["v_zero_point"][:, :, None]
        ) * f64["v_col_scale"][:, None, :]
        k = k.transpose(1, 2)
        for x, acc in ((k, ks), (v, vs)):
            acc.append(x.reshape(n_full, hkv, g, d).permute(0, 2, 1, 3).reshape(-1, hkv, d))
    if tail:
        pb = cache.tail_pool_block[request : request + 1]
        for pool, scale, acc in (
            (cache.exact_k, cache.k_scale, ks),
            (cache.exact_v, cache.v_scale, vs),
        ):
            vals = pool[pb.long()][0, :tail].double()
            if scale is not None:
                vals = vals * scale[pb.long()][0, :tail, :, None].double()
            acc.append(vals)
    if not ks:
        return torch.zeros(0, hkv, d, dtype=torch.float64), torch.zeros(
            0, hkv, d, dtype=torch.float64
        )
    return torch.cat(ks) @ h, torch.cat(vs) @ h


CASES = [
    # (format, D, seq_lens, Hkv, pool dtype, out dtype): every tail shape, empty requests.
    ("kvarn_k4v2_g32", 64, [75, 32, 0, 5], 2, torch.bfloat16, torch.bfloat16),
    ("kvarn_k3v5_g32", 128, [40, 64], 1, torch.float16, torch.float16),
    ("kvarn_k7v6_g32", 64, [33, 9], 2, FP8, torch.bfloat16),
    ("kvarn_k4v4_g64", 128, [64, 70], 1, torch.bfloat16, torch.bfloat16),
    ("kvarn_k2v8_g32", 256, [45], 1, torch.float16, torch.float16),
    ("kvarn_k5v2_g32", 512, [38], 1, FP8, torch.bfloat16),
    # Group 128 with D = 128: two token chunks per record share one signed-scale matrix.
    ("kvarn_k4v2_g128", 128, [300, 17], 1, torch.bfloat16, torch.bfloat16),
]


def random_scale_fields(cache, gen) -> None:
    """Overwrite the per-channel scale and zero-point fields of every record with random fp16
    values of both signs over 2**-20 .. 2**4 (fp16 subnormals included) and some exact zeros:
    the folded rotation flips fp16 sign bits, which the quantizer's positive scales alone
    would not exercise."""
    lay = cache.layout
    nb, hkv = cache.packed.shape[:2]
    for name in ("k_col_scale", "k_zero_point", "v_col_scale"):
        f = lay.field(name)
        n = f.size // 2
        mag = torch.exp2(torch.rand(nb, hkv, n, generator=gen) * 24 - 20)
        sign = torch.where(torch.rand(nb, hkv, n, generator=gen) < 0.5, -1.0, 1.0)
        vals = torch.where(torch.rand(nb, hkv, n, generator=gen) < 0.05, 0.0, mag * sign)
        cache.packed[:, :, f.offset : f.end] = vals.to(torch.float16).view(torch.uint8)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[4])[6:]}-{str(c[5])[6:]}"
)
def test_materialize_matches_oracle(case, make_cache, gen):
    fmt, d, seq_lens, hkv, pdt, odt = case
    cache = make_cache(fmt, d, seq_lens, hkv, pdt)
    _check_against_oracle(cache, seq_lens, hkv, d, odt)


@pytest.mark.parametrize("fmt,d", [("kvarn_k4v2_g64", 128), ("kvarn_k8v3_g32", 64)])
def test_materialize_signed_scales_match_oracle(fmt, d, make_cache, gen):
    seq_lens = [70, 32]
    cache = make_cache(fmt, d, seq_lens, 2, torch.bfloat16)
    random_scale_fields(cache, gen)
    _check_against_oracle(cache, seq_lens, 2, d, torch.bfloat16)


def _check_against_oracle(cache, seq_lens, hkv, d, odt):
    b = len(seq_lens)
    # Requests placed with gaps of 3 rows between them and 5 poison rows after the last.
    starts, row = [], 0
    for n in seq_lens:
        starts.append(row)
        row += n + 3
    total = row + 2
    cu = torch.tensor(starts + [total], dtype=torch.int32)
    k_out = torch.full((total, hkv, d), float("nan"), dtype=odt)
    v_out = torch.full_like(k_out, float("nan"))
    materialize(*cache.context_args(), k_out, v_out, cu)
    covered = torch.zeros(total, dtype=torch.bool)
    for r in range(b):
        s, n = starts[r], seq_lens[r]
        covered[s : s + n] = True
        k64, v64 = oracle(cache, r)
        for got, want in ((k_out[s : s + n], k64), (v_out[s : s + n], v64)):
            assert not bool(got.isnan().any()), f"request {r}: a row was not written"
            if n == 0:
                continue
            tol = EPS[odt] * want.abs() + ATOL_REL * want.abs().max()
            err = (got.double() - want).abs()
            assert bool((err <= tol).all()), f"request {r}: max excess {(err - tol).max()}"
    for out in (k_out, v_out):
        assert bool(out[~covered].isnan().all()), "a row outside every request was written"


def test_materialize_is_a_registered_custom_op():
    assert hasattr(torch.ops.kvarn, "materialize")


def _args(**over):
    lay = kf.dense_layout("kvarn_k4v2_g32", 64)
    hkv, d = 2, 64
    args = dict(
        packed=torch.zeros(3, hkv, lay.record_bytes, dtype=torch.uint8),
        block_table=torch.tensor([[0, 2], [1, -1]], dtype=torch.int32),
        seq_lens=torch.tensor([64, 40], dtype=torch.int32),
        exact_k=torch.zeros(2, 32, hkv, d, dtype=torch.float16),
        exact_v=torch.zeros(2, 32, hkv, d, dtype=torch.float16),
        k_scale=None,
        v_scale=None,
        tail_pool_block=torch.tensor([-1, 1], dtype=torch.int32),
        layout=lay,
        k_out=torch.zeros(104, hkv, d, dtype=torch.bfloat16),
        v_out=torch.zeros(104, hkv, d, dtype=torch.bfloat16),
        cu_seqlens=torch.tensor([0, 64, 104], dtype=torch.int32),
    )
    args.update(over)
    return args


BAD = {
    "table-range": (
        "block_table",
        dict(block_table=torch.tensor([[0, 3], [1, -1]], dtype=torch.int32)),
    ),
    "table-dtype": ("block_table", dict(block_table=torch.tensor([[0, 2], [1, -1]]))),
    "seq-too-long": ("seq_lens", dict(seq_lens=torch.tensor([96, 40], dtype=torch.int32))),
    "tail-range": (
        "tail_pool_block",
        dict(tail_pool_block=torch.tensor([-1, 2], dtype=torch.int32)),
    ),
    "cu-range": ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 70, 104], dtype=torch.int32))),
    "cu-shape": ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 64], dtype=torch.int32))),
    "out-dtype": ("k_out", dict(k_out=torch.zeros(104, 2, 64), v_out=torch.zeros(104, 2, 64))),
    "v-out-dtype": ("v_out", dict(v_out=torch.zeros(104, 2, 64, dtype=torch.float16))),
    "out-shape": ("k_out", dict(k_out=torch.zeros(104, 2, 128, dtype=torch.bfloat16))),
    "packed-record": ("packed", dict(packed=torch.zeros(3, 2, 64, dtype=torch.uint8))),
    "layout-mla": ("layout", dict(layout=kf.mla_layout("kvarn_mla_k4_g64"))),
    "layout-group": ("exact_k", dict(layout=kf.dense_layout("kvarn_k4v2_g64", 64))),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_materialize_rejects_bad_input(case):
    name, over = BAD[case]
    with pytest.raises(ValueError, match=f"^{name}"):
        materialize(**_args(**over))


@pytest.mark.parametrize(
    ("fmt", "seq_lens"), [("kvarn_k4v2_g64", [70, 64, 5, 0]), ("kvarn_k4v4_g128", [300, 127])]
)
def test_tails_only_launch_writes_only_the_tails(fmt, seq_lens, make_cache, monkeypatch):
    """Where the Gluon kernel takes the full blocks (on a GPU), the Triton kernel is launched
    for the exact tails only: here the full-block launch is left out, so the full blocks' rows
    must stay untouched (NaN) while every tail row matches the oracle."""
    mod = importlib.import_module("kvarn_ops.kernels.materialize")
    launched = []
    monkeypatch.setattr(mod, "_use_mma_kernel", lambda layout, packed: True)
    monkeypatch.setattr(mod, "_mma_module", lambda: object())
    monkeypatch.setattr(mod, "_launch_mma", lambda *a, **k: launched.append(a))
    d, hkv = 128, 2
    cache = make_cache(fmt, d, seq_lens, hkv, torch.bfloat16)
    g = cache.layout.block_size
    total = sum(seq_lens) + 4
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32)
    k_out = torch.full((total, hkv, d), float("nan"), dtype=torch.bfloat16)
    v_out = torch.full_like(k_out, float("nan"))
    materialize(*cache.context_args(), k_out, v_out, cu)
    assert len(launched) == 1
    written = torch.zeros(total, dtype=torch.bool)
    for r, n in enumerate(seq_lens):
        full = (n // g) * g
        s = starts[r]
        written[s + full : s + n] = True
        if n == full:
            continue
        k64, v64 = oracle(cache, r)
        tails = ((k_out[s + full : s + n], k64[full:]), (v_out[s + full : s + n], v64[full:]))
        for got, want in tails:
            tol = EPS[torch.bfloat16] * want.abs() + ATOL_REL * want.abs().max()
            assert bool(((got.double() - want).abs() <= tol).all()), f"request {r}: tail rows"
    for out in (k_out, v_out):
        assert not bool(out[written].isnan().any()), "a tail row was not written"
        assert bool(out[~written].isnan().all()), "a full-block row was written by the tail launch"


@pytest.mark.parametrize(
    ("fmt", "d", "hkv"),
    [
        ("kvarn_k4v2_g64", 128, 2),
        ("kvarn_k2v2_g64", 128, 2),
        ("kvarn_k2v4_g128", 128, 3),
        ("kvarn_k4v2_g64", 64, 3),  # head pairs: two programs, the second of one head
        ("kvarn_k2v2_g128", 64, 8),
        ("kvarn_k4v4_g64", 256, 2),  # head_dim 256: K and V each in two 32-token programs
    ],
)
@pytest.mark.parametrize("pairs", ["", "1", "2"], ids=["default", "pairs1", "pairs2"])
def test_gluon_launch_names_the_code_widths(fmt, d, hkv, pairs, monkeypatch):
    """The Gluon full-block kernel reads 2-bit K codes (16-bit runs) unlike 4-bit ones and
    takes head_dim 64 as head pairs and 256 as two halves: its launcher passes both code
    widths, the pair flag, the head_dim and the grid of 64-token halves, heads and tile kinds
    (the kernel replaced by a recorder; a dropped ``KB`` would read 2-bit codes as 4-bit ones
    on the GPU, a dropped ``PAIR`` 64-channel records as 128-channel ones)."""
    mod = importlib.import_module("kvarn_ops.kernels.materialize")
    monkeypatch.setenv("KVARN_MATERIALIZE_D256_PAIRS", pairs)
    seen = {}

    class _Recorder:
        def __getitem__(self, grid):
            seen["grid"] = grid
            return lambda *args, **kw: seen.update(args=args, kw=kw)

    fake = type("Mod", (), {"mma_materialize_kernel": _Recorder()})()
    lay = kf.dense_layout(fmt, d)
    packed = torch.zeros(5, hkv, lay.record_bytes, dtype=torch.uint8)
    bt = torch.zeros(3, 4, dtype=torch.int32)
    out = torch.zeros(10, hkv, d, dtype=torch.bfloat16)
    seq = torch.zeros(3, dtype=torch.int32)
    mod._launch_mma(fake, packed, bt, seq, seq, out, out, lay)
    fmt_bits = kf.parse_format(fmt)
    assert seen["kw"]["KB"] == fmt_bits.k_bits and seen["kw"]["VB"] == fmt_bits.v_bits
    assert seen["kw"]["G"] == lay.block_size and seen["kw"]["REC"] == lay.record_bytes
    assert seen["kw"]["PAIR"] == (d == 64) and seen["kw"]["D"] == d
    heads = (hkv + 1) // 2 if d == 64 else hkv
    mps = int(pairs or mod.MMA_D256_PAIRS) if d == 256 else 1
    assert seen["kw"]["MPS"] == mps
    kinds = 4 if d == 256 and mps == 1 else 2
    assert seen["grid"] == (3 * 4 * (lay.block_size // 64), heads, kinds)
    assert seen["kw"]["KC_OFF"] == lay.field("k_codes").offset
    assert seen["args"][-1] == hkv  # H: the kernel pairs heads 2 j and 2 j + 1 < H


def test_gluon_materialize_scope():
    """Which geometries the Gluon kernel takes: 2- or 4-bit K, 2- or 4-bit V, 64- or
    128-token records, head_dim 64 (pairs), 128 or 256; everything else the Triton kernel."""
    from kvarn_ops.kernels import materialize_mma

    ok = materialize_mma.mma_materialize_supported
    assert ok(4, 2, 64, 128) and ok(2, 2, 64, 128) and ok(2, 4, 128, 64) and ok(4, 4, 128, 64)
    assert not ok(3, 2, 64, 128) and not ok(8, 8, 64, 128) and not ok(4, 3, 64, 128)
    assert ok(4, 2, 64, 256) and ok(2, 4, 128, 256)
    assert not ok(4, 2, 32, 128) and not ok(2, 2, 64, 512) and not ok(4, 2, 64, 96)


def test_d256_pairs_knob_rejects_other_values(monkeypatch):
    mod = importlib.import_module("kvarn_ops.kernels.materialize")
    monkeypatch.setenv("KVARN_MATERIALIZE_D256_PAIRS", "4")
    with pytest.raises(ValueError, match="^KVARN_MATERIALIZE_D256_PAIRS"):
        mod.d256_pairs()
