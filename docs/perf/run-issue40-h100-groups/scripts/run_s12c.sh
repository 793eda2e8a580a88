#!/usr/bin/env bash
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L; date -u; mkdir -p $OUT/lab
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > $OUT/lab/cuda_tests.log 2>&1; rc=$?; echo "tests rc=$rc at $(( $(date +%s) - T0 )) s" | tee -a $OUT/lab/cuda_tests.log; tail -3 $OUT/lab/cuda_tests.log | cut -c1-400
OUT=$OUT/lab timeout 200 python3 .dev/lab3.py > $OUT/lab/lab3.log 2>&1; echo "lab rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/lab/lab3.log; tail -8 $OUT/lab/lab3.log | cut -c1-900
P=$(cat /tmp/pick 2>/dev/null || echo none); echo "PICK=$P"
[ $rc -ne 0 ] || [ "$P" = none ] && { echo "no bench"; exit 0; }
if [ "$P" != hybrid ]; then cp .dev/h_$P.cu src/needlescope/kernels/cuda_topk.cu; timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > $OUT/lab/cuda_tests_$P.log 2>&1; echo "$P tests rc=$?" | tee -a $OUT/lab/cuda_tests_$P.log; fi
LEFT=$(( ${LIMIT:-580} - ($(date +%s) - T0) )); echo "left $LEFT s"
mkdir -p $OUT/bench
OUT=$OUT/bench STEPS="conform bench" CONFORM_IMPLS="ours" timeout $LEFT bash bench/indexer_gpu.sh --skip prefill,deepgemm,variants \
  --cells 32x131072,64x131072,32x262144,64x262144 --no-reference --pipelines unfused_persistent,fused_filter,fused_cuda \
  --topk-shapes 1x32768x512,32x32768x512,64x32768x512 > $OUT/bench/run.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench/run.log
tail -24 $OUT/bench/run.log | cut -c1-700
