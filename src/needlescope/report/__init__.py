"""Rendering of probe runs: summary.json, report.md, heatmap.png, results.jsonl."""
