"""Writers for probe outputs (summary.json, report.md, heatmap.png, results.jsonl)."""

from .probe import SUMMARY_SCHEMA, validate_summary, write_probe_outputs

__all__ = ["SUMMARY_SCHEMA", "validate_summary", "write_probe_outputs"]
