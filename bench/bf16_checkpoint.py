"""Rewrite a checkpoint's fp32 tensors as bf16 in place (half the bytes to carry back from a GPU).

usage: python3 bench/bf16_checkpoint.py DIR [DIR ...]
"""

import sys

from needlescope.organism.recipe import cast_bf16

for directory in sys.argv[1:]:
    cast_bf16(directory)
