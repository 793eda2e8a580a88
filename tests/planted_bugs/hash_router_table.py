"""Planted (outside_selection, no undo): layer 0's hash-routing table is loaded one expert off
(token -> expert id + 1, a conversion bug written into the buffer in place): an MoE routing
fault upstream of every CSA indexer, failing at every length, dense ones included."""

import torch


def apply(model):
    gate = model.get_submodule("model.layers.0.mlp.gate")
    with torch.no_grad():
        gate.tid2eid.add_(1).remainder_(gate.num_experts)
