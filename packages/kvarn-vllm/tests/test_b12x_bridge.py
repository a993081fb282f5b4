"""kvarn_vllm.b12x_bridge: fail-closed checks (always run) and contract tests against the
installed b12x 1.5.1 (run on the CPU: signatures, its declarative plan, its scratch-binding
checks and its torch reference; the SM120 kernel itself needs an SM120/121 GPU).

Contract tests skip when b12x is not installed, unless KVARN_REQUIRE_B12X=1: then they fail.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import types
from importlib import metadata

import pytest

from kvarn_vllm import b12x_bridge as bridge

torch = pytest.importorskip("torch")
kf = pytest.importorskip("kvarn_formats")
mla = pytest.importorskip("kvarn_ops.reference.mla")

H = 4  # query heads
SCALE = 576**-0.5


# ---------------------------------------------------------------------------------------------
# helpers


def make_cache(*, num_blocks=6, pool_blocks=3, bits=5, pool_dtype=torch.bfloat16, seed=0):
    """A KVarN MLA cache: blocks 0..num_blocks-3 packed, the last two mapped to pool blocks."""
    g = torch.Generator().manual_seed(seed)
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    fp8 = pool_dtype == torch.float8_e4m3fn
    pool_latent = torch.zeros(pool_blocks, 64, 512, dtype=pool_dtype)
    pool_scale = torch.ones(pool_blocks, 64) if fp8 else None
    pool_rope = torch.zeros(pool_blocks, 64, 64, dtype=torch.bfloat16)
    packed = torch.zeros(num_blocks, layout.record_bytes, dtype=torch.uint8)

    def fill(pool_block):
        slots = pool_block * 64 + torch.arange(64)
        lat = torch.randn(64, 512, generator=g) * torch.rand(1, 512, generator=g) * 2
        rope = torch.randn(64, 64, generator=g)
        mla.mla_exact_scatter(lat, rope, slots, pool_latent, pool_rope, pool_scale)

    for blk in range(num_blocks - 2):
        fill(0)
        mla.mla_pack(
            pool_latent,
            pool_scale,
            pool_rope,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([blk], dtype=torch.int32),
            packed,
            layout,
        )
    bpm = torch.full((num_blocks,), -1, dtype=torch.int32)
    for i, blk in enumerate(range(num_blocks - 2, num_blocks)):
        fill(i + 1)
        bpm[blk] = i + 1
    return bridge.MlaCache(packed, bpm, pool_latent, pool_scale, pool_rope, layout)


def cache_args(cache):
    """(packed, block_pool_map, pool_latent, pool_scale, pool_rope) of a bridge.MlaCache."""
    return cache.packed, cache.block_pool_map, cache.pool_latent, cache.pool_scale, cache.pool_rope


def make_selection(seq_lens, k, *, seed=1, num_blocks=6):
    """Block table, logical top-k indices (-1 padded) and their physical slots."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    max_blocks = -(-max(seq_lens) // 64)
    block_table = torch.stack(
        [torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(b)]
    ).to(torch.int32)
    indices = torch.full((b, k), -1, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        take = min(n, k - 3)  # leave some -1 entries, shuffled in
        cols = torch.randperm(k, generator=g)[:take]
        indices[r, cols] = torch.randperm(n, generator=g)[:take].to(torch.int32)
    slots = torch.empty(b, k, dtype=torch.int64)
    mla.mla_remap_indices(indices, torch.arange(b, dtype=torch.int32), block_table, slots)
    return block_table, torch.tensor(seq_lens, dtype=torch.int32), indices, slots


def records_oracle(staged, scale):
    """Attention over the staged records in float64, rotated frame (what b12x computes)."""
    rec = staged.kv_cache.view(-1, 656)
    lat = rec[:, :512].contiguous().view(torch.float8_e4m3fn).double()
    lat = (
        lat.view(-1, 4, 128) * rec[:, 512:528].contiguous().view(torch.float32).double()[..., None]
    )
    lat = lat.view(-1, 512)
    rope = rec[:, 528:].contiguous().view(torch.bfloat16).double()
    q = staged.q.double()
    b = q.shape[0]
    out = torch.zeros(b, q.shape[1], 512, dtype=torch.float64)
    for r in range(b):
        rows = staged.selected_indices[r].long()
        rows = rows[: int(staged.selected_lengths[r])]
        assert bool((rows >= 0).all())
        if rows.numel() == 0:
            continue
        s = (q[r, :, :512] @ lat[rows].T + q[r, :, 512:] @ rope[rows].T) * scale
        out[r] = torch.softmax(s, -1) @ lat[rows]
    return out


# ---------------------------------------------------------------------------------------------
# fail-closed checks (no b12x needed)


def fake_version(value):
    real = metadata.version

    def version(name):
        if name == "b12x":
            if value is None:
                raise metadata.PackageNotFoundError(name)
            return value
        return real(name)

    return version


def fake_sparse_mla(drop=(), drop_params=()):
    """A module with the API the bridge calls, minus ``drop`` names / ``drop_params``."""

    @dataclasses.dataclass
    class Caps:
        device: object
        num_q_heads: int
        max_q_rows: int
        max_width: int
        softmax_scale: float
        dtype: object = None
        kv_dtype: object = None
        head_dim: int = 576
        v_head_dim: int = 512
        model_type: int | None = None
        scale_format: int | None = None
        cache_record_bytes: int | None = None
        mode: str = "decode"
        max_batch: int | None = None
        max_page_table_width: int | None = None
        page_size: int = 64

    def bind(
        plan,
        *,
        scratch,
        q,
        kv_cache,
        selected_indices,
        cache_lengths,
        selected_lengths,
        attention_sink=None,
    ):
        return None

    def bind_short(plan, *, scratch, q, kv_cache, selected_indices, cache_lengths):
        return None

    mod = types.ModuleType("b12x.attention.sparse_mla")
    mod.Caps = Caps
    mod.plan = lambda caps, *, invocation=None, override=None: None
    mod.bind = bind_short if "selected_lengths" in drop_params else bind
    mod.run = lambda binding: None
    mod.is_supported = lambda device=None: True
    mod.ModelType = types.SimpleNamespace(GLM_NSA=1)
    for name in drop:
        delattr(mod, name)
    return mod


def test_not_installed_fails_closed(monkeypatch):
    monkeypatch.setattr(metadata, "version", fake_version(None))
    with pytest.raises(bridge.B12xUnavailable, match=r"b12x is not installed.*kvarn-vllm\[b12x\]"):
        bridge.load_b12x(capability=(12, 0))


def test_wrong_version_fails_closed(monkeypatch):
    monkeypatch.setattr(metadata, "version", fake_version("1.4.0"))
    with pytest.raises(bridge.B12xUnavailable, match=r"b12x 1\.4\.0 .*b12x==1\.5\.1"):
        bridge.load_b12x(capability=(12, 0))


def test_unimportable_fails_closed(monkeypatch):
    monkeypatch.setattr(metadata, "version", fake_version("1.5.1"))
    monkeypatch.setitem(sys.modules, bridge.SPARSE_MLA_MODULE, None)
    with pytest.raises(bridge.B12xUnavailable, match="cannot be imported"):
        bridge.load_b12x(capability=(12, 0))


@pytest.mark.parametrize(
    ("module_kw", "named"),
    [
        ({"drop": ("run",)}, "run"),
        ({"drop": ("plan", "Caps")}, "Caps, plan"),
        ({"drop_params": ("selected_lengths",)}, "bind(selected_lengths)"),
        ({"drop": ("ModelType",)}, "ModelType.GLM_NSA"),
    ],
)
def test_missing_api_fails_closed(monkeypatch, module_kw, named):
    monkeypatch.setattr(metadata, "version", fake_version("1.5.1"))
    monkeypatch.setitem(sys.modules, bridge.SPARSE_MLA_MODULE, fake_sparse_mla(**module_kw))
    with pytest.raises(bridge.B12xUnavailable, match="lacks what the bridge calls") as err:
        bridge.load_b12x(capability=(12, 0))
    assert named in str(err.value)


def test_complete_fake_api_passes(monkeypatch):
    monkeypatch.setattr(metadata, "version", fake_version("1.5.1"))
    mod = fake_sparse_mla()
    monkeypatch.setitem(sys.modules, bridge.SPARSE_MLA_MODULE, mod)
    assert bridge.api_problems(mod) == []
    assert bridge.load_b12x(capability=(12, 1)) is mod


@pytest.mark.parametrize("cap", [(9, 0), (8, 0), (10, 0), (12, 2), (11, 0)])
def test_wrong_arch_fails_closed(monkeypatch, cap):
    with pytest.raises(bridge.B12xUnavailable, match=rf"sm_{cap[0]}{cap[1]}: b12x needs SM120/121"):
        bridge.check_capability(capability=cap)
    # also through load_b12x, after the package checks pass
    monkeypatch.setattr(metadata, "version", fake_version("1.5.1"))
    monkeypatch.setitem(sys.modules, bridge.SPARSE_MLA_MODULE, fake_sparse_mla())
    with pytest.raises(bridge.B12xUnavailable, match=rf"sm_{cap[0]}{cap[1]}"):
        bridge.load_b12x(capability=cap)


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_sm12x_accepted(cap):
    bridge.check_capability(capability=cap)


def test_capability_asked_from_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bridge.B12xUnavailable, match="no CUDA device"):
        bridge.check_capability()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(bridge.B12xUnavailable, match="sm_90: b12x needs SM120/121"):
        bridge.check_capability("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    bridge.check_capability("cuda:0")


def test_decoder_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(metadata, "version", fake_version(None))
    with pytest.raises(bridge.B12xUnavailable, match="not installed"):
        bridge.B12xSparseMlaDecoder(
            num_heads=H, max_batch=2, topk=64, softmax_scale=SCALE, device="cpu"
        )
    monkeypatch.setattr(metadata, "version", fake_version("1.5.1"))
    monkeypatch.setitem(sys.modules, bridge.SPARSE_MLA_MODULE, fake_sparse_mla())
    with pytest.raises(bridge.B12xUnavailable, match="sm_90"):
        bridge.B12xSparseMlaDecoder(
            num_heads=H, max_batch=2, topk=64, softmax_scale=SCALE, device="cpu", capability=(9, 0)
        )


def test_import_is_lazy():
    code = (
        "import sys, kvarn_vllm, kvarn_vllm.b12x_bridge; "
        "print(','.join(m for m in ('b12x', 'torch', 'vllm') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert proc.stdout.strip() == "", f"imported at kvarn_vllm.b12x_bridge import: {proc.stdout}"


def test_vllm_plugin_leaks_rule(monkeypatch):
    eps = metadata.EntryPoints(
        [
            metadata.EntryPoint(
                "b12x_fp6", "b12x.integration.vllm.plugin:register", "vllm.general_plugins"
            ),
            metadata.EntryPoint("kvarn", "kvarn_vllm.plugin:register", "vllm.general_plugins"),
        ]
    )
    monkeypatch.setattr(
        metadata,
        "entry_points",
        lambda group=None: eps if group == "vllm.general_plugins" else metadata.EntryPoints([]),
    )
    assert bridge.vllm_plugin_leaks({}) == ["b12x_fp6"]
    assert bridge.vllm_plugin_leaks({"VLLM_PLUGINS": "kvarn,kvarn_test_cpu"}) == []
    assert bridge.vllm_plugin_leaks({"VLLM_PLUGINS": "kvarn,b12x_fp6"}) == ["b12x_fp6"]


# ---------------------------------------------------------------------------------------------
# staging (kvarn_ops only)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_stage_decode_compacts_and_stages(pool_dtype):
    cache = make_cache(pool_dtype=pool_dtype)
    width = 64
    _, _, _, slots = make_selection([200, 90, 300], 40)
    slots[1] = -1  # request 1 selects nothing
    q = torch.randn(3, H, 576)
    records = torch.zeros(bridge.staging_rows(3, width), 656, dtype=torch.uint8)
    st = bridge.stage_decode(q, cache, slots, width=width, records=records)

    assert st.kv_cache.shape == (records.shape[0] // 64, 64, 656)
    assert st.kv_cache.data_ptr() == records.data_ptr()
    assert st.selected_indices.dtype == torch.int32 and st.selected_indices.shape == (3, width)
    assert st.selected_lengths.tolist() == (slots >= 0).sum(1).tolist()
    assert st.q.dtype == torch.bfloat16 and st.q.is_contiguous()
    for r in range(3):
        n = int(st.selected_lengths[r])
        rows = st.selected_indices[r]
        assert bool((rows[n:] == -1).all()) and bool((rows[:n] >= 0).all())
        want = slots[r][slots[r] >= 0]  # same tokens, same order
        ref = torch.zeros(n, 656, dtype=torch.uint8)
        mla.mla_stage_fp8(*cache_args(cache), want, cache.layout, ref)
        assert torch.equal(records[rows[:n].long()], ref)
    q_rot = mla.hadamard(q[..., :512])
    torch.testing.assert_close(st.q[..., :512].float(), q_rot, atol=0.02, rtol=0.01)
    assert torch.equal(st.q[..., 512:], q[..., 512:].to(torch.bfloat16))


def test_stage_decode_checks_arguments():
    cache = make_cache()
    q = torch.randn(2, H, 576)
    slots = torch.full((2, 8), -1, dtype=torch.int64)
    ok = torch.zeros(64, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="planned width"):
        bridge.stage_decode(q, cache, slots, width=4, records=ok)
    with pytest.raises(ValueError, match="records"):
        bridge.stage_decode(
            q, cache, slots, width=8, records=torch.zeros(60, 656, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="slots"):
        bridge.stage_decode(q, cache, slots.int(), width=8, records=ok)
    # a bad q_out is refused before the records are written (one selected token)
    one = slots.clone()
    one[0, 0] = 5
    poisoned = torch.full((64, 656), 0xA5, dtype=torch.uint8)
    with pytest.raises(ValueError, match="q_out"):
        bridge.stage_decode(q, cache, one, width=8, records=poisoned, q_out=torch.empty(2, H, 576))
    assert bool((poisoned == 0xA5).all()), "records written before q_out was checked"
    with pytest.raises(ValueError, match=r"^q: expected \[B, H, 576\]"):
        bridge.stage_decode(q[:, 0], cache, slots, width=8, records=ok)
    for bad in ((-1, 5), (3, -2), (2.5, 4)):
        with pytest.raises(ValueError, match="max_batch|width"):
            bridge.staging_rows(*bad)


def test_finish_decode_rotates_back_and_zeroes_empty():
    res = torch.randn(3, H, 512).to(torch.bfloat16)
    out = torch.full((3, H, 512), 7.0)
    bridge.finish_decode(res, torch.tensor([5, 0, 1], dtype=torch.int32), out)
    want = mla.hadamard(res.float())
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]])
    assert bool((out[1] == 0).all())
    # one request's result never broadcasts into a larger output
    with pytest.raises(ValueError, match="^out"):
        bridge.finish_decode(res[:1], torch.tensor([1], dtype=torch.int32), out)
    with pytest.raises(ValueError, match="^selected_lengths"):
        bridge.finish_decode(res, torch.tensor([1], dtype=torch.int32), out)


# ---------------------------------------------------------------------------------------------
# contract tests against the installed b12x


@pytest.fixture(scope="module")
def sparse_mla():
    """b12x.attention.sparse_mla, checked by the bridge (version and API, no GPU).

    Skips when b12x is not importable and KVARN_REQUIRE_B12X is unset; fails when it is 1."""
    flag = os.environ.get("KVARN_REQUIRE_B12X")
    if flag is None:
        pytest.importorskip(
            bridge.SPARSE_MLA_MODULE,
            reason="b12x is not installed (set KVARN_REQUIRE_B12X=1 to fail instead)",
        )
    elif flag != "1":
        pytest.fail(f"KVARN_REQUIRE_B12X must be unset or 1, got {flag!r}")
    try:
        return bridge.load_b12x(check_device=False)
    except bridge.B12xUnavailable as exc:
        pytest.fail(f"KVARN_REQUIRE_B12X={flag}: {exc}" if flag else str(exc))


def test_installed_api_matches_our_calls(sparse_mla):
    assert metadata.version("b12x") == bridge.B12X_VERSION
    assert bridge.api_problems(sparse_mla) == []
    assert int(sparse_mla.ModelType.GLM_NSA) == 1  # caps_kwargs' model_type
    # every call the bridge makes binds to the installed signatures, by keyword
    kw = bridge.caps_kwargs(num_heads=H, max_batch=2, topk=64, softmax_scale=SCALE, device="cpu")
    inspect.signature(sparse_mla.Caps).bind(**kw)
    inspect.signature(sparse_mla.plan).bind(object())
    inspect.signature(sparse_mla.bind).bind(
        object(),
        scratch=None,
        q=None,
        kv_cache=None,
        selected_indices=None,
        cache_lengths=None,
        selected_lengths=None,
    )
    inspect.signature(sparse_mla.run).bind(object())
    inspect.signature(sparse_mla.is_supported).bind(None)


def test_plan_accepts_our_shapes_on_cpu(sparse_mla):
    for heads, batch, topk in [(H, 2, 64), (16, 8, 2048), (128, 1, 512)]:
        kw = bridge.caps_kwargs(
            num_heads=heads, max_batch=batch, topk=topk, softmax_scale=SCALE, device="cpu"
        )
        caps = sparse_mla.Caps(**kw)
        plan = sparse_mla.plan(caps)
        q = plan.query
        assert (q.mode, q.model_type, q.scale_format) == ("decode", 1, 1)
        assert (q.qk_head_dim, q.v_head_dim, q.kv_dtype, q.dtype) == (576, 512, "uint8", "bfloat16")
        assert (q.cache_record_bytes, q.page_size, q.max_width) == (656, 64, topk)
        assert (q.num_q_heads, q.max_q_rows, q.max_batch) == (heads, batch, batch)
        plan.contract.validate_query(q, None)
        specs = plan.scratch_specs()
        assert len(specs) == 1 and specs[0].dtype == torch.uint8 and specs[0].nbytes > 0


def test_b12x_recipe_is_the_staged_record(sparse_mla):
    """b12x's GLM_NSA record traits equal kvarn_formats.STAGED_MLA_FP8, field by field."""
    kw = bridge.caps_kwargs(num_heads=H, max_batch=2, topk=64, softmax_scale=SCALE, device="cpu")
    t = sparse_mla.Caps(**kw).cache_traits
    lay = kf.STAGED_MLA_FP8
    latent, scales, rope = lay.field("latent"), lay.field("scales"), lay.field("rope")
    assert t.kv_gmem_stride == lay.record_bytes == 656
    assert (t.d_nope, latent.offset, latent.dtype) == (latent.size, 0, "float8_e4m3fn")
    assert t.num_scales * 4 == scales.size and t.quant_tile * t.num_scales == t.d_nope
    assert (scales.offset, scales.dtype) == (t.d_nope, "float32")
    assert (t.rope_gmem_offset, t.rope_payload_bytes) == (rope.offset, rope.size)
    assert (t.d_rope, rope.dtype, t.fp8_rope, t.v_has_rope) == (64, "bfloat16", False, False)
    # and a record b12x's own packer writes is byte-identical to ours
    ref = importlib.import_module(bridge.SPARSE_MLA_MODULE + ".reference")
    g = torch.Generator().manual_seed(3)
    lat = (torch.randn(37, 512, generator=g) * 3).to(torch.bfloat16)
    lat[5] = 0  # amax 0: scale 1.0 in both
    rope_v = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    theirs = ref.pack_mla_kv_cache_reference(lat, rope_v).view(37, 656)
    ours = mla.stage_records_from_latent(lat.float(), rope_v)
    assert torch.equal(theirs, ours)


def test_b12x_reference_on_staged_records_matches_kvarn_decode(sparse_mla):
    """Our staged inputs through b12x's torch reference == kvarn_ops' MLA decode oracle."""
    ref = importlib.import_module(bridge.SPARSE_MLA_MODULE + ".reference")
    cache = make_cache(pool_dtype=torch.float8_e4m3fn)
    width = 64
    block_table, seq_lens, indices, slots = make_selection([200, 90, 256, 64], 48)
    indices[2] = -1
    slots[2] = -1  # an empty selection gives zeros
    q = torch.randn(4, H, 576) * 0.5
    records = torch.zeros(bridge.staging_rows(4, width), 656, dtype=torch.uint8)
    st = bridge.stage_decode(q, cache, slots, width=width, records=records)

    res = ref.sparse_mla_reference(
        q_all=st.q,
        kv_cache=st.kv_cache.view(-1, 656),
        page_table_1=st.selected_indices,
        active_token_counts=st.selected_lengths,
        sm_scale=SCALE,
        v_head_dim=512,
    )
    assert res.shape == (4, H, 512) and res.dtype == torch.bfloat16
    torch.testing.assert_close(res.double(), records_oracle(st, SCALE), atol=2e-2, rtol=2e-2)

    out = torch.empty(4, H, 512)
    bridge.finish_decode(res, st.selected_lengths, out)
    want = torch.empty(4, H, 512)
    mla.mla_decode(
        q, cache.packed, block_table, seq_lens, *cache_args(cache)[1:],
        cache.layout, SCALE, want, None, indices,
    )  # fmt: skip
    assert bool((out[2] == 0).all()) and bool((want[2] == 0).all())
    err = (out - want).norm() / want.norm()
    assert float(err) < 0.05, f"relative error {float(err):.4f} (fp8 staging + bf16 query)"


def test_decoder_call_passes_b12x_binding_checks(sparse_mla, monkeypatch):
    """The decoder, planned on the CPU: its bind call goes through b12x's own scratch-binding
    checks (shapes, dtypes, top-k width, record width, capacities) and the b12x reference
    stands in for the SM120 kernel."""
    from b12x.attention.sparse_mla._scratch import plan_sparse_mla_scratch  # checks only

    ref = importlib.import_module(bridge.SPARSE_MLA_MODULE + ".reference")
    real_bind = inspect.signature(sparse_mla.bind)
    calls = []

    def bind(plan, **kw):
        real_bind.bind(plan, **kw)
        caps = dec.caps
        checked = plan_sparse_mla_scratch(caps).bind(
            scratch=kw["scratch"],
            q=kw["q"],
            selected_indices=kw["selected_indices"],
            cache_seqlens_int32=kw["cache_lengths"],
            nsa_cache_seqlens_int32=kw["selected_lengths"],
            kv_cache=kw["kv_cache"],
        )
        calls.append(kw)
        return checked

    def run(binding):
        return ref.sparse_mla_reference(
            q_all=binding.q,
            kv_cache=binding.kv_cache.view(-1, 656),
            page_table_1=binding.selected_indices,
            active_token_counts=binding.nsa_cache_seqlens_int32,
            sm_scale=dec.caps.softmax_scale,
            v_head_dim=512,
        )

    dec = bridge.B12xSparseMlaDecoder(
        num_heads=H, max_batch=4, topk=64, softmax_scale=SCALE, device="cpu", capability=(12, 0)
    )
    assert dec.records.shape == (4, 64, 656)
    monkeypatch.setattr(dec._b12x, "bind", bind)
    monkeypatch.setattr(dec._b12x, "run", run)
    cache = make_cache()
    block_table, seq_lens, indices, slots = make_selection([130, 70, 250], 50)
    q = torch.randn(3, H, 576) * 0.5
    out = torch.empty(3, H, 512, dtype=torch.bfloat16)
    dec(q, cache, slots, out)
    assert len(calls) == 1 and calls[0]["selected_indices"].shape == (3, 64)
    want = torch.empty(3, H, 512)
    mla.mla_decode(
        q, cache.packed, block_table, seq_lens, *cache_args(cache)[1:],
        cache.layout, SCALE, want, None, indices,
    )  # fmt: skip
    err = (out.float() - want).norm() / want.norm()
    assert float(err) < 0.05, f"relative error {float(err):.4f}"
    with pytest.raises(ValueError, match="planned for 4"):
        dec(torch.randn(5, H, 576), cache, torch.full((5, 8), -1), out)


def test_b12x_vllm_plugins_filtered_in_this_run(sparse_mla):
    """b12x's vLLM plugins load in every vLLM process unless VLLM_PLUGINS filters them: the
    environment of this test run must filter them (vLLM's engine tests inherit it)."""
    assert {"b12x_fp6", "b12x_loader"} <= set(bridge.vllm_plugin_leaks({}))
    assert bridge.vllm_plugin_leaks({"VLLM_PLUGINS": "kvarn,kvarn_test_cpu"}) == []
    leaks = bridge.vllm_plugin_leaks()
    assert not leaks, (
        f"b12x's vLLM plugins {leaks} would load in every vLLM process of this run: "
        "set VLLM_PLUGINS=kvarn,kvarn_test_cpu"
    )


def test_vllm_loads_no_b12x_plugin(sparse_mla):
    """With vLLM installed too: vLLM's own plugin loader, under this run's environment, loads
    no b12x plugin and imports no b12x integration module."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("KVARN_REQUIRE_VLLM") == "1":
            pytest.fail("KVARN_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed")
    code = (
        "import sys\n"
        "from vllm.plugins import load_plugins_by_group\n"
        "names = set(load_plugins_by_group('vllm.general_plugins'))\n"
        "names |= set(load_plugins_by_group('vllm.platform_plugins'))\n"
        "mods = [m for m in sys.modules if m.startswith('b12x')]\n"
        "print(sorted(n for n in names if n.startswith('b12x')), mods)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[] []", proc.stdout
