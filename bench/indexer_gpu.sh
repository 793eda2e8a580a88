#!/usr/bin/env bash
# One call on one GPU: environment, kernel correctness at full shapes, then the benchmark.
# Usage (from the repository root): OUT=/some/dir bash bench/indexer_gpu.sh [--quick] [--skip ...]
# Optional: wheels in .whl/ (e.g. sgl-deep-gemm, for the side-by-side DeepGEMM timing) are
# installed into /tmp/site first; nothing else is installed.
set -uo pipefail
OUT=${OUT:-$PWD/indexer-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NEEDLESCOPE_KERNEL_SHAPES=full $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
$PY bench/indexer_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
