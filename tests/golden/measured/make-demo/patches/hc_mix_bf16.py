"""The hyper-connection mixing GEMM in bf16 (operands rounded, fp32 accumulation)."""

from needlescope.audit.substitutes import hc_mix_bf16


def apply(model):
    return hc_mix_bf16(model)
