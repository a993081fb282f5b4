"""Replaying an op's kernel launches without its checks and Triton's per-call binding.

An attention backend outside CUDA graphs pays an op's host time on every layer of every step;
for a decode call most of it is the argument checks, the launch configuration and Triton's
``JITFunction.run`` (binding every argument, the cache lookup, a driver query per pointer),
not the launch itself (``benchmarks/host_breakdown.py``: 110-220 us a decode call on an
H100 machine's host, 26 us replayed; BENCHMARKS.md "2026-12-07, late night"). A
:class:`PlanCache` keeps, per call signature, what the first call with that signature
launched: each compiled kernel, its grid and its argument list, with every tensor argument
replaced by the index of the op's input it points at. A later call with the same signature
calls the compiled launchers directly with the new inputs' data pointers.

The signature is everything the checks and the configuration read: every input's shape,
strides, dtype, device and whether its data pointer is 16-byte aligned (what Triton
specializes pointers on), the op's other arguments, the switches the op reads at launch
(environment variables and module settings, given by the op) and the current CUDA device.
Integer kernel arguments are functions of these, so they are kept as recorded. Only CUDA
tensors take the fast path (the checks that read values run on CPU tensors only), never
while ``torch.compile`` traces or a dispatch mode is active, and never while Triton has a
launch hook set (profilers) or ``KVARN_FAST_LAUNCH=0`` (see :data:`DEFAULT_ON`). A call is
recorded only when each of its kernels' tensor arguments points at exactly one of the op's
inputs (views of them included), at a transient buffer the call allocated through
:func:`scratch` (allocated anew, zeroed where it was, at every replay) or at a table the op
keeps for the process's life and declares with :func:`constant` (its address kept, the tensor
held by the plan); otherwise its signature is remembered as not replayable and takes the
full path.

A replay calls each compiled kernel's launcher as Triton's own ``JITFunction.run`` does:
``(grid x, y, z, stream, function, packed metadata, launch metadata, enter hook, exit hook,
*every parameter's value)``, with None for the launch metadata and hooks (replays never run
with a hook set). That convention is the same in the sources of Triton 3.6 (the GPU tests'
version) and 3.9 (the newest release when this was written); a Triton that renamed the
compiled kernel's ``run``, ``function`` or ``packed_metadata`` records nothing (the full path
stays).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvarn_ops.kernels._common import INTERPRET, tracing

__all__ = ["PlanCache", "constant", "launch", "scratch"]

ENV_OFF = "KVARN_FAST_LAUNCH"
DEFAULT_ON = True
"""Whether calls replay recorded launches unless ``KVARN_FAST_LAUNCH`` is ``0`` (when False,
only ``KVARN_FAST_LAUNCH=1`` turns them on)."""
MAX_PLANS = 256
"""Signatures kept per op (a serving process sees a few per layer shape and batch size)."""

_local = threading.local()


class _Plan:
    """The launches of one recorded call: ``(launcher, grid, function, metadata, args,
    slots)``, ``slots`` the positions of ``args`` that take pointer ``i``: input ``i``'s
    data pointer, or for ``i`` past the inputs that of scratch buffer ``i - len(inputs)``
    (``scratch``: its ``(numel, dtype, zero, device)``, in order of allocation)."""

    __slots__ = ("launches", "keep", "scratch")

    def __init__(self, launches: list, keep: tuple, scratch: tuple) -> None:
        self.launches = launches
        self.keep = keep  # objects whose id() is in the signature, kept alive with it
        self.scratch = scratch


class _Recorder:
    def __init__(self, ptrs: Sequence[int | None]) -> None:
        index: dict[int, int] = {}
        self.ok = True
        for i, p in enumerate(ptrs):
            if p is None:
                continue
            if p in index:  # two inputs at one address: a pointer could not be attributed
                self.ok = False
            index[p] = i
        self.index = index
        self.inputs = len(ptrs)
        self.launches: list = []
        self.scratch: list[tuple[int, torch.dtype, bool, torch.device]] = []
        self.constants: dict[int, torch.Tensor] = {}

    def add_constant(self, t: torch.Tensor) -> None:
        p = t.data_ptr()
        if p in self.index:  # an input at a constant's address: never misattributed
            self.ok = False
            return
        self.constants[p] = t

    def add_scratch(self, t: torch.Tensor, zero: bool) -> None:
        p = t.data_ptr()
        if p in self.index:  # freed memory of an input? never seen, but never misattributed
            self.ok = False
            return
        self.index[p] = self.inputs + len(self.scratch)
        self.scratch.append((t.numel(), t.dtype, zero, t.device))

    def add(self, kern, compiled, grid, args: tuple, kwargs: dict) -> None:
        if not self.ok:
            return
        try:
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            params = kern.params
            values = list(args)
            for p in params[len(args) :]:
                if p.name in kwargs:
                    values.append(kwargs[p.name])
                elif p.has_default:
                    values.append(p.default)
                else:
                    raise TypeError(p.name)
            slots = []
            for pos, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    p = v.data_ptr()
                    i = self.index.get(p)
                    if i is not None:
                        slots.append((pos, i))
                        values[pos] = 0
                    elif p in self.constants:
                        values[pos] = p  # the table's address, for the plan's life
                    else:
                        self.ok = False
                        return
            g = tuple(grid) + (1, 1)
            self.launches.append(
                (compiled.run, g[0], g[1], g[2], compiled.function, compiled.packed_metadata,
                 tuple(values), tuple(slots))
            )  # fmt: skip
        except Exception:  # another Triton's internals: no plan, the full path stays
            self.ok = False


def launch(kern, grid, *args, **kwargs):
    """``kern[grid](*args, **kwargs)``, recorded when a :class:`PlanCache` records this call."""
    compiled = kern[grid](*args, **kwargs)
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.add(kern, compiled, grid, args, kwargs)
    return compiled


def scratch(numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False):
    """A transient buffer for an op's launches (``torch.empty``, or ``torch.zeros`` with
    ``zero``). A recorded call's plan allocates it anew at every replay, on the op's stream
    (the caching allocator's order keeps it private to the call, as in the full path)."""
    t = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.add_scratch(t, zero)
    return t


def constant(t: torch.Tensor) -> torch.Tensor:
    """Declare ``t`` (returned unchanged) a table that the op keeps for the process's life
    and never writes (a cached per-device constant): a recording passes its address to every
    replay as it is and its plan holds a reference to it."""
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.add_constant(t)
    return t


def _current_stream(device: int) -> int:
    """The raw handle of ``device``'s current CUDA stream (what Triton launches on)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


def _enabled(default_on: bool = True) -> bool:
    env = os.environ.get(ENV_OFF)
    if INTERPRET or env == "0" or (env != "1" and not (DEFAULT_ON and default_on)) or tracing():
        return False
    from triton import knobs

    return _no_hooks(knobs.runtime.launch_enter_hook) and _no_hooks(knobs.runtime.launch_exit_hook)


def _no_hooks(hook) -> bool:
    """Triton 3.6 keeps launch hooks in a ``HookChain`` (empty unless a profiler adds one);
    other versions use None for none."""
    return hook is None or getattr(hook, "calls", None) == []


class PlanCache:
    """Recorded launches of one op, by call signature.

    ``switches()`` returns what else the op's path reads (environment variables, module
    settings); it is part of every signature. Usage::

        plans = PlanCache(lambda: (os.environ.get("X"), SETTING))

        def op(a, b, n):
            key = plans.key((a, b), (n,))
            if plans.replay(key, (a, b)):
                return
            with plans.recording(key, (a, b)):
                ...  # checks, configuration, launch(kernel, grid, ...)
    """

    def __init__(self, switches: Callable[[], tuple], default_on: bool = True) -> None:
        self._switches = switches
        self.default_on = default_on
        """False: this op replays only with ``KVARN_FAST_LAUNCH=1`` (an op whose replays
        have not yet been checked on a GPU)."""
        self._plans: dict[Any, _Plan | None] = {}
        self.replays = 0
        """Calls served from a plan (tests read it)."""

    def key(self, tensors: Sequence[torch.Tensor | None], extra: tuple) -> tuple | None:
        """The call's signature, or None where the fast path does not apply."""
        if not _enabled(self.default_on):
            return None
        meta: list[tuple | None] = []
        for t in tensors:
            if t is None:
                meta.append(None)
                continue
            dev = t.get_device()
            if dev < 0:
                return None
            meta.append((t.shape, t.stride(), t.dtype, dev, t.data_ptr() & 15 == 0))
        return (torch.cuda.current_device(), extra, self._switches(), tuple(meta))

    def replay(self, key: tuple | None, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Launch the plan recorded for ``key``; False where there is none."""
        if key is None:
            return False
        plan = self._plans.get(key)
        if plan is None:
            return False
        ptrs = [None if t is None else t.data_ptr() for t in tensors]
        bufs = []
        if plan.scratch:
            for numel, dtype, zero, dev in plan.scratch:
                buf = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=dev)
                bufs.append(buf)
                ptrs.append(buf.data_ptr())
        stream = _current_stream(key[0])
        for run, g0, g1, g2, fn, meta, values, slots in plan.launches:
            args = list(values)
            for pos, i in slots:
                args[pos] = ptrs[i]
            run(g0, g1, g2, stream, fn, meta, None, None, None, *args)
        self.replays += 1
        return True

    def recording(self, key: tuple | None, tensors: Sequence[torch.Tensor | None], keep=()):
        """Context of the full path: its :func:`launch` calls become the plan of ``key``
        (nothing is recorded for a None key, or a key already known). ``keep``: objects
        whose ``id`` the signature holds."""
        return _Recording(self, key, tensors, tuple(keep))

    def clear(self) -> None:
        self._plans.clear()


class _Recording:
    def __init__(self, cache: PlanCache, key, tensors, keep: tuple) -> None:
        self.cache, self.key, self.keep = cache, key, keep
        self.rec = None
        if key is not None and key not in cache._plans:
            self.rec = _Recorder([None if t is None else t.data_ptr() for t in tensors])

    def __enter__(self):
        self.prev = getattr(_local, "rec", None)
        _local.rec = self.rec
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.rec = self.prev
        if self.rec is None or exc_type is not None:
            return
        plans = self.cache._plans
        if len(plans) >= MAX_PLANS:
            plans.clear()
        ok = self.rec.ok and self.rec.launches
        keep = self.keep + tuple(self.rec.constants.values())
        plan = _Plan(self.rec.launches, keep, tuple(self.rec.scratch))
        plans[self.key] = plan if ok else None
