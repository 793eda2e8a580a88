#!/usr/bin/env bash
# Session 12, one call (carry .whl .dev): the lab anomaly's cause (the graph timing's side stream), the
# group_topk guard and the shared compaction on the GPU, then the benchmark's table if time is left.
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L; date -u; git log --oneline -1 2>/dev/null; mkdir -p $OUT/a $OUT/bench
timeout 30 python3 .dev/race_probe.py 2>&1 | tee $OUT/a/probe.log
for V in "A:RAW=1" "F:RAW=0" "G:RAW=1"; do
  N=${V%%:*}; E=${V#*:}
  env $E OUT=$OUT/a timeout 120 python3 .dev/anomaly_lab.py > $OUT/a/$N.log 2>&1; echo "$N ($E) rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/a/$N.log
  grep -v Assertion $OUT/a/$N.log | grep -E "^(32|64) |rc=|Error" | cut -c1-300
done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py tests/test_kernels_bench_goals.py -k "not cpu_rows" > $OUT/a/gpu_tests.log 2>&1; rc=$?; echo "tests rc=$rc at $(( $(date +%s) - T0 )) s" | tee -a $OUT/a/gpu_tests.log; tail -4 $OUT/a/gpu_tests.log | cut -c1-400
LEFT=$(( ${LIMIT:-585} - ($(date +%s) - T0) )); echo "left $LEFT s"
[ $rc -ne 0 ] && { echo "tests failed: no bench"; exit 0; }
[ $LEFT -lt 330 ] && { echo "too little time for the bench"; exit 0; }
OUT=$OUT/bench STEPS="conform bench" CONFORM_IMPLS="ours" timeout $LEFT bash bench/indexer_gpu.sh --skip prefill,deepgemm,variants \
  --cells 32x131072,64x131072,32x262144,64x262144 --no-reference --pipelines unfused_persistent,fused_filter,fused_cuda \
  --topk-shapes 1x32768x512,32x32768x512,64x32768x512 > $OUT/bench/run.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench/run.log
tail -24 $OUT/bench/run.log | cut -c1-700
