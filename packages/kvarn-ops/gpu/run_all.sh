#!/usr/bin/env bash
# Everything kvarn-ops proves and measures on a CUDA machine, in one command.
#
#   bash packages/kvarn-ops/gpu/run_all.sh WHEEL_DIR OUT_DIR [parity|bench|all]
#
# WHEEL_DIR holds the kvarn-formats and kvarn-ops wheels (built on any machine with
# `python -m build --wheel packages/kvarn-formats packages/kvarn-ops`); the GPU machine needs
# torch, triton and pytest already installed and no network. Results land in OUT_DIR.
set -uo pipefail
wheels=${1:?wheel directory}
out=${2:?output directory}
what=${3:-all}
here=$(cd "$(dirname "$0")" && pwd)
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl || exit 3
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
status=0
if [ "$what" = parity ] || [ "$what" = all ]; then
  python3 "$here/parity.py" --out "$out/parity.json" || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for bench in "$here"/../benchmarks/bench_*.py; do
    name=$(basename "$bench" .py)
    python3 "$bench" --out "$out/$name.json" || status=1
  done
fi
exit $status
