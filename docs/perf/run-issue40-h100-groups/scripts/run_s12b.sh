#!/usr/bin/env bash
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L; date -u; mkdir -p $OUT/g
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > $OUT/g/cuda_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/g/cuda_tests.log; tail -4 $OUT/g/cuda_tests.log | cut -c1-400
OUT=$OUT/g timeout ${LABT:-330} python3 .dev/groups_lab2.py > $OUT/g/lab2.log 2>&1; echo "lab rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/g/lab2.log; grep -v Assertion $OUT/g/lab2.log | tail -30 | cut -c1-900
