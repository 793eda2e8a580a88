#!/usr/bin/env bash
# Run 27's device call (abridged: progress echoes left out; carry .whl .dev, topk_lab.py then at .dev/topk_lab.py): issue
# 37's GPU table (background) beside the cluster top-k's exactness checks and the CUDA top-k GPU
# tests; then, on the idle GPU, the lab's times. (Its last step, the benchmark, needed the checks
# to pass and did not run.)
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 3
export PYTHONPATH=$PWD/src:$PWD/tests:$PYTHONPATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L; date -u
mkdir -p /tmp/p37 /tmp/lab
(python3 bench/investigate_planted_37.py /tmp/p37 --table cuda:1024,2048 --gpu-jobs 11 --jobs 1 --threads 1 --deadline ${DEADLINE:-260} > /tmp/p37/run.log 2>&1; python3 bench/investigate_planted_37.py --render /tmp/p37/rows.jsonl > /tmp/p37/table.md 2>&1) &
OUT=/tmp/lab LAB_PART=checks timeout 200 python3 .dev/topk_lab.py > /tmp/lab/checks.log 2>&1; echo "checks rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/lab/checks.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda_topk.py -k "not cpu_rows" > /tmp/lab/cuda_tests.log 2>&1; echo "tests rc=$?" >> /tmp/lab/cuda_tests.log
wait
tar czf $OUT/p37.tgz -C /tmp p37/rows.jsonl p37/table.md p37/run.log
OUT=/tmp/lab LAB_PART=times timeout 150 python3 .dev/topk_lab.py > /tmp/lab/times.log 2>&1; echo "times rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/lab/times.log
tar czf $OUT/lab.tgz -C /tmp lab
