"""Torch-free writers and JSON schemas of probe-side artifacts.

``probe`` writes a probe's outputs (summary.json, report.md, heatmap.png, results.jsonl);
``compare``, ``bisect`` and ``bundle`` the A/B, bisection and reproducer-bundle artifacts;
``breakdown`` the failure-taxonomy and per-endpoint sections; ``diagnosis`` DIAGNOSIS.md.
"""

from .probe import SUMMARY_SCHEMA, validate_summary, write_probe_outputs

__all__ = ["SUMMARY_SCHEMA", "validate_summary", "write_probe_outputs"]
