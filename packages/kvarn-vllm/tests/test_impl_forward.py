"""The impl on hand-made batches: store, pack, decode and prefill against plain attention
over what the cache holds, and decode == prefill for the same positions."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest

from conftest import needs_vllm
from kvarn_vllm import settings as kv_settings
from kvarn_vllm.exact_pool import ExactPoolAllocator
from kvarn_vllm.metadata import plan_step

pytestmark = needs_vllm

HQ, HKV, D, G = 4, 2, 64, 64
FMT = "kvarn_k4v4_g64"


@pytest.fixture
def make_impl(monkeypatch):
    import torch

    import kvarn_vllm.impl as impl_mod

    config = NS(
        model_config=NS(dtype=torch.float32, hf_text_config=None),
        cache_config=NS(block_size=G, kv_cache_dtype_skip_layers=[]),
        device_config=NS(device="cpu"),
        scheduler_config=NS(max_num_seqs=4, max_num_batched_tokens=256),
        parallel_config=NS(),
        kv_transfer_config=None,
        speculative_config=None,
    )
    monkeypatch.setattr(impl_mod, "get_current_vllm_config", lambda: config)
    kv_settings.reset_for_tests()
    kv_settings.activate(kv_settings.Settings(FMT, "float16", "test"))

    def make(d=D):
        impl = impl_mod.KvarnAttentionImpl(HQ, d, 1 / math.sqrt(d), HKV)
        rec = impl.layout.record_bytes
        cache = torch.zeros(16, HKV, 1, rec // 4, dtype=torch.float32)
        alloc = ExactPoolAllocator(impl_mod.pool_size(config, G))
        return impl, cache, alloc

    yield make
    kv_settings.reset_for_tests()


def _step(impl, cache, alloc, reqs, q, k, v, d=D, plans=None):
    """reqs: list of (computed, total, block ids); q/k/v rows in request order. The step's
    metadata is appended to ``plans`` when given."""
    import torch

    qsl = [0]
    for c, t, _ in reqs:
        qsl.append(qsl[-1] + t - c)
    width = max(len(b) for _, _, b in reqs)
    bt = torch.tensor([b + [0] * (width - len(b)) for _, _, b in reqs], dtype=torch.int32)
    md = plan_step(alloc, G, qsl, [t for _, t, _ in reqs], bt, qsl[-1], torch.device("cpu"))
    if plans is not None:
        plans.append(md)
    out = torch.full((qsl[-1], HQ, d), float("nan"))
    impl.forward(None, q, k, v, cache, md, out)
    assert torch.isfinite(out).all()  # every row written
    return out


def _oracle(impl, cache, alloc, blocks, pos, q_row, k_hist, v_hist):
    """Plain attention of position ``pos``: packed full blocks (< (pos+1)//G) dequantized
    from the cache bytes, own-block rows from history rounded like the fp16 pool."""
    import torch

    import kvarn_ops.reference as ref

    n_full = (pos + 1) // G
    lay = impl.layout
    packed = impl.packed_view(cache)
    kq, vq = [], []
    if n_full:
        recs = packed[torch.tensor(blocks[:n_full])].reshape(n_full * HKV, -1)
        kd, vd = ref.decode_records(recs, lay)  # rotated frame [n*Hkv, G, D]
        kd = kd.view(n_full, HKV, G, D).permute(0, 2, 1, 3).reshape(-1, HKV, D)
        vd = vd.view(n_full, HKV, G, D).permute(0, 2, 1, 3).reshape(-1, HKV, D)
        kq, vq = [ref.hadamard(kd)], [ref.hadamard(vd)]

    def rounded(x):
        return ref.hadamard(ref.hadamard(x.float()).half().float())

    ks = torch.cat([*kq, rounded(k_hist[n_full * G : pos + 1])])
    vs = torch.cat([*vq, rounded(v_hist[n_full * G : pos + 1])])
    return ref.attention_oracle(q_row[None], ks, vs, impl.scale)[0].float()


def test_prefill_decode_and_continuation_match_oracle(make_impl):
    import torch

    torch.manual_seed(0)
    impl, cache, alloc = make_impl()
    blocks = {0: [3, 7], 1: [4], 2: [12]}
    hist = {
        r: (torch.randn(200, HKV, D), torch.randn(200, HKV, D), torch.randn(200, HQ, D))
        for r in (0, 1, 2)
    }

    def run(reqs):
        rows = [(r, p) for r, c, t in reqs for p in range(c, t)]
        q = torch.stack([hist[r][2][p] for r, p in rows])
        k = torch.stack([hist[r][0][p] for r, p in rows])
        v = torch.stack([hist[r][1][p] for r, p in rows])
        out = _step(impl, cache, alloc, [(c, t, blocks[r]) for r, c, t in reqs], q, k, v)
        for i, (r, p) in enumerate(rows):
            want = _oracle(impl, cache, alloc, blocks[r], p, hist[r][2][p], hist[r][0], hist[r][1])
            torch.testing.assert_close(out[i], want, atol=2e-3, rtol=2e-3)

    run([(0, 0, 70), (1, 0, 5)])  # fresh prompts; block 3 fills and is packed
    run([(0, 70, 71), (1, 5, 6)])  # decode
    blocks[1].append(9)
    run([(1, 6, 100), (0, 71, 72)])  # continuation across a block boundary + a decode
    # decode rows split by a prompt (the decode batch's rows as an index tensor, its output
    # scattered), then a decode-only step (rows as a slice, output written in place)
    run([(0, 72, 73), (2, 0, 30), (1, 100, 101)])
    run([(0, 73, 74), (2, 30, 31), (1, 101, 102)])


def test_first_block_flush_keeps_the_sink_row(make_impl):
    """A request's first block is flushed with its token 0 marked as the attention sink (the
    record equals the reference flush's with ``sink_rows`` 0, and not the one without), later
    blocks without a mark; the sink's V row decodes far closer to the pool's."""
    import torch

    import kvarn_ops.reference as ref

    torch.manual_seed(3)
    impl, cache, alloc = make_impl()
    n = 2 * G + 3
    k, v, q = torch.randn(n, HKV, D), torch.randn(n, HKV, D), torch.randn(n, HQ, D)
    v[0] *= 0.1  # a sink's small value vector
    plans = []
    _step(impl, cache, alloc, [(0, n, [3, 7, 9])], q, k, v, plans=plans)
    md = plans[0]
    assert md.flush_dst.tolist() == [3, 7] and md.flush_sink.tolist() == [0, -1]
    packed = impl.packed_view(cache)
    pools = (impl.exact_k, impl.exact_v, impl.k_scale, impl.v_scale)
    want = torch.zeros_like(packed)
    plain = torch.zeros_like(packed)
    ref.flush(*pools, md.flush_src, md.flush_dst, want, impl.layout, sink_rows=md.flush_sink)
    ref.flush(*pools, md.flush_src, md.flush_dst, plain, impl.layout)
    assert torch.equal(packed[3], want[3]) and torch.equal(packed[7], want[7])
    assert not torch.equal(packed[3], plain[3]) and torch.equal(packed[7], plain[7])
    _, vd = ref.decode_records(packed[3].reshape(HKV, -1), impl.layout)
    _, vp = ref.decode_records(plain[3].reshape(HKV, -1), impl.layout)
    pool_v = ref.read_pool_blocks(impl.exact_v, impl.v_scale, md.flush_src[:1])[0, 0]  # token 0
    err = (vd[:, 0] - pool_v).norm() / pool_v.norm()
    assert float(err) < 0.5 * float((vp[:, 0] - pool_v).norm() / pool_v.norm())


@pytest.mark.parametrize("d", [64, 128])
def test_decode_equals_prefill_for_the_same_positions(make_impl, d):
    import torch

    torch.manual_seed(1)
    n = 140
    k, v, q = torch.randn(n, HKV, d), torch.randn(n, HKV, d), torch.randn(n, HQ, d)
    blocks = [2, 5, 11]
    impl_a, cache_a, alloc_a = make_impl(d)
    whole = _step(impl_a, cache_a, alloc_a, [(0, n, blocks)], q, k, v, d)
    impl_b, cache_b, alloc_b = make_impl(d)
    parts = [_step(impl_b, cache_b, alloc_b, [(0, 60, blocks)], q[:60], k[:60], v[:60], d)]
    for p in range(60, n):
        parts.append(
            _step(
                impl_b,
                cache_b,
                alloc_b,
                [(p, p + 1, blocks)],
                q[p : p + 1],
                k[p : p + 1],
                v[p : p + 1],
                d,
            )
        )
    torch.testing.assert_close(torch.cat(parts), whole, atol=2e-3, rtol=2e-3)
    # The packed records are the same bytes whichever way the tokens arrived.
    assert torch.equal(
        impl_a.packed_view(cache_a)[blocks[:2]], impl_b.packed_view(cache_b)[blocks[:2]]
    )


def test_profiling_run_without_metadata_returns_output(make_impl):
    import torch

    impl, cache, _ = make_impl()
    out = torch.zeros(3, HQ, D)
    assert impl.forward(None, out, out, out, cache, None, out) is out


def test_speculative_verify_runs_match_oracle(make_impl):
    """Verify runs of 1 + 3 drafts (decode with T = 4 when the run stays inside what one
    packed view serves, the prefill path when it fills a block before its last token), beside
    plain decodes, with drafts rejected and the requests continuing inside blocks that were
    packed with the rejected drafts: every query matches plain attention over what the cache
    holds for it."""
    import torch

    torch.manual_seed(2)
    impl, cache, _ = make_impl()
    alloc = ExactPoolAllocator(64, keep_packed=True)
    blocks = {0: [3, 7, 9], 1: [4, 10], 2: [5, 11]}
    cur = {r: [torch.empty(200, HKV, D), torch.empty(200, HKV, D)] for r in blocks}
    computed = dict.fromkeys(blocks, 0)
    routes = []

    def run(steps):
        """steps: (request, new tokens, tokens accepted afterwards)."""
        rows, reqs = [], []
        for r, n, _ in steps:
            c = computed[r]
            reqs.append((c, c + n, blocks[r]))
            for p in range(c, c + n):
                kv = torch.randn(2, HKV, D)  # fresh values: a draft differs from its redo
                cur[r][0][p], cur[r][1][p] = kv[0], kv[1]
                rows.append((r, p, torch.randn(HQ, D)))
        q = torch.stack([x[2] for x in rows])
        k = torch.stack([cur[r][0][p] for r, p, _ in rows])
        v = torch.stack([cur[r][1][p] for r, p, _ in rows])
        plans = []
        out = _step(impl, cache, alloc, reqs, q, k, v, plans=plans)
        routes.append(sorted(b.t for b in plans[0].decodes))
        for i, (r, p, qr) in enumerate(rows):
            want = _oracle(impl, cache, alloc, blocks[r], p, qr, cur[r][0], cur[r][1])
            torch.testing.assert_close(out[i], want, atol=2e-3, rtol=2e-3)
        for r, _, acc in steps:
            computed[r] += acc

    run([(0, 58, 58), (1, 20, 20), (2, 62, 62)])  # prompts
    run([(0, 4, 2), (1, 4, 4), (2, 1, 1)])  # verify 58..61, 20..23 (T=4), decode 62
    # 60..63 fills block 3 with drafts (prefill path), 3 rejected; decodes 24 and 63 (T=1)
    run([(0, 4, 1), (1, 1, 1), (2, 1, 1)])
    run([(0, 4, 4), (2, 4, 4)])  # 61..64: block 3 continued and packed again; 64..67 (T=4)
    run([(0, 4, 4), (1, 3, 3)])  # 65..68 (T=4), 25..27 (T=3)
    assert routes == [[], [1, 4], [1], [4], [3, 4]]
    # Block 3 was packed twice; its record now holds the accepted tokens.
    import kvarn_ops.reference as ref

    rec = impl.packed_view(cache)[3].reshape(HKV, -1)
    kd, _ = ref.decode_records(rec, impl.layout)
    want = ref.hadamard(cur[0][0][:G].transpose(0, 1).float())
    assert (kd - want).abs().max() < 0.25 * want.abs().max()


def test_model_gqa_from_the_model_config():
    """The builder's decode limit follows the model's query heads per KV head on this worker
    (Llama-3.1-405B on 8 GPUs: 16 query heads, one KV head)."""
    import kvarn_vllm.impl as impl_mod

    mc = NS(
        get_num_attention_heads=lambda pc: 128 // pc.tensor_parallel_size,
        get_num_kv_heads=lambda pc: max(1, 8 // pc.tensor_parallel_size),
    )
    assert impl_mod.model_gqa(NS(model_config=mc, parallel_config=NS(tensor_parallel_size=8))) == 16
    assert impl_mod.model_gqa(NS(model_config=NS(), parallel_config=NS())) == 1


def test_projection_views_give_the_same_cache_and_output(make_impl):
    """q/k/v as vLLM passes them (views into one fused QKV projection, rows at its stride):
    the same cache bytes, exact pool and output as from separate contiguous tensors."""
    import torch

    torch.manual_seed(3)
    n = 100
    qkv = torch.randn(n, (HQ + 2 * HKV) * D)
    q = qkv[:, : HQ * D].view(n, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(n, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(n, HKV, D)
    assert not k.is_contiguous()
    blocks = [1, 4]
    runs = []
    for args in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        impl, cache, alloc = make_impl()
        first = _step(impl, cache, alloc, [(0, 70, blocks)], *(x[:70] for x in args))
        rest = _step(impl, cache, alloc, [(70, n, blocks)], *(x[70:] for x in args))
        runs.append((torch.cat([first, rest]), cache.clone(), impl.exact_k.clone()))
    (out_a, cache_a, pool_a), (out_b, cache_b, pool_b) = runs
    assert torch.equal(out_a, out_b)
    # records compared as bits (their bytes seen as float32 include NaN patterns)
    bits_a, bits_b = cache_a.view(torch.int32), cache_b.view(torch.int32)
    assert torch.equal(bits_a, bits_b) and bool(bits_a.ne(0).any())
    assert torch.equal(pool_a.view(torch.int16), pool_b.view(torch.int16))


def test_decode_workspace_is_allocated_once_per_step(make_impl):
    """Every layer of a step decodes with the step's one workspace (the layers run in stream
    order); a new step (new metadata) gets a new one."""
    import torch

    impl, _, _ = make_impl()
    calls = []

    def workspace(*args, device):
        calls.append(args)
        return torch.empty(8, device=device)

    impl.ops.decode_workspace = workspace

    def step():  # a step's metadata: two requests decoding one token each
        bt = torch.zeros(2, 1, dtype=torch.int32)
        return plan_step(ExactPoolAllocator(8), G, [0, 1, 2], [1, 1], bt, 2, torch.device("cpu"))

    (batch,) = step().decodes
    qd = torch.zeros(2, 1, HQ, D)
    first = impl._decode_workspace(batch, qd)
    assert impl._decode_workspace(batch, qd) is first  # the next layer of the step
    assert len(calls) == 1 and calls[0][:5] == (2, 1, HQ, HKV, D)
    assert impl._decode_workspace(step().decodes[0], qd) is not first and len(calls) == 2
