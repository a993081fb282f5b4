"""``KvarnCache(backend="kernels")`` and its codec (``kvarn_ops.cache_codec``) on a GPU.

- encode: the kernels' records of each tile against the reference's records of the same
  bf16/fp16 pool (``test_dense_parity._check_flush``: codes >= 99.9% identical, the decoded
  error within 1% of the reference's), the sink's V row in each row's first tile;
- decode: one ``materialize`` against the reference's decode of the same records (one
  rounding to the output dtype, fp32 sums in another order: 2^-8 / 2^-10 relative plus 1e-5
  of the largest magnitude, as the materialize parity);
- a layer fed in irregular updates returns its earlier records dequantized and the rest
  exact, and its records are the bytes of packing the whole stream at once;
- a random-weight Llama (bf16) fed a sequence in 64-token chunks: the kernels backend's
  per-token NLL stays within a tenth of the quantization's own effect of the reference
  backend's (both pack the same bf16 rotated tiles; a wrong tile order, sink or frame would
  move it by the whole effect or more);
- the ``"kvarn"`` attention's decode steps (``kvarn_ops.decode`` over the records) against the
  same cache read through SDPA.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from gpu_support import DEVICE, realistic_kv
from test_dense_parity import _check_flush

import kvarn_formats as kf
from kvarn_ops import cache_codec as cc
from kvarn_ops import reference

transformers = pytest.importorskip("transformers")
from kvarn_ops.transformers_cache import KvarnCache, KvarnLayer  # noqa: E402

EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


def _stream(gen, b, hkv, n, d, dtype):
    k = realistic_kv(gen, (b * n, hkv, d)).view(b, n, hkv, d).transpose(1, 2)
    v = realistic_kv(gen, (b * n, hkv, d)).view(b, n, hkv, d).transpose(1, 2)
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


CASES = [
    # (format, D, B, Hkv, tiles, dtype)
    ("kvarn_k4v2_g64", 128, 3, 8, 5, torch.bfloat16),
    ("kvarn_k2v2_g64", 64, 2, 3, 4, torch.float16),
    ("kvarn_k4v4_g128", 128, 2, 2, 3, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[5])[6:]}")
def test_codec_kernels_against_reference(gen, request, case):
    fmt, d, b, hkv, tiles, dtype = case
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    k, v = _stream(gen, b, hkv, tiles * g, d, dtype)
    got = cc.encode_tiles(k, v, lay, True, "kernels").reshape(b * tiles, hkv, -1)
    # the reference's records of the same pool: tile t of row b is pool block b * tiles + t
    pool = torch.empty((b * tiles, g, hkv, d), dtype=dtype, device=DEVICE)
    pool_v = torch.empty_like(pool)
    slots = torch.arange(b * tiles * g, device=DEVICE)
    reference.store(k.transpose(1, 2).reshape(-1, hkv, d), v.transpose(1, 2).reshape(-1, hkv, d),
                    slots, pool, pool_v)  # fmt: skip
    blocks = torch.arange(b * tiles, dtype=torch.int32, device=DEVICE)
    sink = torch.full((b, tiles), -1, dtype=torch.int32, device=DEVICE)
    sink[:, 0] = 0
    want = torch.empty_like(got)
    reference.flush(pool, pool_v, None, None, blocks, blocks, want, lay, sink_rows=sink.flatten())
    sink_tiles = (sink.flatten() >= 0).repeat_interleave(hkv)
    _check_flush(request, got, want, blocks, blocks, lay, (pool, pool_v, None, None),
                 sink_tiles=sink_tiles)  # fmt: skip
    dk, dv = cc.decode_tiles(got.view(b, tiles, hkv, -1), lay, dtype, "kernels")
    rk, rv = cc.decode_tiles(got.view(b, tiles, hkv, -1), lay, torch.float32, "reference")
    for x, y in ((dk, rk), (dv, rv)):
        assert x.shape == (b, hkv, tiles * g, d) and x.dtype == dtype
        bound = EPS[dtype] * y.abs() + 1e-5 * y.abs().max()
        assert bool(((x.float() - y).abs() <= bound).all()), float((x.float() - y).abs().max())


def test_layer_updates_on_gpu(gen):
    fmt, d, dtype = "kvarn_k4v2_g64", 128, torch.bfloat16
    layer = KvarnLayer(fmt)  # auto: the kernels for bf16 on CUDA
    lay = kf.dense_layout(fmt, d)
    g = lay.block_size
    b, hkv = 2, 4
    seen_k = torch.empty(b, hkv, 0, d, dtype=dtype, device=DEVICE)
    seen_v = torch.empty_like(seen_k)
    packed = 0
    for t in (g + 5, 1, 1, g - 7, 3 * g + 1, 1):
        k, v = _stream(gen, b, hkv, t, d, dtype)
        before = layer.records.clone() if layer.records is not None else None
        keys, values = layer.update(k, v)
        assert layer.backend == "kernels"
        seen_k, seen_v = torch.cat((seen_k, k), 2), torch.cat((seen_v, v), 2)
        if packed:
            kq, vq = cc.decode_tiles(before, lay, dtype, "kernels")
            assert torch.equal(keys[:, :, :packed], kq) and torch.equal(values[:, :, :packed], vq)
        assert torch.equal(keys[:, :, packed:], seen_k[:, :, packed:])
        assert torch.equal(values[:, :, packed:], seen_v[:, :, packed:])
        packed = seen_k.shape[2] // g * g
        whole = cc.encode_tiles(seen_k[:, :, :packed], seen_v[:, :, :packed], lay, True, "kernels")
        assert torch.equal(layer.records, whole)
    assert layer.records.shape[1] == packed // g


def _random_llama(gen, hidden, heads, kv_heads):
    """A 3-layer random Llama (head_dim 128), bf16 on the GPU, its projections scaled up so
    attention is far from uniform and the cache's error shows."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=DEVICE)))
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
        max_position_embeddings=4096, rope_theta=1e5,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    return model.to(DEVICE, torch.bfloat16).eval(), cfg


def test_model_nll_kernels_against_reference_backend(gen):
    model, cfg = _random_llama(gen, 256, 8, 2)
    ids = torch.randint(0, cfg.vocab_size, (2, 448), device=DEVICE)

    # transformers 5.25 renamed the forward's ``past_key_values`` to ``cache``
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def nll(cache):
        out = []
        with torch.no_grad():
            for s in range(0, ids.shape[1], 64):
                step = {kw: cache, "use_cache": True}
                logits = model(input_ids=ids[:, s : s + 64], **step).logits.float()
                tgt = ids[:, s + 1 : s + 65]
                logits = logits[:, : tgt.shape[1]]
                lse = torch.logsumexp(logits, -1)
                out.append(lse - logits.gather(2, tgt[..., None])[..., 0])
        return torch.cat(out, 1)

    exact = nll(transformers.DynamicCache(config=cfg))
    ref_nll = nll(KvarnCache("kvarn_k4v2_g64", cfg, backend="reference"))
    ker_cache = KvarnCache("kvarn_k4v2_g64", cfg, backend="kernels")
    ker_nll = nll(ker_cache)
    effect = (ref_nll - exact).abs().mean().item()
    gap = (ker_nll - ref_nll).abs().mean().item()
    print(f"quantization effect {effect:.4f}, kernels vs reference {gap:.4f}")
    assert effect > 0.01  # the quantization shows
    assert gap < 0.1 * effect
    rec = kf.dense_layout("kvarn_k4v2_g64", 128).record_bytes
    # 448 tokens in 64-token calls: all 7 tiles packed, nothing exact left
    assert ker_cache.nbytes() == cfg.num_hidden_layers * 2 * 7 * cfg.num_key_value_heads * rec


def test_kvarn_attention_on_gpu(gen):
    """The ``"kvarn"`` attention (decode steps through ``kvarn_ops.decode`` over the records)
    against the same cache read through SDPA (kernels backend): a random Llama with
    Llama-3.1-8B's attention geometry (GQA 4, head_dim 128), bf16, two rows, a 250-token
    prompt then 12 one-token steps (token 255 completes a tile). Before the completing step the
    logits agree within a tenth of the quantization's own effect; at it the serving order
    reads the tile quantized; after it within a quarter (layer 2's tile holds K/V from that
    step). Every step's attention went through the decode kernel."""
    model, cfg = _random_llama(gen, 512, 16, 4)
    ids = torch.randint(0, cfg.vocab_size, (2, 263), device=DEVICE, generator=gen)
    prompt = 250
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(cache):
        out = []
        with torch.no_grad():
            step = {kw: cache, "use_cache": True}
            out.append(model(input_ids=ids[:, :prompt], **step).logits[:, -1:].float())
            for s in range(prompt, ids.shape[1] - 1):
                out.append(model(input_ids=ids[:, s : s + 1], **step).logits.float())
        return torch.cat(out, 1)

    calls = []
    real = KvarnLayer.attend
    KvarnLayer.attend = lambda self, q, s: calls.append(1) or real(self, q, s)
    try:
        model.set_attn_implementation("kvarn")
        packed_cache = KvarnCache("kvarn_k4v2_g64", cfg)
        assert packed_cache.packed_decode
        packed = run(packed_cache)
    finally:
        KvarnLayer.attend = real
    assert len(calls) == 3 * (ids.shape[1] - 1 - prompt)
    model.set_attn_implementation("sdpa")
    deq = run(KvarnCache("kvarn_k4v2_g64", cfg, backend="kernels"))
    exact = run(transformers.DynamicCache(config=cfg))
    gap = (packed - deq).abs().amax(-1)
    effect = (deq - exact).abs().amax(-1)
    scale = effect[:, 1:].median()
    j = 256 - prompt  # the query of token 255, which completes the fourth tile
    print(f"effect {scale:.4f}, gaps {gap.tolist()}")
    assert scale > 0.05
    assert gap[:, 1:j].max() < 0.1 * scale
    assert gap[:, j].min() > 2 * gap[:, 1:j].max()
    assert gap[:, j + 1 :].max() < 0.25 * scale
