#!/usr/bin/env bash
# Session 9, one call (carry .whl .dev): GPU tests of the tree (cluster rule), phase stamps, lab
# checks and times (pull / push / gather), the gather form into the tree if exact and faster
# (then its GPU tests), then conformance + the benchmark's full table with the time left.
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L; date -u
mkdir -p /tmp/lab
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > /tmp/lab/cuda_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/lab/cuda_tests.log
tail -3 /tmp/lab/cuda_tests.log
OUT=/tmp/lab LAB_PART=checks timeout 90 python3 .dev/topk_lab.py > /tmp/lab/checks.log 2>&1; echo "checks rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/lab/checks.log
tail -4 /tmp/lab/checks.log | cut -c1-1200; tar czf $OUT/lab.tgz -C /tmp lab
OUT=/tmp/lab LAB_PART=times timeout 100 python3 .dev/topk_lab.py > /tmp/lab/times.log 2>&1; echo "times rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/lab/times.log
tar czf $OUT/lab.tgz -C /tmp lab; tail -12 /tmp/lab/times.log | cut -c1-400
[ "${STAMP:-1}" = 1 ] && OUT=/tmp/lab timeout 45 python3 .dev/stamp_lab.py > /tmp/lab/stamp.log 2>&1; echo "stamp rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/lab/stamp.log
cut -c1-700 /tmp/lab/stamp.log; tar czf $OUT/lab.tgz -C /tmp lab
if python3 .dev/decide.py; then
  mkdir -p /tmp/bak; cp src/needlescope/kernels/cuda_topk.cu src/needlescope/kernels/cuda_topk.py /tmp/bak/
  cp .dev/tree_gather.cu src/needlescope/kernels/cuda_topk.cu
  sed -i 's/65536: ("needlescope_topk_cluster_64k", 512),/65536: ("needlescope_topk_cluster_64k", 1024),/' src/needlescope/kernels/cuda_topk.py
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > /tmp/lab/cuda_tests_gather.log 2>&1; rc=$?
  echo "gather tests rc=$rc at $(( $(date +%s) - T0 )) s" >> /tmp/lab/cuda_tests_gather.log; tail -3 /tmp/lab/cuda_tests_gather.log
  if [ $rc -ne 0 ]; then cp /tmp/bak/cuda_topk.cu /tmp/bak/cuda_topk.py src/needlescope/kernels/; echo TREE=pull > /tmp/lab/tree; else echo TREE=gather > /tmp/lab/tree; fi
else echo TREE=pull > /tmp/lab/tree; fi
cat /tmp/lab/tree; tar czf $OUT/lab.tgz -C /tmp lab
LEFT=$(( ${LIMIT:-582} - ($(date +%s) - T0) ))
[ $LEFT -lt 120 ] && { echo "no time for the bench ($LEFT s)"; exit 0; }
mkdir -p $OUT/bench; cp /tmp/lab/tree $OUT/bench/
OUT=$OUT/bench STEPS="conform bench" CONFORM_IMPLS="ours" timeout $LEFT bash bench/indexer_gpu.sh --skip prefill,deepgemm,variants \
  --cells 32x131072,64x131072,32x262144,64x262144 --no-reference --pipelines unfused_persistent,fused_filter \
  --topk-shapes 1x32768x512,32x32768x512,64x32768x512 > $OUT/bench/run.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/bench/run.log
tail -25 $OUT/bench/run.log | cut -c1-600
