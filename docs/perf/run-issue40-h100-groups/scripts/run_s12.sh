#!/usr/bin/env bash
# Session 11, call 1 (carry .whl .dev): GPU tests of the group path, conformance at full shapes, the lab.
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L; date -u; mkdir -p $OUT/g
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > $OUT/g/cuda_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/g/cuda_tests.log; tail -5 $OUT/g/cuda_tests.log | cut -c1-600
NEEDLESCOPE_KERNEL_SHAPES=full timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "fused_decode_topk_equals" > $OUT/g/decode_tests.log 2>&1; echo "decode tests rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/g/decode_tests.log; tail -4 $OUT/g/decode_tests.log | cut -c1-600
timeout 120 python3 -m needlescope.cli.main kernels conform --impl ours:cuda-given-maxima --shapes full --out $OUT/g/conform.json > $OUT/g/conform.txt 2>&1; echo "conform rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/g/conform.txt; grep -v " exact " $OUT/g/conform.txt | tail -8 | cut -c1-400
OUT=$OUT/g timeout 200 python3 .dev/groups_lab.py > $OUT/g/lab.log 2>&1; echo "lab rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/g/lab.log; cat $OUT/g/lab.log | cut -c1-700
