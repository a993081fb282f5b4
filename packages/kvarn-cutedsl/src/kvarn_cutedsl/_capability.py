"""Which GPUs and formats the CuTe DSL decode serves: the one predicate that the launcher,
the AOT builder and the tests share.

``VALIDATED_ARCHS`` are architectures the kernel has run on and matched the reference.
``COMPILED_ONLY_ARCHS`` are architectures the same code path compiles for (checked by the CPU
tests) but that no one has run it on: they are refused at run time and accepted by the AOT
builder. Everything is refused with a ``NotImplementedError`` before any compile.

``KVARN_CUTEDSL_ARCH`` (e.g. ``sm_90a``) names the arch on machines without a visible GPU,
for offline compiles and tests; where a GPU is visible it must agree with it (it can never let
a kernel run on an arch it was not validated on).
"""

from __future__ import annotations

import functools
import os

ARCH_ENV = "KVARN_CUTEDSL_ARCH"

VALIDATED_ARCHS: frozenset[str] = frozenset({"sm_90a"})
"""Run on real hardware and matched kvarn_ops.reference.decode (H200, 2026-11-30)."""
COMPILED_ONLY_ARCHS: frozenset[str] = frozenset({"sm_120a"})
"""The same kernel compiles for these (CPU test), never run: refused at run time."""
BUILDABLE_ARCHS = VALIDATED_ARCHS | COMPILED_ONLY_ARCHS

SUPPORTED_K_BITS = (4,)
SUPPORTED_V_BITS = (2, 4)
SUPPORTED_GROUPS = (64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_MAX_ROWS = 8
"""Largest T * GQA (query rows per KV head) one CTA holds: the shared-memory tiles and the
per-thread accumulators are sized by it."""
SUPPORTED_POOL_DTYPES = ("bfloat16", "float16")
SUPPORTED_MODEL_DTYPES = ("bfloat16", "float16")


def arch_of(major: int, minor: int) -> str:
    """``(9, 0)`` -> ``"sm_90a"``: the arch-specific target the DSL compiles for."""
    return f"sm_{major}{minor}a"


@functools.cache
def _device_arch(index: int) -> str:
    import torch

    if not torch.cuda.is_available():
        raise NotImplementedError(
            f"kvarn-cutedsl needs a CUDA GPU and none is visible; supported: "
            f"{sorted(VALIDATED_ARCHS)} (set {ARCH_ENV}=sm_90a to compile offline)"
        )
    major, minor = torch.cuda.get_device_capability(index)
    return arch_of(major, minor)


def device_arch(index: int | None = None) -> str:
    """Arch of the current (or given) CUDA device, cached. Without a visible GPU,
    ``KVARN_CUTEDSL_ARCH`` names it; with one, the variable must name the device's own arch.

    Raises
    ------
    NotImplementedError
        No GPU is visible and the variable is not set.
    ValueError
        The variable names another arch than the visible device's (naming the variable).
    """
    import torch

    override = (os.environ.get(ARCH_ENV) or "").strip()
    if override and not torch.cuda.is_available():
        return override
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    arch = _device_arch(index)
    if override and override != arch:
        raise ValueError(
            f"{ARCH_ENV}={override}: the visible GPU is {arch}; the variable only names the arch "
            "for offline compiles on machines without a GPU (unset it)"
        )
    return arch


def clear_cache() -> None:
    """Forget cached device archs (tests that mock the device)."""
    _device_arch.cache_clear()


def check_arch(arch: str, *, for_build: bool = False) -> None:
    """Refuse an arch the kernel is not validated on (or, for an AOT build, not known to
    compile for). Raises NotImplementedError naming the arch and what is supported."""
    allowed = BUILDABLE_ARCHS if for_build else VALIDATED_ARCHS
    if arch in allowed:
        return
    extra = ""
    if not for_build and arch in COMPILED_ONLY_ARCHS:
        extra = " (it compiles for this arch but has never been run on one)"
    raise NotImplementedError(
        f"kvarn-cutedsl decode is not validated on {arch}{extra}; supported: "
        f"{sorted(allowed)}. Use kvarn_ops.decode (Triton) on this GPU."
    )


def check_format(k_bits: int, v_bits: int, group: int, head_dim: int, name: str = "") -> None:
    """Refuse a dense format / head_dim the kernel does not implement."""
    for what, value in (("k_bits", k_bits), ("v_bits", v_bits), ("group", group)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{what}: must be an integer, got {value!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        raise ValueError(f"head_dim: must be an integer, got {head_dim!r}")
    label = name or f"kvarn_k{k_bits}v{v_bits}_g{group}"
    problems = []
    if k_bits not in SUPPORTED_K_BITS:
        problems.append(f"K bits {k_bits} (supported: {SUPPORTED_K_BITS})")
    if v_bits not in SUPPORTED_V_BITS:
        problems.append(f"V bits {v_bits} (supported: {SUPPORTED_V_BITS})")
    if group not in SUPPORTED_GROUPS:
        problems.append(f"group {group} (supported: {SUPPORTED_GROUPS})")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim {head_dim} (supported: {SUPPORTED_HEAD_DIMS})")
    if problems:
        raise NotImplementedError(
            f"kvarn-cutedsl decode does not implement {label} at head_dim {head_dim}: "
            + "; ".join(problems)
            + ". Supported: kvarn_k4v2/k4v4 with g64/g128 at head_dim 64/128; "
            "use kvarn_ops.decode (Triton) for the others."
        )


def check_geometry(gqa: int, query_len: int, q_dtype: str, pool_dtype: str, out_dtype: str) -> None:
    """Refuse query geometry or dtypes the kernel does not implement (ValueError for values
    that are no geometry at all: non-positive or non-integer)."""
    for name, value in (("gqa", gqa), ("query_len", query_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if gqa * query_len > SUPPORTED_MAX_ROWS:
        raise NotImplementedError(
            f"kvarn-cutedsl decode serves at most {SUPPORTED_MAX_ROWS} query rows per KV head "
            f"(T * GQA); got T={query_len}, GQA={gqa}. Use kvarn_ops.decode (Triton)."
        )
    if pool_dtype not in SUPPORTED_POOL_DTYPES:
        raise NotImplementedError(
            f"kvarn-cutedsl decode does not implement an exact pool of {pool_dtype}; "
            f"supported: {SUPPORTED_POOL_DTYPES}. Use kvarn_ops.decode (Triton) for fp8 pools."
        )
    for what, dt in (("q", q_dtype), ("out", out_dtype)):
        if dt not in SUPPORTED_MODEL_DTYPES:
            raise NotImplementedError(
                f"kvarn-cutedsl decode does not implement {what} of {dt}; supported: "
                f"{SUPPORTED_MODEL_DTYPES}"
            )


def is_supported(
    arch: str,
    k_bits: int,
    v_bits: int,
    group: int,
    head_dim: int,
    gqa: int = 1,
    query_len: int = 1,
    q_dtype: str = "bfloat16",
    pool_dtype: str = "bfloat16",
    out_dtype: str | None = None,
) -> bool:
    """True when :func:`require` would pass (the predicate tests skip with)."""
    try:
        require(
            arch, k_bits, v_bits, group, head_dim, gqa, query_len, q_dtype, pool_dtype, out_dtype
        )
    except NotImplementedError:
        return False
    return True


def require(
    arch: str,
    k_bits: int,
    v_bits: int,
    group: int,
    head_dim: int,
    gqa: int = 1,
    query_len: int = 1,
    q_dtype: str = "bfloat16",
    pool_dtype: str = "bfloat16",
    out_dtype: str | None = None,
    *,
    for_build: bool = False,
) -> None:
    """Every refusal, in order: arch, format, geometry and dtypes."""
    check_arch(arch, for_build=for_build)
    check_format(k_bits, v_bits, group, head_dim)
    check_geometry(gqa, query_len, q_dtype, pool_dtype, out_dtype or q_dtype)
