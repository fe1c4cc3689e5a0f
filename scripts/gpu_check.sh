#!/usr/bin/env bash
# Kernel check on a machine with an NVIDIA GPU (H100/H200, CUDA 12 or 13 driver):
#   1. installs what is missing from wheels carried in $WHEELS (no network):
#      the project and its deps, the JAX CUDA plugin matching the installed jax,
#      pytest/hypothesis/scipy, and cupy (optional: without it the CUDA C column
#      of the benchmark says "skipped");
#   2. runs tests/kernels and tests/bench/test_kernels.py natively on the GPU (the same tests
#      run interpreted on CPU);
#   3. runs `thoughtjax bench kernels` (XLA vs Pallas/Triton vs CUDA C, thoughtjax/bench/cuda/*.cu).
# Results go to $OUT: kernels-tests.txt/.xml, bench-kernels.json/.txt, env.txt.
#
# Usage: WHEELS=/path/to/wheels OUT=/path/to/results scripts/gpu_check.sh
# Exit status: 0 when tests pass and the benchmark's outputs agree, else non-zero
# (both steps always run).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
WHEELS=${WHEELS:-$PWD/wheels}
mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # leave GPU memory for CuPy's kernels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[gpu_check] $*" >&2; }
pip_wheels() { "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$@"; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }

if ! nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; then
  log "nvidia-smi failed: no NVIDIA GPU visible here"; exit 2
fi
cuda_major=$(sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' "$OUT/nvidia-smi.txt" | head -n1)
log "driver supports CUDA ${cuda_major:-?}"
[ -d "$WHEELS" ] || log "no wheel folder at $WHEELS: only what is installed can be used"

# ---- 1. install what is missing
has thoughtjax || pip_wheels --no-build-isolation -e . || log "could not install the project from $WHEELS"
for module_and_wheel in pytest:pytest hypothesis:hypothesis scipy:scipy rich:rich; do
  has "${module_and_wheel%%:*}" || pip_wheels "${module_and_wheel#*:}" \
    || log "missing ${module_and_wheel#*:} (not in $WHEELS)"
done
gpu_backend() { "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; }
if ! gpu_backend; then
  jax_version=$("$PY" -c "import jax; print(jax.__version__)")
  # CUDA 13 drivers also run the CUDA 12 plugin; prefer the matching one if carried.
  flavours="cuda12"; [ "${cuda_major:-12}" -ge 13 ] && flavours="cuda13 cuda12"
  for flavour in $flavours; do
    log "installing jax[$flavour]==$jax_version from $WHEELS"
    pip_wheels "jax[$flavour]==$jax_version" && gpu_backend && break
  done
fi
if ! gpu_backend; then
  log "JAX does not see the GPU; carry jax-cuda12-plugin/jax-cuda12-pjrt (and nvidia-*) wheels"
  "$PY" -c "import jax; print(jax.devices())" >"$OUT/env.txt" 2>&1
  exit 3
fi
if ! has cupy; then
  for wheel in "cupy-cuda${cuda_major:-12}x" cupy-cuda12x; do
    pip_wheels "$wheel" && break
  done || log "cupy not installed: the CUDA C kernels will be reported as skipped"
fi

"$PY" - >"$OUT/env.txt" 2>&1 <<'EOF'
import jax, jaxlib, platform
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, platform.platform())
print("devices", jax.devices(), [d.device_kind for d in jax.devices()])
try:
  import cupy
  print("cupy", cupy.__version__, "cuda runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as e:
  print("cupy unavailable:", e)
EOF
cat "$OUT/env.txt" >&2

# ---- 2. kernel tests, natively on the GPU
"$PY" -m pytest tests/kernels tests/bench/test_kernels.py -q -p no:cacheprovider --junitxml="$OUT/kernels-tests.xml" \
  2>&1 | tee "$OUT/kernels-tests.txt"
tests_status=${PIPESTATUS[0]}

# ---- 3. benchmark
"$PY" -m thoughtjax.bench.kernels --json "$OUT/bench-kernels.json" 2>&1 \
  | tee "$OUT/bench-kernels.txt"
bench_status=${PIPESTATUS[0]}

log "tests exit $tests_status, bench exit $bench_status; results in $OUT"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
