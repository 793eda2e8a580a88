"""Compile the GPU kernels for sm_90 (Hopper) on a machine without a GPU; run by
tests/test_kernels_compile.py in a subprocess without TRITON_INTERPRET (under the interpreter
``triton.jit`` gives interpreted functions, which do not compile).

The interpreter accepts code that the compiler rejects (a constexpr reassigned inside
``tl.static_range`` passed every interpreter test and failed to compile), so CI compiles each
kernel variant the GPU paths launch: Triton's own front end, its TTGIR passes and the bundled
ptxas. Prints one line per kernel: name, registers, shared memory, spills.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from needlescope.kernels import triton_bisect, triton_filter, triton_logits, triton_radix

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, pointers: dict, consts: dict, num_warps: int = 4, num_stages: int = 3):
    """``fn`` (a JITFunction) compiled for sm_90: ``pointers`` maps pointer parameters to element
    types ("fp32", "i32", "fp8e4nv", ...) or to a full type string (tensor descriptors);
    ``consts`` gives every constexpr; other parameters are i32. Pointers are marked 16-byte
    aligned, as a real launch specializes them."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            t = pointers[name]
            sig[name] = t if t.startswith("tensordesc") else "*" + t
            if not t.startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    consts_idx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts_idx, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled) -> str:
    """Registers, stack and local memory per thread of the compiled cubin (the bundled cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return "registers {}, stack {} B, local {} B".format(*found.groups()) if found else out.strip()[-200:]


def _logits_kernels():
    ptrs = {
        "q_ptr": "fp8e4nv",
        "w_ptr": "fp32",
        "vals_ptr": "fp8e4nv",
        "scales_ptr": "fp32",
        "kdesc": "fp8e4nv",
        "bt_ptr": "i32",
        "lens_ptr": "i32",
        "out_ptr": "fp32",
        "hist_ptr": "i32",
        "gmax_ptr": "i32",
    }
    base = {"D": 128, "BLOCK_H": 64, "FP8": True, "NATIVE_FP8": True, "IEEE": False, "HIST_BITS": 0}
    loop = {"HIST_BLOCK": 512, "TMA": False, "GMAX": False}
    yield "paged persistent fp8", triton_logits._paged_persistent_kernel, ptrs, {**base, **loop}, 4, 3
    yield (
        "paged persistent fp8 + group maxima",
        triton_logits._paged_persistent_kernel,
        ptrs,
        {**base, **loop, "GMAX": True},
        4,
        3,
    )
    tma = {**ptrs, "kdesc": "tensordesc<fp8e4nv[1, 64, 128]>"}
    yield (
        "paged persistent fp8 TMA",
        triton_logits._paged_persistent_kernel,
        tma,
        {**base, **loop, "TMA": True},
        4,
        3,
    )
    per_pages = {
        **base,
        "HIST_BITS": 8,
        "PAGES_PER_PROG": 8,
        "PAGES_PER_MMA": 1,
        "FAULT_PAGE_TABLE": False,
        "FAULT_KEY_SLOT": False,
        "PREFETCH": False,
    }
    yield "paged per pages fp8 + histogram", triton_logits._paged_kernel, ptrs, per_pages, 4, 2
    prefill = {
        "D": 128,
        "BLOCK_T": 64,
        "BLOCK_N": 128,
        "NATIVE_FP8": True,
        "IEEE": False,
        "FAULT_KEY_SLOT": False,
    }
    pre_ptrs = {"q_ptr": "fp8e4nv", "w_ptr": "fp32", "k_ptr": "fp8e4nv", "ks_ptr": "fp32"}
    pre_ptrs |= {"starts_ptr": "i32", "ends_ptr": "i32", "out_ptr": "fp32"}
    yield "prefill fp8", triton_logits._prefill_kernel, pre_ptrs, prefill, 8, 3


def _topk_kernels():
    common = {"x_ptr": "fp32", "starts_ptr": "i32", "ends_ptr": "i32", "out_ptr": "i32"}
    flt = {
        **common,
        "gmax_ptr": "i32",
        "cidx_ptr": "i32",
        "ckey_ptr": "i32",
        "cnt_ptr": "i32",
        "counts_ptr": "i32",
    }
    k = {"K": 512, "HAS_START": False}
    yield "filter maxima", triton_filter._maxima_kernel, flt, {**k, "GROUP": 16, "CH": 4096}, 8, 3
    compact = {**k, "GROUP": 16, "CH": 4096, "GBLOCK": 2048, "GSINGLE": True, "HAS_GMAX": True}
    yield "filter compact", triton_filter._compact_kernel, flt, compact, 8, 3
    select = {**k, "CH": 4096, "SB": 8, "CAPL": 256, "CBLOCK": 2048, "HAS_COUNTS": False}
    yield "filter select", triton_filter._select_kernel, flt, select, 8, 3
    rad = {**common, "hist_ptr": "i32", "state_ptr": "i32", "below_ptr": "i32", "bar_ptr": "i32"}
    rk = {**k, "CH": 2048, "NP": 4, "BITS": 8, "SB": 16}
    for p in (1, 4):
        yield f"radix pass {p}", triton_radix._radix_pass, rad, {**rk, "PASS": p}, 4, 3
    yield "radix one launch", triton_radix._radix_one_launch, rad, {**rk, "FIRST": 1}, 4, 3
    tk = {**common, "cand_ptr": "i32"}
    single = {"K": 512, "BLOCK": 32768, "BITS": 0, "SINGLE": True, "SEG": 0, "CAND": False}
    yield "bisect, row in registers", triton_bisect._topk_kernel, tk, single, 32, 3
    merge = {"K": 512, "BLOCK": 8192, "BITS": 0, "SINGLE": False, "SEG": 0, "CAND": True}
    yield "bisect merge", triton_bisect._topk_kernel, tk, merge, 16, 3


def main() -> int:
    failed = 0
    for name, fn, ptrs, consts, warps, stages in (*_logits_kernels(), *_topk_kernels()):
        try:
            k = compile_kernel(fn, ptrs, consts, warps, stages)
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}")
            continue
        print(f"ok {name}: shared {k.metadata.shared} B, {resources(k)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
