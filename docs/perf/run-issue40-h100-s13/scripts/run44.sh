#!/usr/bin/env bash
# Session 13, second call on the same warm machine (carry .whl .dev): the full-shape GPU tests of the
# Triton kernels (bench/indexer_gpu.sh's "tests" step) on the same tree as run 43, within what was left
# of the device budget (230 s).
tar -C /tmp -xzf .dev/tree43.tgz; cd /tmp/tree43; mkdir -p /tmp/r44
python3 -m pip install -q --no-index --no-deps --target /tmp/site $OLDPWD/.whl/*.whl
export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site HF_HUB_OFFLINE=1
NEEDLESCOPE_KERNEL_SHAPES=full timeout 230 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py \
  tests/test_kernels_filter.py tests/test_kernels_launch.py > /tmp/r44/tests.log 2>&1; echo "rc=$?" >> /tmp/r44/tests.log
cp /tmp/r44/tests.log $OUT/
