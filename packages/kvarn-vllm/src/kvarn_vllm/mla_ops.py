"""The MLA cache ops, bound to one implementation (the choice of kvarn_vllm.kernel_choice).

``reference`` (``kvarn_ops.reference.mla``, plain torch) on CPU, Triton launchers
(``kvarn_ops.kernels.mla_*``) on CUDA. kvarn-cutedsl has no MLA kernels: where the dense
choice is ``cutedsl`` the MLA ops run on Triton (said in the log line).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from kvarn_vllm.kernel_choice import KernelChoice

logger = logging.getLogger("vllm.kvarn")

OP_MODULES = {
    "mla_exact_scatter": "mla_scatter",
    "mla_pack": "mla_pack",
    "mla_rehydrate": "mla_pack",
    "mla_materialize": "mla_gather",
    "mla_decode": "mla_decode",
    "mla_decode_workspace": "mla_decode",
}

_LOGGED: set[tuple[str, str]] = set()


class MlaOpSet:
    """``mla_exact_scatter``, ``mla_pack``, ``mla_rehydrate``, ``mla_materialize``,
    ``mla_decode`` and ``mla_decode_workspace`` of one implementation."""

    mla_exact_scatter: Any
    mla_pack: Any
    mla_rehydrate: Any
    mla_materialize: Any
    mla_decode: Any
    mla_decode_workspace: Any

    def __init__(self, choice: KernelChoice, device: str = "cpu") -> None:
        self.name = "reference" if choice.name == "reference" else "triton"
        for op, module in OP_MODULES.items():
            if self.name == "reference":
                source: Any = importlib.import_module("kvarn_ops.reference.mla")
            else:
                source = importlib.import_module(f"kvarn_ops.kernels.{module}")
            setattr(self, op, getattr(source, op))
        key = (self.name, device)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info(
                "kvarn: MLA KV-cache ops on %s run on %s (%s)", device, self.name, choice.reason
            )
