"""Fault: the speculative verify pass keeps too few compressor and indexer rows for its draft.

An engine sizes the per-step compressor buffers of a verify pass for a fixed number of fed
tokens. This one keeps ``ROWS`` of them: when more than ``ROWS`` fed tokens are accepted
(the pending token plus at least ``ROWS`` drafts), the compressor's and the indexer's buffers
receive only the first ``ROWS`` rows, so the tokens after them never enter a compressed
window, every later window is pooled from the wrong positions, and the output degrades from
there on. Below that draft depth (``--speculative-num-draft-tokens`` < ``ROWS``) it is silent;
the deeper the draft, the more often a step accepts past the rows it kept.

    needlescope serve --speculative-num-draft-tokens 8 --patch fault:spec_verify_rows
"""

from needlescope.serve.faults import patch_engine

ROWS = 3


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
    def commit(original, engine, cohort, state, kept):
        if kept > ROWS:
            _truncate(state)
        return original(engine, cohort, state, kept)

    return patch_engine(model, "_commit", commit)
