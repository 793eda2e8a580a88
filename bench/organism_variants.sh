#!/usr/bin/env bash
# Train several organism recipes side by side on one GPU and pack what comes back.
#
# A 5M-parameter model leaves most of an H200 idle, so recipe variants run as concurrent
# `needlescope organism train` processes. Each variant's checkpoint is packed as
# OUT/NAME.tar with bf16 weights (half the bytes; the device returns at most 16 MiB a file),
# and every training.json plus console log goes into OUT/logs.tar.
#
# usage: bench/organism_variants.sh OUT MINUTES NAME "FLAGS" [NAME "FLAGS" ...]
set -euo pipefail
out=$1 minutes=$2
shift 2
work=$(mktemp -d)
names=()
while (($#)); do
  name=$1 flags=$2
  shift 2
  names+=("$name")
  # shellcheck disable=SC2086  # FLAGS is a list of flags on purpose
  python3 -m needlescope.cli.main organism train --out "$work/$name" --max-minutes "$minutes" $flags \
    >"$work/$name.log" 2>&1 &
done
wait || true
for name in "${names[@]}"; do
  tail -n 3 "$work/$name.log"
  if [[ -f $work/$name/model.safetensors ]]; then
    python3 "$(dirname "$0")/bf16_checkpoint.py" "$work/$name"
    tar -C "$work" -cf "$out/$name.tar" "$name"
  fi
done
tar -C "$work" -cf "$out/logs.tar" $(cd "$work" && ls -d -- *.log */training.json 2>/dev/null)
