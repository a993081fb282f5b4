"""Compiling one decode specialization with the CuTe DSL (needs nvidia-cutlass-dsl).

Every tensor crosses the FFI as a flat 1-D view with a dynamic length, so one artifact serves
every batch size, context length and cache size of its specialization; the host launcher
computes the indices. The CUDA stream is an explicit argument (the launcher passes torch's
current stream), so CUDA-graph capture on a side stream works.
"""

from __future__ import annotations

from kvarn_cutedsl.kernel import DenseDecode, KernelSpec

COMPILE_OPTIONS = "--enable-tvm-ffi"
"""Always on: the compiled function takes torch tensors through DLPack (tvm-ffi ABI)."""


def fake_arguments(spec: KernelSpec) -> tuple:
    """Placeholder arguments ``cute.compile`` traces the launcher with."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from kvarn_cutedsl.kernel import _DTYPES

    def flat(dtype, align=16):
        return make_fake_compact_tensor(dtype, (cute.sym_int64(),), assumed_align=align)

    return (
        flat(_DTYPES[spec.q_dtype]),
        flat(cutlass.Uint8),
        flat(cutlass.Float16),
        flat(cutlass.Int32, 4),
        flat(cutlass.Int32, 4),
        flat(cutlass.Int32, 4),
        flat(_DTYPES[spec.pool_dtype]),
        flat(_DTYPES[spec.pool_dtype]),
        flat(cutlass.Float32),
        flat(_DTYPES[spec.out_dtype]),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        make_fake_stream(),
    )


def compile_spec(spec: KernelSpec, arch: str | None):
    """``cute.compile`` one specialization; ``arch`` (e.g. ``"sm_90a"``) compiles for that GPU
    without needing one present, ``None`` for the device in this process."""
    import cutlass.cute as cute

    opts = COMPILE_OPTIONS if arch is None else f"--gpu-arch {arch} {COMPILE_OPTIONS}"
    return cute.compile(DenseDecode(spec), *fake_arguments(spec), options=opts)
