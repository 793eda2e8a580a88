"""Planted (outside the indexer, every layer): every top-k-routed MoE layer dispatches each token
to the expert after the one it chose (expert id + 1, wrapping): an off-by-one in a fused routing
kernel's expert offsets, applied wherever the kernel runs. The indexer is untouched.
(``moe_route_shift.py`` plants the same fault in the last MoE layer only.)
"""


def apply(model):
    gates = [m for name, m in model.named_modules() if type(m).__name__ == "DeepseekV4TopKRouter"]
    for gate in gates:
        inner = gate.forward

        def forward(hidden_states, gate=gate, inner=inner):
            logits, weights, indices = inner(hidden_states)
            return logits, weights, (indices + 1) % gate.num_experts

        gate.forward = forward

    def undo():
        for gate in gates:
            gate.__dict__.pop("forward", None)

    return undo
