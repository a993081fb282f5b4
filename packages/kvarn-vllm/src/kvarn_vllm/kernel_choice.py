"""Which implementation runs the dense KVarN ops: Triton, CuTe DSL, or the torch reference.

The choice is explicit and made once per process (logged once):

- ``reference`` (``kvarn_ops.reference``): every CPU device, and anywhere on request.
- ``triton`` (``kvarn_ops.<op>`` launchers: Triton, and the Gluon tensor-core decode kernels
  where they apply): the default on CUDA.
- ``cutedsl`` (kvarn-cutedsl's decode; store/flush/materialize stay on Triton): on request,
  where kvarn-cutedsl is installed and its capability gate admits the device and geometry.
  Not chosen automatically: on the H200 its decode (a scalar GEMV, 1.0.0) reaches 6-15% of
  the copy bandwidth, kvarn-ops's 44-62% on the geometries both serve (each package's
  BENCHMARKS.md).

One setting overrides it: the environment variable ``KVARN_DECODE_KERNEL`` =
``auto`` (default) | ``triton`` | ``cutedsl`` | ``reference``. An explicit choice that cannot run
on the device raises instead of falling back: nothing downgrades silently.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.kvarn")

ENV_VAR = "KVARN_DECODE_KERNEL"
CHOICES = ("auto", "triton", "cutedsl", "reference")


@dataclass(frozen=True)
class KernelChoice:
    """The implementation picked and why (the reason goes into the one log line)."""

    name: str  # "triton" | "cutedsl" | "reference"
    reason: str


@dataclass(frozen=True)
class DecodeGeometry:
    """What kvarn-cutedsl's capability gate needs to know about a layer's decode."""

    k_bits: int
    v_bits: int
    group: int
    head_dim: int
    gqa: int = 1
    q_dtype: str = "bfloat16"
    pool_dtype: str = "bfloat16"
    max_query_len: int = 1  # 1 + speculative tokens when verify runs go through decode


def cutedsl_problem(
    device_type: str, device_index: int = 0, geometry: DecodeGeometry | None = None
) -> str | None:
    """Why kvarn-cutedsl cannot run on the device (None when it can).

    Imports kvarn-cutedsl at use, catching only ImportError/OSError, and asks its public
    capability gate, ``kvarn_cutedsl.is_supported(device_arch(index), ...)``.
    """
    if device_type != "cuda":
        return f"kvarn-cutedsl runs on CUDA devices only, not {device_type!r}"
    try:
        cutedsl: Any = importlib.import_module("kvarn_cutedsl")
    except (ImportError, OSError) as exc:
        return f"kvarn-cutedsl is not importable ({type(exc).__name__}: {exc})"
    arch = cutedsl.device_arch(device_index)
    if geometry is None:
        return None
    if not cutedsl.is_supported(
        arch,
        geometry.k_bits,
        geometry.v_bits,
        geometry.group,
        geometry.head_dim,
        geometry.gqa,
        geometry.max_query_len,
        geometry.q_dtype,
        geometry.pool_dtype,
    ):
        return f"kvarn-cutedsl does not support {geometry} on {arch}"
    return None


def choose_kernel(
    device_type: str,
    device_index: int = 0,
    *,
    geometry: DecodeGeometry | None = None,
    env: Mapping[str, str] | None = None,
    cutedsl_probe: Callable[[str, int, DecodeGeometry | None], str | None] = cutedsl_problem,
) -> KernelChoice:
    """Pick the implementation for a device.

    Parameters
    ----------
    device_type : str
        ``torch.device.type`` of the KV cache ("cpu", "cuda", ...).
    device_index : int
        CUDA device index, for the CuTe DSL capability gate.
    env : mapping, optional
        Where ``KVARN_DECODE_KERNEL`` is read (default ``os.environ``).
    geometry : DecodeGeometry, optional
        The layer's format and shapes, for the CuTe DSL gate.
    cutedsl_probe : callable
        ``(device_type, device_index, geometry) -> reason or None``; replaced in tests.

    Raises
    ------
    ValueError
        The setting is not one of ``CHOICES``, or names an implementation that cannot run on
        the device (the message says why and what to set instead).
    """
    source: Mapping[str, str] = os.environ if env is None else env
    raw = source.get(ENV_VAR, "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not one of {', '.join(CHOICES)}; unset it for the automatic "
            "choice (reference on CPU, Triton on CUDA)"
        )
    if raw == "reference":
        return KernelChoice("reference", f"{ENV_VAR}=reference")
    if raw in ("triton", "cutedsl") and device_type != "cuda":
        raise ValueError(
            f"{ENV_VAR}={raw} needs a CUDA device, the KV cache is on {device_type!r}: "
            f"set {ENV_VAR}=reference (or unset it)"
        )
    if raw == "triton":
        return KernelChoice("triton", f"{ENV_VAR}=triton")
    if raw == "cutedsl":
        problem = cutedsl_probe(device_type, device_index, geometry)
        if problem is not None:
            raise ValueError(f"{ENV_VAR}=cutedsl but {problem}: set {ENV_VAR}=triton (or unset it)")
        return KernelChoice("cutedsl", f"{ENV_VAR}=cutedsl")
    # auto: kvarn-ops on CUDA (its decode is the faster one wherever both serve; cutedsl only
    # on request)
    if device_type != "cuda":
        return KernelChoice("reference", f"device {device_type!r} has no Triton kernels")
    return KernelChoice("triton", f"CUDA device ({ENV_VAR}=cutedsl selects kvarn-cutedsl)")


_LOGGED: set[tuple[str, str]] = set()


def log_choice_once(choice: KernelChoice, device: str) -> None:
    """One INFO line per (implementation, device) per process."""
    key = (choice.name, device)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.info(
        "kvarn: dense KV-cache ops on %s run on %s (%s)", device, choice.name, choice.reason
    )


class OpSet:
    """The four ops of the dense paged cache, bound to one implementation."""

    def __init__(self, choice: KernelChoice) -> None:
        import kvarn_ops

        self.choice = choice
        # kvarn-ops 1.0.0's store needs contiguous K/V; later ones read the projection's view.
        self.strided_store = bool(getattr(kvarn_ops, "STRIDED_STORE_TOKENS", False))
        # kvarn-ops 1.0.0's flush has no sink_rows; later ones keep each request's first
        # token's V row almost exact (its attention sink).
        self.flush_sink_rows = bool(getattr(kvarn_ops, "FLUSH_SINK_ROWS", False))
        ref = kvarn_ops.reference
        if choice.name == "reference":
            self.store, self.flush = ref.store, ref.flush
            self.decode, self.materialize = ref.decode, ref.materialize
            self.decode_workspace = None
            return
        self.store = kvarn_ops.store
        self.flush = kvarn_ops.flush
        self.materialize = kvarn_ops.materialize
        self.decode_workspace = kvarn_ops.decode_workspace
        if choice.name == "cutedsl":
            cutedsl: Any = importlib.import_module("kvarn_cutedsl")
            self.decode = cutedsl.decode
            self.decode_workspace = cutedsl.decode_workspace
        else:
            self.decode = kvarn_ops.decode
