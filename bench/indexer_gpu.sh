#!/usr/bin/env bash
# One call on one GPU: environment, kernel correctness at full shapes, the random-layer sweep at
# 128K tokens through both kernels, then the benchmark.
# Usage (from the repository root): OUT=/some/dir [STEPS="tests sweep bench"] bash bench/indexer_gpu.sh [bench args]
# STEPS may also name "profile": ncu's speed-of-light, occupancy, warp-stall, scheduler and memory
# sections of the persistent fp8 decode loop at 32 x 128K (bench/decode_profile.py), into $OUT/profile.txt;
# and "conform": `needlescope kernels conform --shapes full` over $CONFORM_IMPLS (default "ours torch";
# e.g. "ours:filter ours:filter-small-candidates") at $CONFORM_SHAPES (default full; small for a CPU under
# TRITON_INTERPRET=1), into $OUT/conform.json and $OUT/conform.txt.
# Optional: wheels in $WHEELS (default .whl/; e.g. transformers for the random layer, sgl-deep-gemm
# for the side-by-side DeepGEMM timing) are installed into /tmp/site first; nothing else is installed.
set -uo pipefail
OUT=${OUT:-$PWD/indexer-gpu-out}
STEPS=${STEPS:-tests sweep bench}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
$PY -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
rc=0
if [[ " $STEPS " == *" tests "* ]]; then
  NEEDLESCOPE_KERNEL_SHAPES=full $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_filter.py tests/test_kernels_launch.py 2>&1 | tee "$OUT/tests.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" conform "* ]]; then
  impls=()
  for impl in ${CONFORM_IMPLS:-ours torch}; do impls+=(--impl "$impl"); done
  $PY -m needlescope.cli.main kernels conform "${impls[@]}" --shapes "${CONFORM_SHAPES:-full}" --out "$OUT/conform.json" > "$OUT/conform.txt" 2>&1
  status=$?
  grep -v " exact " "$OUT/conform.txt"
  echo "conform rc=$status" | tee -a "$OUT/conform.txt"
  rc=$(( rc || status ))
fi
if [[ " $STEPS " == *" sweep "* ]]; then
  # `needlescope indexer sweep` on a random full-size DeepSeek-V4-Flash indexer layer (64 heads x 128,
  # ratio 4, top-512) at 128K tokens, scored by the Triton kernel and then by the torch reference.
  for kernel in triton reference; do
    start=$(date +%s%N)
    $PY -m needlescope.cli.main indexer sweep --model random-layer --device cuda --kernel $kernel \
      --lengths 32768,131072 --depths 10,50,90 --trials 2 --index-topk 512 \
      --index-k bf16,fp8_e4m3 --index-q bf16,fp8_e4m3 --needle-strength 0.25 \
      --out "$OUT/sweep-$kernel" 2>&1 | tee "$OUT/sweep-$kernel.log"
    rc=$(( rc || PIPESTATUS[0] ))
    echo "sweep --kernel $kernel wall $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$OUT/sweep-$kernel.log"
  done
fi
if [[ " $STEPS " == *" profile "* ]]; then
  ncu --clock-control none -k regex:_paged --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis \
    $PY bench/decode_profile.py --batch 32 --context 131072 --loop persistent 2>&1 | tee "$OUT/profile.txt"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [[ " $STEPS " == *" bench "* ]]; then
  $PY bench/indexer_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
echo "rc=$rc"
exit $rc
