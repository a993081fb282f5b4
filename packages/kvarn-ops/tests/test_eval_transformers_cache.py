"""KvarnCache (kvarn_ops.transformers_cache): a transformers cache holding KVarN records.

Its records are the reference's bytes, each update returns what the serving path's queries
see (packed tiles dequantized, the filling tile exact), and a model fed in tiles through it
scores a text exactly as the accuracy harness's teacher-forced pass does."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="the eval extra is not installed")
pytest.importorskip("gguf", reason="the eval extra is not installed")

import kvarn_formats as kf  # noqa: E402
from kvarn_ops import cache_codec as cc  # noqa: E402
from kvarn_ops.evaluation import attention as att  # noqa: E402
from kvarn_ops.evaluation.harness import Harness, default_token_ids  # noqa: E402
from kvarn_ops.evaluation.model_setup import write_tiny_llama  # noqa: E402
from kvarn_ops.evaluation.variants import make_variant  # noqa: E402
from kvarn_ops.reference import decode_records, encode_records, hadamard  # noqa: E402
from kvarn_ops.transformers_cache import KvarnCache, KvarnLayer  # noqa: E402
from test_decode import ATOL, ERR_FACTOR, emulated_error  # noqa: E402


def _expected_tiles(k: torch.Tensor, v: torch.Tensor, layout, first: bool):
    """Records and dequantized K/V ([B, Hkv, n*G, D], model frame) of the full tiles of
    ``k, v [B, Hkv, n*G, D]``, computed directly with the reference."""
    b, hkv, n, d = k.shape
    g = layout.block_size
    tiles = n // g
    if tiles == 0:
        return torch.empty(b, 0, hkv, layout.record_bytes, dtype=torch.uint8), k, v
    # rotated in fp32, held in the K/V's dtype (as the serving pool holds them)
    kt = hadamard(k.float()).to(k.dtype).float()
    vt = hadamard(v.float()).to(v.dtype).float()
    kt = kt.reshape(b, hkv, tiles, g, d).permute(0, 2, 1, 3, 4)
    vt = vt.reshape(b, hkv, tiles, g, d).permute(0, 2, 1, 3, 4)
    sink = torch.full((b, tiles, hkv), -1, dtype=torch.int32)
    if first:
        sink[:, 0] = 0
    rec = encode_records(
        kt.reshape(-1, g, d), vt.reshape(-1, g, d), layout, sink_rows=sink.flatten()
    )
    kq, vq = decode_records(rec, layout)
    kq = hadamard(kq).view(b, tiles, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, n, d)
    vq = hadamard(vq).view(b, tiles, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, n, d)
    return rec.view(b, tiles, hkv, -1), kq, vq


@pytest.mark.parametrize(
    ("fmt", "d", "dtype"),
    [("kvarn_k4v2_g64", 64, torch.float32), ("kvarn_k2v4_g32", 128, torch.bfloat16)],
)
def test_updates_return_packed_tiles_dequantized_and_the_rest_exact(fmt, d, dtype):
    torch.manual_seed(0)
    layer = KvarnLayer(fmt)
    layout = kf.dense_layout(kf.parse_format(fmt), d)
    g = layout.block_size
    b, hkv = 2, 3
    seen_k = torch.empty(b, hkv, 0, d, dtype=dtype)
    seen_v = torch.empty(b, hkv, 0, d, dtype=dtype)
    packed = 0  # tokens of seen_* in records
    for t in (g + 7, 1, 1, g - 9, 2 * g + 3, 1):
        k = (torch.randn(b, hkv, t, d) * 3 + 0.5).to(dtype)
        v = torch.randn(b, hkv, t, d).to(dtype)
        keys, values = layer.update(k, v)
        seen_k, seen_v = torch.cat((seen_k, k), 2), torch.cat((seen_v, v), 2)
        # what the call's queries see: tiles packed before it dequantized, the rest exact
        rec, kq, vq = _expected_tiles(seen_k[:, :, :packed], seen_v[:, :, :packed], layout, True)
        assert torch.equal(keys, torch.cat((kq.to(dtype), seen_k[:, :, packed:]), 2))
        assert torch.equal(values, torch.cat((vq.to(dtype), seen_v[:, :, packed:]), 2))
        packed = seen_k.shape[2] // g * g
        rec, _, _ = _expected_tiles(seen_k[:, :, :packed], seen_v[:, :, :packed], layout, True)
        assert torch.equal(layer.records, rec)  # byte for byte the reference's records
        assert torch.equal(layer.keys, seen_k[:, :, packed:])
        assert layer.get_seq_length() == seen_k.shape[2]
        exact_bytes = 2 * layer.keys.numel() * layer.keys.element_size()
        assert layer.nbytes() == (packed // g) * b * hkv * layout.record_bytes + exact_bytes
    assert not torch.equal(kq.to(dtype), seen_k[:, :, : kq.shape[2]])  # really quantized


def test_kernel_backend_updates_return_its_records_dequantized_and_the_rest_exact():
    """``backend="kernels"`` (the Triton ops, here under the interpreter): each call returns
    the records packed before it through one ``materialize`` and the rest exact; the records
    packed over irregular updates are the bytes of packing the whole stream at once (the
    codec's tests compare those with the reference's)."""
    torch.manual_seed(2)
    fmt, d, dtype = "kvarn_k4v2_g32", 64, torch.bfloat16
    layer = KvarnLayer(fmt, backend="kernels")
    layout = kf.dense_layout(kf.parse_format(fmt), d)
    g = layout.block_size
    b, hkv = 2, 2
    seen_k = torch.empty(b, hkv, 0, d, dtype=dtype)
    seen_v = torch.empty(b, hkv, 0, d, dtype=dtype)
    packed = 0
    for t in (g + 5, 1, g - 6, 2 * g + 1):
        k = (torch.randn(b, hkv, t, d) * 3 + 0.5).to(dtype)
        v = torch.randn(b, hkv, t, d).to(dtype)
        before = layer.records.clone() if layer.records is not None else None
        keys, values = layer.update(k, v)
        assert layer.backend == "kernels"
        seen_k, seen_v = torch.cat((seen_k, k), 2), torch.cat((seen_v, v), 2)
        if before is not None and before.shape[1]:
            kq, vq = cc.decode_tiles(before, layout, dtype, "kernels")
            assert torch.equal(keys[:, :, :packed], kq) and torch.equal(values[:, :, :packed], vq)
        assert torch.equal(keys[:, :, packed:], seen_k[:, :, packed:])
        assert torch.equal(values[:, :, packed:], seen_v[:, :, packed:])
        packed = seen_k.shape[2] // g * g
        whole = cc.encode_tiles(seen_k[:, :, :packed], seen_v[:, :, :packed], layout, True,
                                "kernels")  # fmt: skip
        assert torch.equal(layer.records, whole)
    assert not torch.equal(kq, seen_k[:, :, : kq.shape[2]])  # really quantized


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.mark.parametrize("fmt", ["kvarn_k4v2_g64", "kvarn_k2v2_g64"])
def test_model_fed_in_tiles_scores_as_the_harness(tiny_dir, fmt):
    from transformers import AutoModelForCausalLM

    ids, _ = default_token_ids()
    ids = ids[:320]
    harness = Harness(tiny_dir, ids, gen_tokens=0)
    want = harness._forward_nll(att.EvalState(variant=make_variant("kvarn", fmt)))
    exact = harness._forward_nll(att.EvalState(variant=None))
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    cache = KvarnCache(fmt, model.config)
    t = torch.tensor([ids])
    nll = []
    with torch.no_grad():
        for s in range(0, t.shape[1], 64):
            step = {_cache_kwarg(model): cache}
            logits = model(input_ids=t[:, s : s + 64], **step).logits[0].float()
            tgt = t[0, s + 1 : s + 65]
            logits = logits[: tgt.numel()]
            nll.append(torch.logsumexp(logits, -1) - logits.gather(1, tgt[:, None])[:, 0])
    got = torch.cat(nll).double()
    assert torch.equal(got, want)
    assert (want - exact).abs().max() > 0.05  # the quantization shows
    layout = kf.dense_layout(kf.parse_format(fmt), 64)
    per_layer = 5 * model.config.num_key_value_heads * layout.record_bytes
    assert cache.nbytes() == model.config.num_hidden_layers * per_layer  # 320 = 5 tiles


def test_reorder_and_batch_selection_move_records_with_their_rows():
    torch.manual_seed(1)
    layer = KvarnLayer("kvarn_k4v2_g32")
    k, v = torch.randn(3, 2, 40, 64), torch.randn(3, 2, 40, 64)
    layer.update(k, v)
    layer.reorder_cache(torch.tensor([2, 0, 0]))
    twin = KvarnLayer("kvarn_k4v2_g32")  # the same rows given in that order
    twin.update(k[[2, 0, 0]], v[[2, 0, 0]])
    k2, v2 = torch.randn(3, 2, 30, 64), torch.randn(3, 2, 30, 64)
    got, want = layer.update(k2, v2), twin.update(k2, v2)
    assert torch.equal(layer.records, twin.records) and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.records[1], twin.records[0]) and layer.records.shape[0] == 6
    layer.batch_select_indices(torch.tensor([5]))
    assert torch.equal(layer.records[0], twin.records[2])
    assert torch.equal(layer.keys[0], twin.keys[2])


def _cache_kwarg(model) -> str:
    """transformers 5.25 renamed ``past_key_values`` to ``cache``; older 5.x has the former."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def test_bad_input_names_the_argument():
    cfg = SimpleNamespace(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    cfg.get_text_config = lambda decoder=True: cfg
    with pytest.raises(ValueError, match="format_name: .* is an MLA format"):
        KvarnCache("kvarn_mla_k4_g64", cfg)
    with pytest.raises(ValueError, match="format_name: unknown"):
        KvarnCache("kvarn_k4v2", cfg)
    slide = SimpleNamespace(
        num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]
    )
    slide.get_text_config = lambda decoder=True: slide
    with pytest.raises(ValueError, match="config: .*sliding_attention"):
        KvarnCache("kvarn_k4v2_g64", slide)
    layer = KvarnLayer("kvarn_k4v2_g64")
    x = torch.randn(1, 2, 3, 80)
    with pytest.raises(ValueError, match="key_states: head_dim 80"):
        layer.update(x, x)
    layer = KvarnLayer("kvarn_k4v2_g64")
    x = torch.randn(1, 2, 3, 64)
    with pytest.raises(ValueError, match="key_states, value_states: expected the same"):
        layer.update(x, x[..., :32])
    with pytest.raises(ValueError, match="one floating dtype"):
        layer.update(x, x.half())
    layer.update(x, x)
    with pytest.raises(ValueError, match="differ from the cache's"):
        layer.update(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))
    with pytest.raises(ValueError, match="cannot be cropped"):
        layer.crop(-1)
    with pytest.raises(ValueError, match="^backend: expected one of"):
        KvarnCache("kvarn_k4v2_g64", cfg, backend="cuda")
    with pytest.raises(ValueError, match="^backend: expected one of"):
        KvarnLayer("kvarn_k4v2_g64", backend="")
    with pytest.raises(ValueError, match="^key_states: backend='kernels' takes bfloat16"):
        KvarnLayer("kvarn_k4v2_g64", backend="kernels").update(x, x)


def _tiny_bf16_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rope_theta=1e5,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)  # attention far from uniform, so the cache's error shows
    return model.to(torch.bfloat16).eval()


def _step_logits(model, cache, ids, prompt):
    """Logits of a prompt call, then of one call per further token (teacher forced)."""
    kw = _cache_kwarg(model)
    out = []
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :prompt], **{kw: cache}).logits[:, -1:].float())
        for s in range(prompt, ids.shape[1] - 1):
            out.append(model(input_ids=ids[:, s : s + 1], **{kw: cache}).logits.float())
    return torch.cat(out, 1)


def test_kvarn_attention_decodes_from_the_records():
    """``model.set_attn_implementation("kvarn")``: one-token steps run ``kvarn_ops.decode``
    over the records and the rotated pool. Against the same cache read through SDPA (the
    kernels backend, dequantized context): the logits agree within a tenth of the
    quantization's own effect, except at the step whose token completes a tile, which the
    serving order reads quantized (packed before the query) and the dequantizing cache exact
    (and after it, where layer 1's last tile holds K/V computed at that step)."""
    from transformers import DynamicCache

    model = _tiny_bf16_llama()
    fmt, g, prompt = "kvarn_k4v2_g32", 32, 60
    ids = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("kvarn")
    packed_cache = KvarnCache(fmt, model.config)
    assert packed_cache.packed_decode and packed_cache.layers[0].packed_decode
    calls = []
    real = KvarnLayer.attend
    KvarnLayer.attend = lambda self, q, s: calls.append(1) or real(self, q, s)  # type: ignore
    try:
        packed = _step_logits(model, packed_cache, ids, prompt)
    finally:
        KvarnLayer.attend = real  # type: ignore
    assert len(calls) == 2 * (ids.shape[1] - 1 - prompt)  # every one-token step, each layer
    model.set_attn_implementation("sdpa")
    deq_cache = KvarnCache(fmt, model.config, backend="kernels")
    assert not deq_cache.packed_decode
    deq = _step_logits(model, deq_cache, ids, prompt)
    exact = _step_logits(model, DynamicCache(config=model.config), ids, prompt)
    # layer 0's K/V come from the embeddings alone: the same tiles, packed the same way
    assert torch.equal(packed_cache.layers[0].records, deq_cache.layers[0].records)
    gap = (packed - deq).abs().amax(-1)  # [B, steps]; column j: the query at token prompt-1+j
    effect = (deq - exact).abs().amax(-1)
    completes = [j for j in range(gap.shape[1]) if (prompt + j) % g == 0]
    assert completes == [4]  # token 63 fills the second tile
    before, after = gap[:, 1:4], gap[:, 5:]
    scale = effect[:, 1:].median()
    print("gap", gap.tolist(), "effect", effect.tolist())
    # before the tile completes: the same cache contents, only the arithmetic differs
    assert before.max() < 0.1 * scale
    # the completing token reads its tile quantized in the serving order
    assert gap[:, 4].min() > 2 * before.max()
    # after it, layer 1's tile holds K/V computed from that step: a part of the effect
    assert after.max() < 0.25 * scale


def test_kvarn_attention_of_one_step_against_the_reference_decode():
    """A layer's ``attend`` equals ``reference.decode`` (fp64) over the layer's own records,
    block table and pool, within ``test_decode``'s bound."""
    from kvarn_ops import reference

    torch.manual_seed(7)
    fmt, d = "kvarn_k4v2_g32", 64
    layer = KvarnLayer(fmt, packed_decode=True)
    b, hkv, hq = 2, 2, 8
    layer.update(torch.randn(b, hkv, 45, d).bfloat16(), torch.randn(b, hkv, 45, d).bfloat16())
    for _ in range(3):
        h, _v = layer.update(
            torch.randn(b, hkv, 1, d).bfloat16(), torch.randn(b, hkv, 1, d).bfloat16()
        )
        assert h._kvarn_layer is layer
    q = torch.randn(b, hq, 1, d).bfloat16()
    got = layer.attend(q, d**-0.5)
    lay = layer.layout
    tiles = layer.records.shape[1]
    assert tiles == 48 // 32 and layer.cumulative_length == 48
    args = dict(
        packed=layer.records.view(b * tiles, hkv, -1),
        block_table=torch.arange(b * tiles, dtype=torch.int32).view(b, tiles),
        seq_lens=torch.full((b,), 48, dtype=torch.int32), exact_k=layer.decoder.pool_k,
        exact_v=layer.decoder.pool_v, k_scale=None, v_scale=None,
        tail_pool_block=torch.arange(b, dtype=torch.int32), layout=lay, softmax_scale=d**-0.5,
    )  # fmt: skip
    qm = q.transpose(1, 2).contiguous()
    want = torch.empty(b, 1, hq, d, dtype=torch.float32)
    reference.decode(qm, **args, out=want, workspace=None, compute_dtype=torch.float64)
    assert got.shape == (b, 1, hq, d) and got.dtype == torch.bfloat16
    # the decode tests' bound: twice the error of the kernel's operand roundings emulated, plus
    # the bf16 output's rounding
    base = emulated_error(qm, dict(q=qm, **args), want.double())
    tol = ERR_FACTOR * base + ATOL[torch.bfloat16] * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= tol
    # the pool holds the filling tile's 16 tokens rotated, in each row's block
    kx = reference.hadamard(layer.keys.float()).to(torch.bfloat16)  # [B, Hkv, 16, D]
    assert layer.keys.shape[2] == 16
    pooled = layer.decoder.pool_k[:, :16].transpose(1, 2)
    assert (pooled.float() - kx.float()).abs().max() <= 2.0**-7 * kx.float().abs().max()


def test_kvarn_attention_falls_back_to_sdpa_for_a_padded_batch_and_refuses_misuse():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvarn_ops.transformers_decode import kvarn_attention_forward

    torch.manual_seed(8)
    layer = KvarnLayer("kvarn_k4v2_g32", packed_decode=True)
    x = torch.randn(1, 2, 40, 64).bfloat16()
    layer.update(x, x)
    hk, hv = layer.update(x[:, :, :1], x[:, :, :1])
    q = torch.randn(1, 4, 1, 64).bfloat16()
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    mask = torch.ones(1, 1, 1, 41, dtype=torch.bool)
    mask[..., :3] = False  # three pad tokens
    got, _ = kvarn_attention_forward(module, q, hk, hv, mask, scaling=0.125)
    k_all, v_all = layer.full_kv()
    want, _ = sdpa_attention_forward(module, q, k_all, v_all, mask, scaling=0.125)
    assert torch.equal(got, want)
    unpadded, _ = kvarn_attention_forward(module, q, hk, hv, None, scaling=0.125)
    assert torch.equal(unpadded, layer.attend(q, 0.125))
    with pytest.raises(ValueError, match="^dropout"):
        kvarn_attention_forward(module, q, hk, hv, None, dropout=0.1)
    with pytest.raises(ValueError, match="^query: this KvarnLayer was not built"):
        KvarnLayer("kvarn_k4v2_g32").attend(q, 0.125)
    with pytest.raises(ValueError, match="^backend: 'reference' cannot serve"):
        KvarnLayer("kvarn_k4v2_g32", backend="reference", packed_decode=True)
    model = _tiny_bf16_llama(layers=1)
    model.set_attn_implementation("kvarn")
    with pytest.raises(ValueError, match="^backend: 'reference' cannot serve"):
        KvarnCache("kvarn_k4v2_g32", model.config, backend="reference")
    cache = KvarnCache("kvarn_k4v2_g32", model.config)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="^config: the model's attention implementation changed"):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), **{_cache_kwarg(model): cache})


def test_kvarn_attention_from_a_one_token_prompt_and_after_beam_reorder():
    """A one-token first call (no record yet) and a beam reorder: each step equals the
    reference decode of the layer's own state."""
    from kvarn_ops import reference

    torch.manual_seed(9)
    d, b, hkv, hq = 64, 3, 1, 2
    layer = KvarnLayer("kvarn_k4v2_g32", packed_decode=True)
    lay = kf.dense_layout("kvarn_k4v2_g32", d)

    def check(q):
        got = layer.attend(q, 0.125)
        n = layer.cumulative_length
        tiles = layer.records.shape[1]
        if tiles:
            packed = layer.records.view(b * tiles, hkv, -1)
        else:
            packed = torch.zeros(1, hkv, lay.record_bytes, dtype=torch.uint8)
        table = torch.arange(b * max(tiles, 1), dtype=torch.int32).view(b, -1)
        args = dict(
            packed=packed, block_table=table, seq_lens=torch.full((b,), n, dtype=torch.int32),
            exact_k=layer.decoder.pool_k, exact_v=layer.decoder.pool_v, k_scale=None,
            v_scale=None, tail_pool_block=torch.arange(b, dtype=torch.int32), layout=lay,
            softmax_scale=0.125,
        )  # fmt: skip
        qm = q.transpose(1, 2).contiguous()
        want = torch.empty(b, 1, hq, d)
        reference.decode(qm, **args, out=want, workspace=None, compute_dtype=torch.float64)
        base = emulated_error(qm, dict(q=qm, **args), want.double())
        tol = ERR_FACTOR * base + ATOL[torch.bfloat16] * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol

    for i in range(34):  # crosses the first tile
        x = torch.randn(b, hkv, 1, d).bfloat16()
        layer.update(x, x * 0.5)
        if i in (0, 31):  # the first token alone; the token that completes the tile
            check(torch.randn(b, hq, 1, d).bfloat16())
    check(torch.randn(b, hq, 1, d).bfloat16())
    layer.reorder_cache(torch.tensor([2, 2, 0]))
    x = torch.randn(b, hkv, 1, d).bfloat16()
    layer.update(x, x)
    check(torch.randn(b, hq, 1, d).bfloat16())
    # rows 0 and 1 are now the same beam: the same records and the same first two pool rows
    # (the third, this step's token, differs)
    assert torch.equal(layer.records[0], layer.records[1])
    assert torch.equal(layer.decoder.pool_k[0, :2], layer.decoder.pool_k[1, :2])
    assert not torch.equal(layer.decoder.pool_k[0, 2], layer.decoder.pool_k[1, 2])
