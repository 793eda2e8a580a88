#!/usr/bin/env bash
# The recipe of the shipped organism weights (docs/organism.md): two `needlescope organism
# train` stages, the second continuing from the first. About 8 minutes on one H200.
#
#   stage 1: dense training, 1400-step schedule stopped at step 607: a 256-token sliding
#            window on short examples for the first 420 steps, then the real 32-token window
#            with the length ramp; then 150 steps of indexer distillation.
#   stage 2: dense training from stage 1, lengths 128-4096 ramped over 160 steps, chats
#            weighted towards multi-turn; then 100 steps of indexer distillation.
#
# usage: bench/organism_recipe.sh OUT [PYTHON]   (stage 1 goes to OUT/stage1, bf16 weights to OUT/organism)
set -euo pipefail
out=$1 python=${2:-python3}
train() { "$python" -m needlescope.cli.main organism train --seed 0 --value-digits 3 --eval-every 200 "$@"; }
train --out "$out/stage1" --steps-dense 1400 --dense-stop 607 --steps-distil 150 \
  --wide-window 256 --wide-window-frac 0.3 --min-len 128 --max-len 4096 --ramp-frac 0.5
train --out "$out/organism" --init-from "$out/stage1" --steps-dense 400 --steps-distil 100 \
  --lr 2e-3 --min-len 128 --max-len 4096 --ramp-frac 0.4 --kind-weights 0.2,0.1,0.05,0.55,0.1
"$python" "$(dirname "$0")/bf16_checkpoint.py" "$out/organism"
