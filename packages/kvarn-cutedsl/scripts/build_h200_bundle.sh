#!/usr/bin/env bash
# Build what the GPU machine (sm_90a, Python 3.12, no network, no DSL) needs to run the CuTe DSL
# decode, into the git-ignored build/ folder of this package:
#   build/aot/sm_90a/       kvarn_cutedsl_sm_90a.so + manifest.json (python -m kvarn_cutedsl.aot)
#                           libcute_dsl_runtime.so.gz (the DSL runtime, from the installed DSL)
#   build/wheels/           the cp312 apache-tvm-ffi wheel the loader imports, and wheels of
#                           kvarn-formats, kvarn-ops (the oracle) and kvarn-cutedsl
# Needs nvidia-cutlass-dsl 4.8.x and apache-tvm-ffi installed here, a C compiler and PyPI.
# Usage: scripts/build_h200_bundle.sh [extra python -m kvarn_cutedsl.aot arguments]
set -euo pipefail
pkg="$(cd "$(dirname "$0")/.." && pwd)"
out="$pkg/build/aot/sm_90a"
rm -rf "$out" "$pkg/build/wheels"
mkdir -p "$out" "$pkg/build/wheels"
python3 -m kvarn_cutedsl.aot --arch sm_90a --out "$out" --preset parity "$@"
rt="$(python3 -c 'from kvarn_cutedsl.aot import runtime_library_path as p; print(p())')"
gzip -9 -c "$rt" > "$out/libcute_dsl_runtime.so.gz"
tvm_version="$(python3 -c 'from importlib.metadata import version; print(version("apache-tvm-ffi"))')"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$pkg/build/wheels" "apache-tvm-ffi==$tvm_version"
python3 -m pip wheel -q --no-deps -w "$pkg/build/wheels" "$pkg/../kvarn-formats" \
    "$pkg/../kvarn-ops" "$pkg"
ls -la "$pkg/build/wheels" "$out"
du -sh "$pkg/build"
