"""Multi-step workflows other than the investigation; each is ``run(config) -> result`` plus
``write(result, out)``, and ``write`` checks every artifact against its documented schema.

- ``serve_probe_explain``: serve a checkpoint twice (reference and deployment ``Setting``), probe
  both, explain.
- ``explain``: rank-dump the failing case of two probes, try fixes, write DIAGNOSIS.md.
- ``rankdump``: the rank-dump workflow over several prompts, with optional selection stability.
- ``capture``: ask a live SGLang server for its indexer top-k and assemble ``capture.json``.
"""
