"""Helpers of the GPU parity suite: the device, error measures, poison, realistic K/V, CUDA-graph
replays."""

from __future__ import annotations

import torch

if not torch.cuda.is_available():  # pragma: no cover - the runner refuses before this
    raise RuntimeError("the GPU parity suite needs a CUDA device")

DEVICE = torch.device("cuda")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN if x has any non-finite value)."""
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("nan")
    return float((x64 - r64).norm() / r64.norm().clamp_min(1e-300))


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with 0xFF bytes (NaN for float types) so unwritten elements are caught."""
    t.view(torch.uint8).fill_(0xFF)
    return t


def realistic_kv(gen: torch.Generator, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """K/V-like values: per-channel scales spanning 1e-2..1e1 and a few outlier channels."""
    d = shape[-1]
    x = torch.randn(shape, generator=gen, device=DEVICE)
    chan = torch.exp(torch.randn(d, generator=gen, device=DEVICE) * 1.2)
    outliers = torch.randperm(d, generator=gen, device=DEVICE)[: max(1, d // 32)]
    chan[outliers] *= 8
    return (x * chan).to(dtype)


def check_graph_replays(call, inputs, make, got: torch.Tensor, rows: torch.Tensor, replays=3):
    """``call(out)`` (an op reading the tensors ``inputs`` and writing ``out``) captured in a
    CUDA graph writing ``got``, then ``replays`` times: new values from ``make()`` (a tuple
    like ``inputs``) copied into ``inputs`` in place, an eager ``call`` into a poisoned tensor,
    the graph replayed into a poisoned ``got``; ``got[rows]`` must equal the eager result bit
    for bit (what the graph holds, e.g. a counter's zeroing, must be replayed too). ``None``
    entries of ``inputs`` are skipped."""
    call(got)  # eager first: compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        call(got)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(replays):
        for cur, new in zip(inputs, make(), strict=True):
            if cur is not None:
                cur.copy_(new)
        want = poison_(torch.empty_like(got))
        call(want)
        poison_(got)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[rows], want[rows])
