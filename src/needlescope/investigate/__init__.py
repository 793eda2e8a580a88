"""The investigation layer: multi-step workflows from measurements to a causal verdict.

Each workflow is ``run(config) -> result`` plus ``write(result, out)``; ``write`` checks every
artifact against its documented schema before it lands. The layer sits above ``dsa``, ``run``,
``serve`` and ``organism`` and below ``watch`` and ``cli``; nothing below imports it.

- ``demo``: serve a checkpoint twice (reference and deployment ``Setting``), probe both, explain.
- ``explain``: rank-dump the failing case of two probes, try fixes, write DIAGNOSIS.md.
- ``rankdump``: the rank-dump workflow over several prompts, with optional selection stability.
- ``compare``: probe A, send B A's exact case set, compare the two runs (paired A/B).
- ``capture``: ask a live SGLang server for its indexer top-k and assemble ``capture.json``.
- the investigation itself (ledger, questions, verdicts, signature, state, runner): see their modules.
"""
