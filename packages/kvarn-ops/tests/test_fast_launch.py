"""The recorded-launch machinery (``kernels/_fastlaunch.py``) with stand-in kernels: which
arguments become pointer slots, what makes a call unreplayable, and what a replay passes to
the compiled launcher. (On a GPU, ``gpu/test_fast_launch.py`` checks the real ops.)"""

from __future__ import annotations

import inspect

import pytest
import torch

from kvarn_ops.kernels import _fastlaunch as fl


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default
        self.has_default = default is not inspect.Parameter.empty


class _Compiled:
    """A compiled kernel whose launcher records its calls."""

    def __init__(self, calls):
        self.function, self.packed_metadata = "fn", ("meta",)
        self.calls = calls

    def run(self, *a):
        self.calls.append(a)


class _Kernel:
    """A JIT function: parameters ``x, y, n, BLOCK`` (BLOCK defaults to 4)."""

    params = [_Param("x"), _Param("y"), _Param("n"), _Param("BLOCK", 4)]

    def __init__(self):
        self.calls = []
        self.launched = []

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.launched.append((grid, args, kwargs))
            return _Compiled(self.calls)

        return go


@pytest.fixture
def stream(monkeypatch):
    monkeypatch.setattr(fl, "_current_stream", lambda dev: 1234)


def _tensors(n=3):
    return tuple(torch.arange(8, dtype=torch.int32) + i for i in range(n))


def test_replay_passes_new_pointers_in_parameter_order(stream):
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    key = ("sig",)
    with cache.recording(key, (a, b, c)):
        # y is a view of c (another dtype): its slot is c's; BLOCK from kwargs, num_warps an
        # option (not a parameter)
        fl.launch(kern, (5, 2), a, c.view(torch.float32), 77, BLOCK=8, num_warps=1)
    assert len(kern.launched) == 1 and kern.calls == []
    a2, b2, c2 = _tensors()
    assert cache.replay(key, (a2, b2, c2))
    assert cache.replays == 1
    (call,) = kern.calls
    assert call == (5, 2, 1, 1234, "fn", ("meta",), None, None, None,
                    a2.data_ptr(), c2.data_ptr(), 77, 8)  # fmt: skip
    assert len(kern.launched) == 1, "a replay went through the JIT function"


def test_defaults_fill_missing_parameters(stream):
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    with cache.recording(("k",), (a, b, c)):
        fl.launch(kern, (1,), b, a, 3)
    assert cache.replay(("k",), (a, b, c))
    assert kern.calls[0][-4:] == (b.data_ptr(), a.data_ptr(), 3, 4)
    assert kern.calls[0][:3] == (1, 1, 1)


def test_unattributable_pointers_leave_no_plan(stream):
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    other = torch.zeros(4)
    with cache.recording(("foreign",), (a, b, c)):
        fl.launch(kern, (1,), a, other, 1)  # a tensor that is not one of the inputs
    with cache.recording(("alias",), (a, a[:4], c)):
        fl.launch(kern, (1,), a, c, 1)  # two inputs at one address
    with cache.recording(("none",), (a, b, c)):
        pass  # launched nothing
    for key in (("foreign",), ("alias",), ("none",)):
        assert not cache.replay(key, (a, b, c))
    assert kern.calls == [] and cache.replays == 0


def test_scratch_is_allocated_anew_at_every_replay(stream, monkeypatch):
    """A buffer the call allocates through ``scratch`` takes a slot past the inputs; each
    replay allocates one of the same size, dtype and device (zeroed where it was) and passes
    its pointer; outside a recording ``scratch`` only allocates."""
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    made = []
    real_empty, real_zeros = torch.empty, torch.zeros

    def spy(real, zero):
        def alloc(*args, **kwargs):
            t = real(*args, **kwargs)
            made.append((zero, t.numel(), t.dtype, t.device, t.data_ptr()))
            return t

        return alloc

    monkeypatch.setattr(torch, "empty", spy(real_empty, False))
    monkeypatch.setattr(torch, "zeros", spy(real_zeros, True))
    with cache.recording(("k",), (a, b, c)):
        counters = fl.scratch(6, torch.int32, a.device, zero=True)
        work = fl.scratch(10, torch.float32, a.device)
        assert torch.equal(counters, real_zeros(6, dtype=torch.int32))
        fl.launch(kern, (1,), work, counters.view(torch.float32), 5)
        fl.launch(kern, (2,), b, work, 6)
    assert [m[:4] for m in made] == [(True, 6, torch.int32, a.device),
                                     (False, 10, torch.float32, a.device)]  # fmt: skip
    made.clear()
    assert cache.replay(("k",), (a, b, c))
    assert [m[:4] for m in made] == [(True, 6, torch.int32, a.device),
                                     (False, 10, torch.float32, a.device)]  # fmt: skip
    cnt_ptr, work_ptr = made[0][4], made[1][4]
    first, second = kern.calls
    assert first[-4:] == (work_ptr, cnt_ptr, 5, 4)
    assert second[-4:] == (b.data_ptr(), work_ptr, 6, 4)
    made.clear()
    fl.scratch(3, torch.float32, a.device)  # not recording: an allocation, nothing else
    assert len(made) == 1 and ("k",) in cache._plans


def test_a_failing_call_records_nothing(stream):
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()

    def failing():
        with cache.recording(("k",), (a, b, c)):
            fl.launch(kern, (1,), a, b, 1)
            raise ValueError("a check after the launch")

    with pytest.raises(ValueError, match="after the launch"):
        failing()
    assert not cache.replay(("k",), (a, b, c))
    assert ("k",) not in cache._plans


def test_recording_is_scoped(stream):
    """A launch outside any recording, or inside a nested one, goes to the right plan."""
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    fl.launch(kern, (1,), a, b, 1)  # not recorded anywhere
    with cache.recording(("outer",), (a, b, c)):
        with cache.recording(("inner",), (a, b, c)):
            fl.launch(kern, (2,), b, c, 2)
        fl.launch(kern, (3,), c, a, 3)
    assert cache.replay(("outer",), (a, b, c)) and cache.replay(("inner",), (a, b, c))
    assert [call[0] for call in kern.calls] == [3, 2]


def test_no_signature_for_cpu_tensors_or_when_switched_off(monkeypatch):
    cache = fl.PlanCache(lambda: ())
    monkeypatch.setattr(fl, "_enabled", lambda default_on=True: True)
    assert cache.key(_tensors(), ()) is None  # CPU tensors: the checks that read values run
    monkeypatch.undo()
    monkeypatch.delenv(fl.ENV_OFF, raising=False)
    monkeypatch.setattr(fl, "INTERPRET", False)
    monkeypatch.setattr(fl, "DEFAULT_ON", True)
    assert fl._enabled()
    monkeypatch.setattr(fl, "DEFAULT_ON", False)
    assert not fl._enabled()
    monkeypatch.setenv(fl.ENV_OFF, "1")
    assert fl._enabled()
    monkeypatch.setattr(fl, "DEFAULT_ON", True)
    monkeypatch.delenv(fl.ENV_OFF)
    assert not fl._enabled(default_on=False)  # an op not yet checked on a GPU: opt-in
    monkeypatch.setenv(fl.ENV_OFF, "1")
    assert fl._enabled(default_on=False)
    monkeypatch.setenv(fl.ENV_OFF, "0")
    assert not fl._enabled()
    monkeypatch.setattr(fl, "INTERPRET", True)
    monkeypatch.delenv(fl.ENV_OFF)
    assert not fl._enabled()
    monkeypatch.setattr(fl, "INTERPRET", False)
    from triton import knobs

    def hook(*a):
        return None

    knobs.runtime.launch_enter_hook.add(hook)  # a profiler's hook: every launch must see it
    try:
        assert not fl._enabled()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fl._enabled()


def test_the_cache_is_bounded(stream, monkeypatch):
    monkeypatch.setattr(fl, "MAX_PLANS", 3)
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    for i in range(5):
        with cache.recording((i,), (a, b, c)):
            fl.launch(kern, (1,), a, b, i)
    assert len(cache._plans) <= 3
    assert cache.replay((4,), (a, b, c))


def test_constant_tables_keep_their_address(stream):
    """A table declared with ``constant`` is passed to every replay at its own address (no
    slot) and held by the plan; a constant at an input's address makes the call
    unreplayable; outside a recording ``constant`` returns its tensor and notes nothing."""
    cache = fl.PlanCache(lambda: ())
    kern = _Kernel()
    a, b, c = _tensors()
    table = torch.arange(4, dtype=torch.int16)
    with cache.recording(("k",), (a, b, c)):
        fl.launch(kern, (1,), a, fl.constant(table).view(torch.uint8), 3)
    a2, b2, c2 = _tensors()
    assert cache.replay(("k",), (a2, b2, c2))
    (call,) = kern.calls
    assert call[-4:] == (a2.data_ptr(), table.data_ptr(), 3, 4)
    assert any(t is table for t in cache._plans[("k",)].keep), "the plan must hold the table"
    with cache.recording(("alias",), (a, b, c)):
        fl.launch(kern, (1,), a, fl.constant(b), 3)
    assert not cache.replay(("alias",), (a, b, c))
    with cache.recording(("unknown",), (a, b, c)):
        fl.launch(kern, (1,), a, table, 3)  # not declared: its pointer cannot be attributed
    assert not cache.replay(("unknown",), (a, b, c))
    assert fl.constant(table) is table
    assert len(kern.calls) == 1
