"""Triton launchers for the dense KVarN cache (docs/contracts.md).

``rotate``, ``store``, ``flush``, ``materialize`` and ``decode`` (with ``decode_workspace``),
each registered as a ``torch.library`` custom op ``kvarn::<op>`` with a fake implementation,
so they are opaque to torch.compile. Each launcher validates its arguments (ValueError naming
the argument) and has the signature of the matching ``kvarn_ops.reference`` op.
"""

from kvarn_ops.kernels.decode import decode, decode_workspace
from kvarn_ops.kernels.flush import flush
from kvarn_ops.kernels.materialize import materialize
from kvarn_ops.kernels.rotate import rotate
from kvarn_ops.kernels.store import store

__all__ = ["decode", "decode_workspace", "flush", "materialize", "rotate", "store"]
