"""Planted (outside the indexer): the last MoE layer's router dispatches each token to the
expert after the one it chose (expert id + 1, wrapping): an off-by-one in a fused
routing kernel's expert offsets. The indexer is untouched.
"""


def apply(model):
    gates = [m for name, m in model.named_modules() if type(m).__name__ == "DeepseekV4TopKRouter"]
    gate = gates[-1]
    inner = gate.forward

    def forward(hidden_states):
        logits, weights, indices = inner(hidden_states)
        return logits, weights, (indices + 1) % gate.num_experts

    gate.forward = forward
    return lambda: gate.__dict__.pop("forward", None)
