#!/usr/bin/env bash
# The recipe of the shipped organism weights (docs/organism.md, needlescope.organism.recipe):
# `needlescope organism train --out OUT` with no recipe flags runs both stages and the bf16
# cast. About 7 minutes on one H200 (401 s measured, bit-identical to the shipped weights).
#
# usage: bench/organism_recipe.sh OUT [PYTHON]   (stage 1 goes to OUT/stage1, bf16 weights to OUT)
set -euo pipefail
out=$1 python=${2:-python3}
"$python" -m needlescope.cli.main organism train --out "$out"
