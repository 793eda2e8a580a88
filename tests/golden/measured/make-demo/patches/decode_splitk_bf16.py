"""Split-K decode attention merging its partial results in bf16."""

from needlescope.audit.substitutes import attn_out_bf16


def apply(model):
    return attn_out_bf16(model)
