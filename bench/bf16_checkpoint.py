"""Rewrite a checkpoint's fp32 tensors as bf16 in place (half the bytes to carry back from a GPU).

usage: python3 bench/bf16_checkpoint.py DIR [DIR ...]
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

for directory in sys.argv[1:]:
    path = Path(directory) / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in tensors.items()}, path)
