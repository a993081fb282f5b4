"""``--kv-cache-dtype kvarn_...`` on vLLM >= 0.33 (the registry in ``vllm.config.cache``).

A handler answers what vLLM 0.33 asks of a custom cache dtype (its ``KVCacheDTypeHandler``
protocol: ``name``, ``torch_dtype()``, ``quant_mode()``): the storage dtype (bytes: the
backend lays out packed records itself) and the quant mode generic code dispatches on,
``KVQuantMode.CUSTOM`` in 0.33.0 (the backend dispatches everything). Its value equals
``OCTAVE_K3V4``'s there, so the mode's *name* is never used to find the format: the format
is the dtype string itself. ``is_quantized`` and ``supports_platform`` are extras vLLM 0.33.0
does not call. Checked against vLLM 0.33.0's source (tests/api_check), not run on it.
"""

from __future__ import annotations

from typing import Any


def handler_class_for(name: str) -> type:
    """A handler class for one kvarn format name."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = next(
        (getattr(KVQuantMode, m) for m in ("BACKEND", "CUSTOM") if hasattr(KVQuantMode, m)),
        KVQuantMode.NONE,
    )

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
