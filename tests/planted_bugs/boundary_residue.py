"""Planted (length_residue, no undo): when a prefill ends on a compression-window boundary
(prompt length = 0 mod the compression ratio), the indexer ranks with the wrong sign (a
window count that wraps flips its scale) for that prefill and every decode step after it: a
boundary-arithmetic bug that only some lengths take (vllm#55927 failed at length = 3 mod 4)."""


def apply(model):
    for _, idx in model.named_modules():
        if type(idx).__name__ != "DeepseekV4Indexer":
            continue
        scorer, outer = idx.scorer, idx.forward
        inner = scorer.forward
        state = {"boundary": False}

        def scorer_forward(q, compressed_kv, hidden_states, inner=inner, state=state):
            scores = inner(q, compressed_kv, hidden_states)
            return -scores if state["boundary"] else scores

        def forward(
            hidden_states, q_residual, position_ids, *args, outer=outer, state=state, ratio=idx.compress_rate
        ):
            if hidden_states.shape[1] > 1:  # a prefill decides for the decode steps that follow it
                state["boundary"] = (int(position_ids[0, -1]) + 1) % ratio == 0
            return outer(hidden_states, q_residual, position_ids, *args)

        scorer.forward = scorer_forward
        idx.forward = forward
