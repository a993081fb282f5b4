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
