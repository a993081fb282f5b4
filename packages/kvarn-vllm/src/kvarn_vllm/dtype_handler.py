"""``--kv-cache-dtype kvarn_...`` on vLLM >= 0.33 (``vllm.config.kv_cache_dtype``).

A handler answers what vLLM asks of a custom cache dtype: the storage dtype (bytes: the
backend lays out packed records itself), that it is quantized, and the quant mode generic
kernels would dispatch on (``KVQuantMode.BACKEND``: the backend dispatches everything; the
mode's *name* is never used to find the format, the format is the dtype string itself).
Checked against vLLM's source of that module, not against an installed 0.33 (not run here).
"""

from __future__ import annotations

from typing import Any


def handler_class_for(name: str) -> type:
    """A handler class for one kvarn format name."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = getattr(KVQuantMode, "BACKEND", KVQuantMode.NONE)

    class KvarnKVCacheDTypeHandler:
        def __init__(self) -> None:
            self.name = name

        def torch_dtype(self) -> torch.dtype:
            return torch.uint8

        def is_quantized(self) -> bool:
            return True

        def quant_mode(self) -> Any:
            return mode

        def supports_platform(self, platform: Any) -> bool:
            return True

    KvarnKVCacheDTypeHandler.__qualname__ = f"KvarnKVCacheDTypeHandler[{name}]"
    return KvarnKVCacheDTypeHandler
