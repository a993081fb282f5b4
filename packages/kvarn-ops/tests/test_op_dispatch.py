"""How the public launchers reach their kernels (``kernels._common.launch_or_op``).

Eager calls run the custom op's body directly (no dispatcher on the host path); while
``torch.compile`` traces, the launchers call the registered ``torch.ops.kvarn`` op, so the
graph holds it and runs it with real tensors afterwards.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvarn_ops import kernels  # noqa: E402
from kvarn_ops import reference as ref  # noqa: E402

rotate_mod = importlib.import_module("kvarn_ops.kernels.rotate")
store_mod = importlib.import_module("kvarn_ops.kernels.store")


def _rotated(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    ref.rotate(x, out)
    return out


class _Refuse:
    """Stands in for a custom op that must not be called."""

    def __call__(self, *args, **kwargs):
        raise AssertionError("the custom op was called in eager mode")


def test_eager_calls_skip_the_custom_op(monkeypatch, gen):
    monkeypatch.setattr(rotate_mod, "_rotate_op", _Refuse())
    x = torch.randn(32, 64, generator=gen, dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    kernels.rotate(x, out)
    torch.testing.assert_close(out, _rotated(x), rtol=0, atol=1e-5)


def test_fake_tensors_take_the_fake_implementation():
    """Under FakeTensorMode the public launcher reaches the registered op (its fake
    implementation), never a kernel launch on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(32, 64)
        out = torch.empty_like(x)
        kernels.rotate(x, out)
        assert out.shape == (32, 64)


def test_make_fx_graph_holds_the_rotate_op(gen):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        out = torch.empty_like(x)
        kernels.rotate(x, out)
        return out

    x = torch.randn(32, 64, generator=gen)
    gm = make_fx(f)(x)
    assert "kvarn.rotate.default" in _targets([gm])
    torch.testing.assert_close(gm(x), _rotated(x), rtol=0, atol=1e-5)


def _compiled(fn, **kwargs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, **kwargs), graphs


def _targets(graphs) -> set[str]:
    return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


def test_compiled_graph_holds_the_rotate_op(gen):
    x = torch.randn(32, 64, generator=gen, dtype=torch.float32)

    def f(x):
        out = torch.empty_like(x)
        kernels.rotate(x * 2.0, out)
        return out + 1.0

    fc, graphs = _compiled(f, fullgraph=True)
    got = fc(x)
    assert "kvarn.rotate.default" in _targets(graphs)
    torch.testing.assert_close(got, _rotated(x * 2.0) + 1.0, rtol=0, atol=1e-5)


def test_compiled_graph_holds_the_store_op(gen):
    t, hkv, d, p, g = 20, 2, 64, 2, 16
    k = torch.randn(t, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(t, hkv, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(p * g, generator=gen)[:t]

    def pools():
        return [torch.full((p, g, hkv, d), float("nan"), dtype=torch.bfloat16) for _ in "kv"]

    ek, ev = pools()
    fc, graphs = _compiled(lambda *a: kernels.store(*a))
    fc(k, v, slots, ek, ev, None, None)
    assert "kvarn.store.default" in _targets(graphs)
    ek_eager, ev_eager = pools()
    kernels.store(k, v, slots, ek_eager, ev_eager, None, None)
    # the same kernel either way: the same bytes
    assert torch.equal(ek.view(torch.int16), ek_eager.view(torch.int16))
    assert torch.equal(ev.view(torch.int16), ev_eager.view(torch.int16))
    assert not bool(ek.reshape(p * g, -1)[slots].isnan().any())
