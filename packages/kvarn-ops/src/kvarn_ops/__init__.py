"""KVarN KV-cache ops for a dense paged cache.

``kvarn_ops.reference`` is the plain-torch implementation of every op (the source of truth
and the CPU fallback). ``kvarn_ops.<op>`` (rotate, store, flush, decode, materialize) are the
Triton launchers, loaded lazily from ``kvarn_ops.kernels`` on first use, with the same
signatures as the reference ops.
"""

from kvarn_ops import _compat

_compat.check_formats()  # before torch: a wrong kvarn-formats fails fast with the fix

from importlib import import_module  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from typing import Any  # noqa: E402

from kvarn_ops import reference  # noqa: E402

try:
    __version__ = version("kvarn-ops")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"

STRIDED_STORE_TOKENS = True
"""``store`` (reference and kernel) reads K/V tokens at any stride as long as each token's
``[Hkv, D]`` is packed (views into a fused QKV projection need no copy). Absent in 1.0.0,
whose ``store`` requires contiguous K/V: callers supporting both check it with ``getattr``."""

FLUSH_SINK_ROWS = True
"""``flush`` (reference and kernel) takes ``sink_rows`` (int32 [N]: the attention-sink token
of each flushed block, -1 for none) and keeps that token's V row almost exact
(``reference/sink.py``). Absent in 1.0.0: callers supporting both check it with ``getattr``."""

KERNEL_OPS = ("rotate", "store", "flush", "decode", "decode_workspace", "materialize")
"""Names forwarded to the Triton launchers of ``kvarn_ops.kernels`` (``decode_workspace``
allocates the decode kernel's scratch)."""


def __getattr__(name: str) -> Any:
    # Kernels import triton, which is slow and absent on some platforms: load on first use.
    if name in KERNEL_OPS:
        try:
            kernels = import_module("kvarn_ops.kernels")
        except (ImportError, OSError) as exc:
            raise AttributeError(
                f"kvarn_ops.{name} is a Triton launcher and kvarn_ops.kernels could not be "
                f"imported ({type(exc).__name__}: {exc}); use kvarn_ops.reference.{name} on "
                "machines without Triton"
            ) from exc
        try:
            return getattr(kernels, name)
        except AttributeError:
            raise AttributeError(
                f"kvarn_ops.kernels does not provide {name!r} yet; use kvarn_ops.reference.{name}"
            ) from None
    raise AttributeError(f"module 'kvarn_ops' has no attribute {name!r}")


__all__ = ["FLUSH_SINK_ROWS", "KERNEL_OPS", "STRIDED_STORE_TOKENS", "__version__", "reference"]
