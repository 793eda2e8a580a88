#!/usr/bin/env bash
# Session 13 (carry .whl .dev): the CUDA top-k's and the benchmark's GPU tests (the one-ulp maxima now
# checked for exactness; fast_path/group_path share flagged_out), then the benchmark's table on this machine
# (an H200 when lent); everything packed into one archive.
T0=$(date +%s)
# The tree this call measures is .dev/tree43.tgz (HEAD 69ffe4a + this session's two edits), unpacked apart
# from the copied working tree, which helpers are editing meanwhile.
WHL=$PWD/.whl; tar -C /tmp -xzf .dev/tree43.tgz; cd /tmp/tree43
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=/tmp/r43; mkdir -p $R/bench
(nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; date -u) | tee $R/env.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py tests/test_kernels_bench_goals.py -k "not cpu_rows" > $R/gpu_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $R/gpu_tests.log; tail -3 $R/gpu_tests.log | cut -c1-400
LEFT=$(( ${LIMIT:-580} - ($(date +%s) - T0) )); echo "left $LEFT s"
# Device time ran short (refused starts): no table; conformance at full shapes over the CUDA paths.
OUT=$R/bench WHEELS=$WHL STEPS="conform" CONFORM_IMPLS="ours:default ours:cuda ours:cuda-general ours:cuda-cluster ours:cuda-given-maxima" \
  timeout $LEFT bash bench/indexer_gpu.sh > $R/bench/run.log 2>&1; echo "conform rc=$? at $(( $(date +%s) - T0 )) s" >> $R/bench/run.log
tail -8 $R/bench/run.log | cut -c1-400
tar -C /tmp -czf $OUT/r43.tgz r43; ls -la $OUT
