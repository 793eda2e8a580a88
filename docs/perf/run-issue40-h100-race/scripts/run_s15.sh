#!/usr/bin/env bash
# Session 12, second call (carry .whl .dev): the race probe both ways, the test, then the benchmark's table
# of record; everything packed into one file (run 41 lost its JSON to the file count limit).
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=/tmp/r42; mkdir -p $R/bench
(nvidia-smi -L; date -u) | tee $R/env.log
for raw in 1 0; do RAW=$raw timeout 60 python3 .dev/race_probe.py 2>&1 | tee -a $R/probe.log; done
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_bench_goals.py > $R/test.log 2>&1; echo "test rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $R/test.log; tail -2 $R/test.log
LEFT=$(( ${LIMIT:-575} - ($(date +%s) - T0) )); echo "left $LEFT s"
OUT=$R/bench STEPS="conform bench" CONFORM_IMPLS="ours" timeout $LEFT bash bench/indexer_gpu.sh --skip prefill,deepgemm,variants \
  --cells 32x131072,64x131072,32x262144,64x262144 --no-reference --pipelines unfused_persistent,fused_filter,fused_cuda \
  --topk-shapes 1x32768x512,32x32768x512,64x32768x512 > $R/bench/run.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 )) s" >> $R/bench/run.log
tail -8 $R/bench/run.log | cut -c1-400
tar -C /tmp -czf $OUT/r42.tgz r42; ls -la $OUT
