"""The fixed-time probe (``benchmarks/probe_decode_fixed.py``) times a decode step with the
combine's launch or the main kernel's launch skipped. Offline, this checks that what it skips
is what ``decode`` launches: the main kernels ``_launch`` indexes are exactly the ones the
probe replaces (a renamed kernel would otherwise run and be timed as "skipped"), the
replacements launch nothing, and everything else the launcher reads is left in place."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_BENCH = HERE.parent / "benchmarks"


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(_BENCH))
    try:
        spec = importlib.util.spec_from_file_location(
            "probe_decode_fixed", _BENCH / "probe_decode_fixed.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(_BENCH))


def test_skips_what_decode_launches(probe):
    kd = probe.kd
    mods = kd._mma_module()
    if mods is None:
        pytest.fail("this Triton has no Gluon: the probe has no main kernel to skip")
    src = inspect.getsource(kd._launch)
    # the main kernels _launch picks: "kern = mod.mma_decode_kernel" and the like
    launched = set(re.findall(r"kern = mod\w*\.(\w+)", src))
    assert launched, "the launcher no longer names its kernels the way the probe expects"
    skipped = {
        n for m in probe._Mods(mods)() for n in dir(m) if isinstance(getattr(m, n), probe._Skip)
    }
    assert launched == skipped, (launched, skipped)
    wrapped = probe._Mods(mods)()
    for real, fake in zip(mods, wrapped, strict=True):
        for name in dir(real):
            if name.startswith("__"):
                continue
            if name in launched:
                assert fake_launch_is_noop(getattr(fake, name))
            else:
                assert getattr(fake, name) is getattr(real, name), name
    # the combine is launched through the module global the probe replaces
    assert re.search(r"launch\(\s*_decode_combine_kernel,", src)


def fake_launch_is_noop(kernel) -> bool:
    launch = kernel[(3, 5)]
    return launch(1, 2, X=3, num_warps=1) is None and callable(launch)
