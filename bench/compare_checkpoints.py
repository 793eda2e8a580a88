"""Compare two safetensors checkpoints tensor by tensor (does a re-run reproduce the shipped weights?).

usage: python3 bench/compare_checkpoints.py A_DIR B_DIR [--out diff.json]

Prints one JSON object: tensors compared, how many are bit-identical, the largest absolute
and relative difference, and the worst tensor. Names or shapes that differ are an error.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    a, b = (load_file(d / "model.safetensors") for d in (args.a, args.b))
    if a.keys() != b.keys():
        raise SystemExit(f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    identical, worst, worst_name, worst_rel = 0, 0.0, "", 0.0
    for name in sorted(a):
        x, y = a[name].float(), b[name].float()
        if x.shape != y.shape:
            raise SystemExit(f"{name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        if torch.equal(x, y):
            identical += 1
            continue
        diff = (x - y).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
            worst_rel = diff / max(x.abs().max().item(), 1e-12)
    result = {
        "a": str(args.a),
        "b": str(args.b),
        "tensors": len(a),
        "bit_identical": identical,
        "max_abs_diff": worst,
        "max_rel_diff": worst_rel,
        "worst_tensor": worst_name,
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
