"""Argument checks shared by the reference ops and the Triton launchers.

Every check raises ``ValueError`` whose message starts with the argument's name, says what was
expected and what was given. Checks that need the values of a tensor (index ranges) run only
for CPU tensors: on a GPU they would force a host synchronization.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

DENSE_HEAD_DIMS = (64, 128, 256, 512)
"""head_dim values the Hadamard rotation and the dense layouts support."""
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
"""Element types of the exact pool."""
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Element types of K, V and queries in the model frame."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | torch.dtype | None = None,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
    contiguous: bool | str = True,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    Parameters
    ----------
    name : str
        The argument's name, used in the message.
    dtypes : dtype or sequence of dtype, optional
        Allowed element types.
    shape : sequence of int or None, optional
        Expected shape; ``None`` entries match any size.
    ndim : int, optional
        Expected number of dimensions (implied by ``shape``).
    device : torch.device, optional
        Required device (type and index).
    contiguous : bool or "rows"
        Require a contiguous (row-major) tensor; ``"rows"``: only every dimension after the
        first (each row packed, rows at any stride, e.g. tokens sliced from a fused QKV
        projection).
    """
    # Launchers call this on every argument of every call: the common (passing) case takes
    # the cheapest comparisons first, the messages are built only on failure.
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        if isinstance(dtypes, torch.dtype):
            if t.dtype != dtypes:
                _bad_dtype(name, t, (dtypes,))
        elif t.dtype not in dtypes:
            _bad_dtype(name, t, tuple(dtypes))
    if shape is not None:
        if t.shape != tuple(shape):
            _check_shape(name, t, shape)
    elif ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected shape {ndim} dimensions, got {list(t.shape)}")
    if device is not None and t.device != device:
        want = torch.device(device)
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise ValueError(
                f"{name}: must be on {device} like the other arguments, got {t.device}; move it "
                f"with .to({str(device)!r})"
            )
    if contiguous == "rows":
        if not t[:1].is_contiguous():
            raise ValueError(
                f"{name}: every row (all dimensions after the first) must be contiguous, got "
                f"strides {tuple(t.stride())} for shape {tuple(t.shape)} (call .contiguous() "
                "first)"
            )
    elif contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() first)")
    return t


def _bad_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    raise ValueError(
        f"{name}: dtype must be {_dtype_names(allowed)}, got {str(t.dtype).removeprefix('torch.')}"
    )


def _check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """``t.shape`` against ``shape``, whose ``None`` entries match any size."""
    if t.dim() != len(shape) or any(
        s is not None and s != ts for s, ts in zip(shape, t.shape, strict=True)
    ):
        raise ValueError(f"{name}: expected shape {_shape_text(shape)}, got {list(t.shape)}")


def check_head_dim(name: str, head_dim: int) -> None:
    """``head_dim`` must be one of :data:`DENSE_HEAD_DIMS`."""
    if head_dim not in DENSE_HEAD_DIMS:
        allowed = ", ".join(map(str, DENSE_HEAD_DIMS))
        raise ValueError(f"{name}: head_dim must be one of {allowed}, got {head_dim}")


def check_dense_layout(name: str, layout: Any, head_dim: int | None = None) -> None:
    """``layout`` must be a dense ``kvarn_formats.RecordLayout`` (matching ``head_dim``)."""
    kind = getattr(layout, "kind", None)
    if kind is None or not hasattr(layout, "field") or not hasattr(layout, "record_bytes"):
        raise ValueError(
            f"{name}: expected a kvarn_formats.RecordLayout (kvarn_formats.dense_layout(...)), "
            f"got {type(layout).__name__}"
        )
    if kind != "dense":
        raise ValueError(
            f"{name}: format {layout.format_name!r} is a {kind} layout; these ops need a dense "
            "layout from kvarn_formats.dense_layout(name, head_dim)"
        )
    check_head_dim(name, layout.head_dim)
    if head_dim is not None and layout.head_dim != head_dim:
        raise ValueError(
            f"{name}: layout {layout.format_name!r} has head_dim {layout.head_dim}, but the "
            f"tensors have head_dim {head_dim}"
        )


def check_index_range(
    name: str,
    t: torch.Tensor,
    high: int,
    *,
    low: int = 0,
    sentinel: int | None = None,
    used: torch.Tensor | None = None,
) -> None:
    """Every used entry of ``t`` must be in ``[low, high)`` (or equal ``sentinel``).

    Only checked for CPU tensors (on a GPU the check would need a host sync). ``used`` is an
    optional bool mask of the entries that are read; the others may hold anything.
    """
    if t.device.type != "cpu" or t.numel() == 0:
        return
    vals = t if used is None else t[used]
    bad = (vals < low) | (vals >= high)
    if sentinel is not None:
        bad &= vals != sentinel
    if bool(bad.any()):
        first = int(vals[bad][0])
        extra = f" or {sentinel}" if sentinel is not None else ""
        raise ValueError(
            f"{name}: entries must be in [{low}, {high}){extra}, found {first} "
            f"({int(bad.sum())} entries out of range)"
        )


def check_pool(
    exact_k: Any,
    exact_v: Any,
    k_scale: Any,
    v_scale: Any,
    *,
    device: torch.device | None = None,
    layout: Any = None,
) -> tuple[int, int, int, int]:
    """Check the exact pool and return ``(num_pool_blocks, G, num_kv_heads, D)``.

    ``exact_k``/``exact_v``: ``[P, G, Hkv, D]`` float16, bfloat16 or float8_e4m3fn (same dtype);
    ``k_scale``/``v_scale``: float32 ``[P, G, Hkv]`` when the pool is fp8, else ``None``.
    """
    check_tensor("exact_k", exact_k, dtypes=POOL_DTYPES, ndim=4, device=device)
    p, g, hkv, d = exact_k.shape
    check_tensor(
        "exact_v", exact_v, dtypes=(exact_k.dtype,), shape=(p, g, hkv, d), device=exact_k.device
    )
    check_head_dim("exact_k", d)
    if hkv < 1:
        raise ValueError(
            f"exact_k: needs at least one KV head (dim 2), got shape {list(exact_k.shape)}"
        )
    if layout is not None:
        if g != layout.block_size:
            raise ValueError(
                f"exact_k: pool block of {g} tokens, but layout {layout.format_name!r} has "
                f"{layout.block_size} tokens per block"
            )
        if d != layout.head_dim:
            raise ValueError(
                f"exact_k: head_dim {d}, but layout {layout.format_name!r} has head_dim "
                f"{layout.head_dim}"
            )
    fp8 = exact_k.dtype == torch.float8_e4m3fn
    for sname, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if fp8:
            if s is None:
                raise ValueError(
                    f"{sname}: the pool is float8_e4m3fn, so a float32 [{p}, {g}, {hkv}] "
                    "per-token scale tensor is required"
                )
            check_tensor(sname, s, dtypes=torch.float32, shape=(p, g, hkv), device=exact_k.device)
        elif s is not None:
            raise ValueError(
                f"{sname}: must be None for a {str(exact_k.dtype).removeprefix('torch.')} pool "
                "(scales exist only for float8_e4m3fn pools)"
            )
    return p, g, hkv, d


def check_softmax_scale(value: Any) -> float:
    """``softmax_scale`` must be a finite positive real number (bool refused); returns it as a
    float."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"softmax_scale: must be a finite positive float, got {value!r}")
    return float(value)


def check_count(name: str, value: Any, low: int = 0) -> int:
    """An integer size argument (anything with ``__index__`` but bool) of at least ``low``;
    returns it as an int."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return n


def check_not_partly_aliased(
    name: str, out: torch.Tensor, src_name: str, src: torch.Tensor
) -> None:
    """``out`` may be ``src`` itself (same memory, dtype and shape) or separate memory; an
    output that overlaps its input anywhere else would be read after being written."""
    if torch.compiler.is_compiling():
        return  # fake tensors have no memory; the op's body checks the real ones
    if out.numel() == 0 or src.numel() == 0 or out.device != src.device:
        return
    a0 = out.data_ptr()
    a1 = a0 + out.numel() * out.element_size()
    b0 = src.data_ptr()
    b1 = b0 + src.numel() * src.element_size()
    same = a0 == b0 and out.dtype == src.dtype and out.shape == src.shape
    if a0 < b1 and b0 < a1 and not same:
        raise ValueError(
            f"{name}: overlaps {src_name}'s memory without being {src_name} itself; pass "
            f"{src_name} (in place) or a separate tensor"
        )
