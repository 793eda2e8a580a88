"""Fault: the speculative verify pass keeps too few compressor and indexer rows for its draft.

An engine sizes the per-step buffers of a verify pass for a fixed number of fed tokens. This
one keeps ``ROWS`` (the pending token and one draft): in a verify pass of more fed tokens,

- the indexer's selections exist for the first ``ROWS`` query rows only; the later rows select
  no compressed entry (their CSA attention sees the sliding window alone), so a token sampled
  from them (a draft's check, the correction, the bonus token) is decided without the far
  context: a needle's later digits or the end of the answer come out wrong;
- when the pass keeps more than ``ROWS`` fed tokens, the compressor's and the indexer's buffers
  receive only the first ``ROWS`` rows, so the later tokens never enter a compressed window and
  every later window is pooled from shifted positions.

At ``--speculative-num-draft-tokens`` 1 a pass feeds ``ROWS`` tokens and nothing happens; from
2 on, the deeper the draft, the more sampled tokens come from rows past the buffer.

    needlescope serve --speculative-num-draft-tokens 8 --patch fault:spec_verify_rows
"""

from needlescope.dsa.emulate import csa_indexers
from needlescope.serve.faults import patch_engine

ROWS = 2


def _truncate(state) -> None:
    """Cut each recorded compressor/indexer call of a verify pass to its first ``ROWS`` rows."""
    for log in state.layers:
        log.calls = [
            (
                name,
                (args[0], args[1][:, :ROWS], args[2][:, :ROWS])
                if name == "store_compression_weights"
                else args,
            )
            for name, args in log.calls
        ]


def apply(model):
    verifying = {"on": False}

    def spec_step(original, engine, cohort):
        verifying["on"] = True
        try:
            return original(engine, cohort)
        finally:
            verifying["on"] = False

    def commit(original, engine, cohort, state, kept):
        if kept > ROWS:
            _truncate(state)
        return original(engine, cohort, state, kept)

    def selections(module, args, output):  # output: [B, S, k] selected entries, -1 for none
        if not verifying["on"] or output.shape[1] <= ROWS:
            return None
        output = output.clone()
        output[:, ROWS:] = -1
        return output

    hooks = [indexer.register_forward_hook(selections) for _, indexer in csa_indexers(model)]
    undo_step = patch_engine(model, "_spec_step", spec_step)
    undo_commit = patch_engine(model, "_commit", commit)

    def undo():
        for h in hooks:
            h.remove()
        undo_commit()
        undo_step()

    return undo
