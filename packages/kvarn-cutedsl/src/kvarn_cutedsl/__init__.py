"""KVarN decode kernel for dense records, written in CuTe DSL, gated on GPU capability.

``kvarn_cutedsl.decode`` has the contract of ``kvarn_ops.decode`` (docs/contracts.md), so a
caller can pick either by name. Refusals (unvalidated arch, unimplemented format, geometry or
dtype) raise NotImplementedError before any compile; see ``kvarn_cutedsl._capability``.
Kernels are compiled ahead of time with ``python -m kvarn_cutedsl.aot`` and loaded without the
DSL compiler (``KVARN_CUTEDSL_AOT_DIR``), or compiled on first use with an on-disk cache.
"""

from kvarn_cutedsl import _compat

_compat.check_formats()  # before torch and the DSL: a wrong kvarn-formats fails fast

from importlib.metadata import PackageNotFoundError, version  # noqa: E402

from kvarn_cutedsl._capability import (  # noqa: E402
    COMPILED_ONLY_ARCHS,
    VALIDATED_ARCHS,
    device_arch,
    is_supported,
)

try:
    __version__ = version("kvarn-cutedsl")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"


def __getattr__(name: str):
    # The launcher imports torch: load it on first use.
    if name in ("decode", "decode_workspace", "decode_num_splits"):
        from kvarn_cutedsl import launcher as _launcher

        return getattr(_launcher, name)
    raise AttributeError(f"module 'kvarn_cutedsl' has no attribute {name!r}")


__all__ = [
    "COMPILED_ONLY_ARCHS",
    "VALIDATED_ARCHS",
    "__version__",
    "decode",
    "decode_num_splits",
    "decode_workspace",
    "device_arch",
    "is_supported",
]
