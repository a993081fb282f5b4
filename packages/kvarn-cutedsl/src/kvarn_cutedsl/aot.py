"""Ahead-of-time build of the decode kernel, and the loader that runs it.

Build (needs nvidia-cutlass-dsl and a C compiler, no GPU)::

    python -m kvarn_cutedsl.aot --arch sm_90a --out DIR [--preset parity|all]
        [--spec FORMAT:HEAD_DIM:GQA:T:QDTYPE:POOLDTYPE ...]

compiles each specialization with ``cute.compile(..., options="--gpu-arch ARCH
--enable-tvm-ffi")``, exports it with ``export_to_c`` to an object file exposing the tvm-ffi
function ``kvarn_decode_<spec name>``, links all of them into ``DIR/kvarn_cutedsl_<arch>.so``
and writes ``DIR/manifest.json`` (arch, DSL version, specs).

Load (needs only ``libcute_dsl_runtime.so`` and the ``apache-tvm-ffi`` package): set
``KVARN_CUTEDSL_AOT_DIR=DIR`` (or call :func:`load_artifacts`). The runtime library is taken
from ``DIR`` if it was copied there, else from the installed DSL; it is loaded with
RTLD_GLOBAL before the module. Without an AOT artifact for a specialization, and with the
DSL compiler installed, the launcher compiles it once and keeps the linked module in an
on-disk cache (``KVARN_CUTEDSL_CACHE``, default ``~/.cache/kvarn-cutedsl``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from kvarn_cutedsl import _capability as cap
from kvarn_cutedsl._spec import KernelSpec, make_spec

MANIFEST = "manifest.json"
RUNTIME_LIB = "libcute_dsl_runtime.so"
AOT_DIR_ENV = "KVARN_CUTEDSL_AOT_DIR"
CACHE_ENV = "KVARN_CUTEDSL_CACHE"
MANIFEST_VERSION = 1

PRESETS: dict[str, list[tuple[str, int, int, int, str, str]]] = {
    # (format, head_dim, gqa, T, q/out dtype, pool dtype): what the GPU parity suite and the
    # benchmark run (Llama-3.1-8B geometry, small d64, MHA, GQA 3 and 8, T = 2).
    "parity": [
        ("kvarn_k4v2_g64", 128, 4, 1, "bfloat16", "bfloat16"),
        ("kvarn_k4v4_g64", 128, 4, 1, "bfloat16", "bfloat16"),
        ("kvarn_k4v4_g128", 128, 8, 1, "float16", "float16"),
        ("kvarn_k4v4_g64", 64, 3, 1, "float16", "float16"),
        ("kvarn_k4v2_g128", 64, 1, 1, "bfloat16", "float16"),
        ("kvarn_k4v2_g64", 128, 4, 2, "bfloat16", "bfloat16"),
    ],
}
PRESETS["all"] = [
    (f, d, gqa, 1, dt, dt)
    for f in ("kvarn_k4v2_g64", "kvarn_k4v4_g64", "kvarn_k4v2_g128", "kvarn_k4v4_g128")
    for d in (64, 128)
    for gqa in (1, 2, 4, 8)
    for dt in ("bfloat16", "float16")
]


# ------------------------------------------------------------------------------ building
def _dsl_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass-dsl")


def runtime_library_path() -> Path:
    """``libcute_dsl_runtime.so`` of the installed DSL."""
    from cutlass.cute.runtime import find_runtime_libraries

    for lib in find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).name == RUNTIME_LIB:
            return Path(lib)
    raise FileNotFoundError(f"{RUNTIME_LIB} not found in the installed nvidia-cutlass-dsl")


def _link(objects: list[Path], out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("linking the AOT module needs a C compiler (cc or gcc) on PATH")
    # Symbols of the DSL runtime and of tvm-ffi stay undefined: the loader makes them
    # available (RTLD_GLOBAL) before the module is opened.
    cmd = [cc, "-shared", "-o", str(out), *map(str, objects)]
    subprocess.run(cmd, check=True, capture_output=True)


def build(
    specs: list[KernelSpec], arch: str, out_dir: Path, *, copy_runtime: bool = False, log=print
) -> Path:
    """Compile ``specs`` for ``arch`` into ``out_dir``; returns the linked module's path."""
    cap.check_arch(arch, for_build=True)
    for s in specs:
        cap.require(
            arch,
            s.k_bits,
            s.v_bits,
            s.group,
            s.head_dim,
            s.gqa,
            s.query_len,
            s.q_dtype,
            s.pool_dtype,
            s.out_dtype,
            for_build=True,
        )
    from kvarn_cutedsl.compile import compile_spec

    out_dir.mkdir(parents=True, exist_ok=True)
    objects = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):
            log(f"[{i + 1}/{len(specs)}] {arch} {spec.name}")
            fn = compile_spec(spec, arch)
            obj = Path(tmp) / f"{spec.name}.o"
            fn.export_to_c(str(obj), spec.function_name)
            objects.append(obj)
        lib = out_dir / f"kvarn_cutedsl_{arch}.so"
        _link(objects, lib)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "arch": arch,
        "nvidia_cutlass_dsl": _dsl_version(),
        "library": lib.name,
        "specs": [s.to_json() for s in specs],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if copy_runtime:
        shutil.copy2(runtime_library_path(), out_dir / RUNTIME_LIB)
    return lib


def _parse_spec(text: str) -> KernelSpec:
    parts = text.split(":")
    if len(parts) != 6:
        raise argparse.ArgumentTypeError(
            f"--spec {text!r}: expected FORMAT:HEAD_DIM:GQA:T:QDTYPE:POOLDTYPE, e.g. "
            "kvarn_k4v2_g64:128:4:1:bfloat16:bfloat16"
        )
    f, d, gqa, t, qd, pd = parts
    try:
        return make_spec(f, int(d), int(gqa), int(t), qd, pd)
    except (ValueError, NotImplementedError) as exc:  # FormatError is a ValueError
        raise argparse.ArgumentTypeError(f"--spec {text!r}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvarn_cutedsl.aot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arch", required=True, help=f"one of {sorted(cap.BUILDABLE_ARCHS)}")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        type=_parse_spec,
        help="FORMAT:HEAD_DIM:GQA:T:QDTYPE:POOLDTYPE (repeatable)",
    )
    p.add_argument(
        "--copy-runtime",
        action="store_true",
        help=f"copy {RUNTIME_LIB} next to the module (for a machine without the DSL)",
    )
    a = p.parse_args(argv)
    specs = list(a.spec)
    if a.preset or not specs:
        specs += [make_spec(*row) for row in PRESETS[a.preset or "parity"]]
    try:
        lib = build(specs, a.arch, a.out, copy_runtime=a.copy_runtime)
    except (NotImplementedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(
            f"error: building kernels needs the CuTe DSL ({exc}); install it with "
            "`pip install 'nvidia-cutlass-dsl>=4.8,<4.9'` (a dependency of kvarn-cutedsl)",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {lib} ({len(specs)} specializations) and {a.out / MANIFEST}")
    return 0


# ------------------------------------------------------------------------------ loading
_lock = threading.Lock()
_runtime_loaded: list[str] = []
_modules: dict[str, object] = {}  # library path -> tvm_ffi module
_functions: dict[tuple[str, KernelSpec], object] = {}


class ArtifactError(RuntimeError):
    """An AOT directory or module that cannot serve a call."""


def _load_runtime(search: list[Path]) -> None:
    if _runtime_loaded:
        return
    for d in search:
        cand = d / RUNTIME_LIB
        packed = d / (RUNTIME_LIB + ".gz")
        if not cand.is_file() and packed.is_file():
            # shipped gzipped (18 MB instead of 43 MB): unpack once into the cache folder
            cand = _unpack_runtime(packed)
        if cand.is_file():
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            _runtime_loaded.append(str(cand))
            return
    try:
        lib = runtime_library_path()
    except (ImportError, OSError, FileNotFoundError) as exc:
        raise ArtifactError(
            f"{RUNTIME_LIB} was found neither in {[str(d) for d in search]} nor in an "
            f"installed nvidia-cutlass-dsl ({exc}); build with --copy-runtime or install "
            "nvidia-cutlass-dsl-libs-base"
        ) from exc
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded.append(str(lib))


def _unpack_runtime(packed: Path) -> Path:
    import gzip

    digest = hashlib.sha256(
        f"{packed.resolve()}:{packed.stat().st_size}:{packed.stat().st_mtime_ns}".encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvarn-cutedsl")
    dest = root / "runtime" / digest / RUNTIME_LIB
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(f".tmp{os.getpid()}")
        with gzip.open(packed, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.replace(dest)
    return dest


def _load_tvm_ffi():
    try:
        import tvm_ffi
    except ImportError as exc:
        raise ArtifactError(
            "loading kvarn-cutedsl AOT modules needs the apache-tvm-ffi package "
            f"({exc}); pip install apache-tvm-ffi"
        ) from exc
    libdir = Path(tvm_ffi.__file__).parent / "lib"
    for cand in sorted(libdir.glob("libtvm_ffi*.so")):
        ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi


def read_manifest(directory: Path) -> dict:
    """The manifest of an AOT directory, checked; raises ArtifactError naming the problem."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(
            f"{path} does not exist: build it with "
            f"`python -m kvarn_cutedsl.aot --arch ARCH --out {directory}`"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from exc
    for key in ("manifest_version", "arch", "library", "specs"):
        if key not in data:
            raise ArtifactError(f"{path}: missing key {key!r}")
    if data["manifest_version"] != MANIFEST_VERSION:
        raise ArtifactError(
            f"{path}: manifest_version {data['manifest_version']}, this "
            f"kvarn-cutedsl reads {MANIFEST_VERSION}; rebuild the artifacts"
        )
    specs = data["specs"]
    if not isinstance(specs, list):
        raise ArtifactError(f"{path}: 'specs' must be a list, got {type(specs).__name__}")
    fields = {f.name for f in dataclasses.fields(KernelSpec)}
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or set(spec) != fields:
            raise ArtifactError(
                f"{path}: specs[{i}] must be an object with the keys {sorted(fields)}, got "
                f"{sorted(spec) if isinstance(spec, dict) else type(spec).__name__}"
            )
    if not isinstance(data["library"], str) or not isinstance(data["arch"], str):
        raise ArtifactError(f"{path}: 'library' and 'arch' must be strings")
    return data


def load_artifacts(directory: str | os.PathLike, arch: str) -> dict[KernelSpec, object]:
    """Load the AOT module of ``directory`` for a device of ``arch``; returns spec -> function.

    Raises ArtifactError when the directory was built for another arch, its module is
    missing, or the runtime libraries cannot be found.
    """
    directory = Path(directory)
    data = read_manifest(directory)
    if data["arch"] != arch:
        raise ArtifactError(
            f"{directory} holds kernels for {data['arch']}, but the device "
            f"is {arch}; rebuild with --arch {arch}"
        )
    lib = directory / data["library"]
    if not lib.is_file():
        raise ArtifactError(f"{lib} (named by {directory / MANIFEST}) does not exist")
    specs = [KernelSpec(**s) for s in data["specs"]]
    with _lock:
        _load_runtime([directory])
        tvm_ffi = _load_tvm_ffi()
        key = str(lib.resolve())
        if key not in _modules:
            _modules[key] = tvm_ffi.load_module(key)
        mod = _modules[key]
    return {s: getattr(mod, s.function_name) for s in specs}


def _cache_dir(arch: str) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvarn-cutedsl")
    return root / arch / _dsl_version()


def jit_function(spec: KernelSpec, arch: str):
    """Compile (or reuse from the on-disk cache) one specialization; needs the DSL."""
    digest = hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()
    out = _cache_dir(arch) / digest[:16]
    if not (out / MANIFEST).is_file():
        tmp = Path(
            tempfile.mkdtemp(prefix="build-", dir=out.parent if out.parent.exists() else None)
        )
        build([spec], arch, tmp, log=lambda *_: None)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return load_artifacts(out, arch)[spec]


def get_function(spec: KernelSpec, arch: str):
    """The compiled function of ``spec``: from ``KVARN_CUTEDSL_AOT_DIR`` if it has it, else
    JIT-compiled with the on-disk cache; ArtifactError when neither is possible."""
    key = (arch, spec)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    aot_dir = os.environ.get(AOT_DIR_ENV)
    if aot_dir:
        fns = load_artifacts(aot_dir, arch)
        fn = fns.get(spec)
    if fn is None:
        try:
            import cutlass  # noqa: F401
        except (ImportError, OSError) as exc:
            where = f"{AOT_DIR_ENV}={aot_dir} has no" if aot_dir else f"{AOT_DIR_ENV} is unset, no"
            raise ArtifactError(
                f"{where} AOT kernel for {spec.name} ({arch}) and the CuTe DSL compiler is "
                f"not installed ({type(exc).__name__}: {exc}); build it with `python -m "
                f"kvarn_cutedsl.aot --arch {arch} --out DIR --spec {spec.format_name}:"
                f"{spec.head_dim}:{spec.gqa}:{spec.query_len}:{spec.q_dtype}:"
                f"{spec.pool_dtype}` or pip install nvidia-cutlass-dsl"
            ) from exc
        fn = jit_function(spec, arch)
    _functions[key] = fn
    return fn


if __name__ == "__main__":
    raise SystemExit(main())
