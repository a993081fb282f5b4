#!/usr/bin/env bash
# The CuTe DSL decode on the GPU machine (sm_90a, Python 3.12, torch + triton + pytest, no
# network, no DSL): installs the wheels of build/wheels into a temporary folder, then runs the
# parity suite and the benchmark against the AOT kernels of build/aot/sm_90a.
#
#   bash packages/kvarn-cutedsl/gpu/run_h200.sh OUT_DIR [parity|bench|all]
#
# build/ comes from scripts/build_h200_bundle.sh on a machine with the DSL.
set -uo pipefail
out=${1:?output directory}
what=${2:-all}
pkg=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$pkg"/build/wheels/*.whl || exit 3
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export KVARN_CUTEDSL_AOT_DIR="$pkg/build/aot/sm_90a"
export KVARN_CUTEDSL_CACHE="${KVARN_CUTEDSL_CACHE:-$site/cache}"
mkdir -p "$out"
status=0
if [ "$what" = parity ] || [ "$what" = all ]; then
  python3 -m pytest -q -rA -s -p no:cacheprovider --junitxml="$out/cutedsl_parity.xml" \
    "$pkg/gpu/test_cutedsl_parity.py" 2>&1 | tee "$out/cutedsl_parity.txt" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 "$pkg/benchmarks/bench_cutedsl.py" --out "$out/bench_cutedsl.json" || status=1
fi
exit $status
