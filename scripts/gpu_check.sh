#!/usr/bin/env bash
# GPU check on a CUDA machine: the gpu-marked tests, then every benchmark under bench/.
# Logs (and each benchmark's JSON) go to $OUT (default ./gpu-check-logs); a short summary prints last.
# Usage: scripts/gpu_check.sh [--quick]   (--quick goes to the benchmarks that take it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-logs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/device.log"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$OUT/device.log"

# the GPU tests compile many Triton kernels: spread them over worker processes when pytest-xdist is there; tests/exact
# builds 8B-shaped models (about 36 GiB per worker), so it runs apart with fewer workers (more run out of memory)
WORKERS=()
EXACT_WORKERS=()
if "$PY" -c "import xdist" 2>/dev/null; then
  WORKERS=(-n "${GPU_TEST_WORKERS:-6}")
  EXACT_WORKERS=(-n "${GPU_EXACT_TEST_WORKERS:-2}")
fi
"$PY" -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/exact ${WORKERS[@]+"${WORKERS[@]}"} 2>&1 \
  | tee "$OUT/pytest_gpu.log"
test_rc=${PIPESTATUS[0]}
"$PY" -m pytest -m gpu -q -p no:cacheprovider tests/exact ${EXACT_WORKERS[@]+"${EXACT_WORKERS[@]}"} 2>&1 \
  | tee "$OUT/pytest_gpu_exact.log"
exact_rc=${PIPESTATUS[0]}
[ "$test_rc" -ne 0 ] && status=1
[ "$exact_rc" -ne 0 ] && status=1

# every script under bench/ (a file with a __main__ block; bench/common.py and other helpers are skipped), each
# given --json and the arguments of this script only where its --help lists them
declare -A bench_rc
for bench in bench/*.py; do
  grep -q '__name__ == "__main__"' "$bench" || continue
  name="$(basename "$bench" .py)"
  usage="$("$PY" "$bench" --help 2>&1)"
  args=()
  grep -q -- "--json" <<< "$usage" && args+=(--json "$OUT/bench_$name.json")
  for arg in "$@"; do
    grep -q -- "${arg%%=*}" <<< "$usage" && args+=("$arg")
  done
  "$PY" "$bench" ${args[@]+"${args[@]}"} 2>&1 | tee "$OUT/bench_$name.log"
  bench_rc[$name]=${PIPESTATUS[0]}
  [ "${bench_rc[$name]}" -ne 0 ] && status=1
done

echo
echo "== gpu_check summary =="
echo "pytest -m gpu (all but tests/exact): rc=$test_rc  ($(tail -n 1 "$OUT/pytest_gpu.log"))"
echo "pytest -m gpu tests/exact: rc=$exact_rc  ($(tail -n 1 "$OUT/pytest_gpu_exact.log"))"
for name in "${!bench_rc[@]}"; do echo "bench/$name.py: rc=${bench_rc[$name]}"; done
exit $status
