"""The MLA step plan (kvarn_vllm.mla_metadata.plan_mla_step) run literally on the reference ops:
what each query sees, and that a prompt gives the same attention output whether it is
prefilled at once, in chunks, or decoded token by token (the rule that makes prefix caching,
chunking and batching invisible)."""

from __future__ import annotations

import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm

G = 64
HEADS = 2


def _plan(manager, steps_q, seq_lens, blocks, num_decodes=0):
    from kvarn_vllm.mla_metadata import plan_mla_step

    qsl = [0]
    for q in steps_q:
        qsl.append(qsl[-1] + q)
    bt = torch.tensor(blocks, dtype=torch.int32)
    return plan_mla_step(manager, qsl, seq_lens, bt, num_decodes, 64, torch.device("cpu"))


def test_prefill_mask_follows_the_rule():
    from kvarn_vllm.mla_pool import MlaPoolManager

    mgr = MlaPoolManager(num_slots=8, num_blocks=64)
    step = _plan(mgr, [130], [130], [[5, 9, 7]])
    (req,) = step.prefills
    # keys: 2 full blocks read from tiles, then 3 touched blocks of exact rows
    assert req.mask.shape == (130, 2 * G + 3 * G)
    assert step.pack_blocks.tolist() == [5, 9]
    assert step.map_after[5] == -1 and step.map_exact[5] >= 0 and step.map_after[7] >= 0
    m = req.mask
    # p = 62: nothing full yet; own exact rows 0..62
    assert not m[62, : 2 * G].any() and m[62, 2 * G : 2 * G + 63].all() and not m[62, 2 * G + 63]
    # p = 63: block 0 is full once p is cached, so it is read from its tile, not exactly
    assert m[63, :G].all() and not m[63, G : 2 * G].any() and not m[63, 2 * G :].any()
    # p = 65: tile of block 0, exact rows 64..65 of block 1
    assert m[65, :G].all() and not m[65, G : 2 * G].any()
    assert m[65, 3 * G : 3 * G + 2].all() and not m[65, 3 * G + 2 :].any()
    blocks = [5, 9, 7]
    assert step.token_rows.tolist() == [mgr.slot_of(blocks[p // G]) * G + p % G for p in range(130)]
    slots = step.context_exact_slots.tolist()
    assert slots[: 2 * G] == [-1] * (2 * G)  # the full-block keys come from the tiles
    assert slots[4 * G + 2 :] == [-1] * (G - 2)  # rows past the prompt are not read


def test_decode_rows_must_have_one_token():
    from kvarn_vllm.mla_pool import MlaPoolManager

    mgr = MlaPoolManager(num_slots=8, num_blocks=64)
    with pytest.raises(ValueError, match="num_decodes"):
        _plan(mgr, [3], [3], [[4]], num_decodes=1)


class Runner:
    """One MLA layer's cache driven by plans, with latent-space attention (absorbed form)."""

    def __init__(
        self, fmt: str, latents: torch.Tensor, ropes: torch.Tensor, pool_dtype: torch.dtype
    ) -> None:
        import kvarn_formats as kf
        from kvarn_ops.reference import mla as ops
        from kvarn_vllm.mla_pool import MlaPoolManager

        self.ops, self.layout = ops, kf.mla_layout(fmt)
        self.mgr = MlaPoolManager(num_slots=16, num_blocks=64)
        self.packed = torch.zeros(64, self.layout.record_bytes, dtype=torch.uint8)
        self.lat = torch.zeros(16, G, 512, dtype=pool_dtype)
        self.scale = None
        if pool_dtype == torch.float8_e4m3fn:
            self.scale = torch.ones(16, G)
        self.rope = torch.zeros(16, G, 64, dtype=torch.bfloat16)
        self.latents, self.ropes = latents, ropes
        self.blocks = [11, 3, 20, 8, 30]
        self.done = 0

    def step(self, q_all: torch.Tensor, n: int, decode: bool) -> torch.Tensor:
        """Cache tokens [done, done + n) and return their attention outputs [n, H, 512]."""
        a, b = self.done, self.done + n
        step = _plan(self.mgr, [n], [b], [self.blocks], num_decodes=int(decode))
        pools = (self.lat, self.scale, self.rope)
        self.ops.mla_rehydrate(
            self.packed, step.rehydrate_blocks, step.rehydrate_slots, *pools, self.layout
        )
        self.ops.mla_exact_scatter(
            self.latents[a:b], self.ropes[a:b], step.token_rows, self.lat, self.rope, self.scale
        )
        self.ops.mla_pack(*pools, step.pack_slots, step.pack_blocks, self.packed, self.layout)
        self.done = b
        scale = 0.1
        if decode:
            out = torch.empty(1, HEADS, 512)
            self.ops.mla_decode(
                q_all[a:b],
                self.packed,
                step.decode_block_table,
                step.decode_seq_lens,
                step.map_after,
                *pools,
                self.layout,
                scale,
                out,
            )
            return out
        (req,) = step.prefills
        ctx = torch.zeros(req.mask.shape[1], 576, dtype=torch.bfloat16)
        for slots, rmap in (
            (step.context_full_slots, step.map_after),
            (step.context_exact_slots, step.map_exact),
        ):
            self.ops.mla_materialize(self.packed, rmap, *pools, slots, self.layout, ctx)
        kv = ctx.double()
        s = torch.einsum("qhd,kd->hqk", q_all[a:b].double(), kv) * scale
        s = s.masked_fill(~req.mask[None], float("-inf"))
        return torch.einsum("hqk,kd->qhd", torch.softmax(s, -1), kv[:, :512])


@pytest.mark.parametrize(
    ("fmt", "pool_dtype"),
    [
        ("kvarn_mla_k2_g64", torch.bfloat16),
        ("kvarn_mla_k4_g64", torch.bfloat16),
        ("kvarn_mla_k4_g64", torch.float8_e4m3fn),
    ],
)
def test_chunking_and_decoding_give_the_same_outputs(fmt, pool_dtype):
    torch.manual_seed(0)
    n = 200
    latents = torch.randn(n, 512) * torch.linspace(0.2, 3.0, 512)
    ropes = torch.randn(n, 64)
    q = torch.randn(n, HEADS, 576) * 0.3

    whole = Runner(fmt, latents, ropes, pool_dtype).step(q, n, decode=False)

    chunked = Runner(fmt, latents, ropes, pool_dtype)
    parts = [chunked.step(q, 70, decode=False), chunked.step(q, 60, decode=False)]
    parts += [chunked.step(q, 1, decode=True).double() for _ in range(130, n)]
    got = torch.cat(parts)

    # Prefill reads bf16-materialized keys, decode fp32-dequantized ones: same keys, same rule,
    # so outputs agree to bf16 rounding (a different rule would differ by the quantization
    # error, about 0.1 here at k4 and 0.4 at k2).
    err = (got - whole).abs().amax(dim=(1, 2)) / whole.abs().amax(dim=(1, 2))
    assert err[:130].max() < 1e-6, "prefill chunks disagree with one prefill"
    assert err.max() < 2e-2, f"decode disagrees with prefill: {err.max():.3g}"


def test_decode_workspace_is_allocated_once_per_step():
    """Every MLA layer of a step decodes with the step's one workspace per geometry (the
    layers run in stream order); another geometry, or the next step, gets its own."""
    from kvarn_vllm.mla_pool import MlaPoolManager

    calls = []

    def make(batch, heads, device):
        calls.append((batch, heads, device))
        return torch.empty(batch, heads, device=device)

    mgr = MlaPoolManager(num_slots=8, num_blocks=64)
    step = _plan(mgr, [3], [3], [[4]])
    cpu = torch.device("cpu")
    first = step.decode_workspace(make, 2, 16, cpu)
    assert step.decode_workspace(make, 2, 16, cpu) is first  # the next layer of the step
    assert calls == [(2, 16, cpu)]
    other = step.decode_workspace(make, 2, 128, cpu)
    assert other is not first and calls[-1] == (2, 128, cpu)
    nxt = _plan(mgr, [1], [4], [[4]], num_decodes=1)
    assert nxt.decode_workspace(make, 2, 16, cpu) is not first and len(calls) == 3
