"""Write the outputs of a paired A/B comparison: compare.json, report.md, delta_heatmap.png, pairs.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from ..schema import check_schema

__all__ = ["COMPARE_SCHEMA", "validate_compare", "write_compare_outputs"]

_BUCKET_KEYS = (
    "length_lo",
    "length_hi",
    "n",
    "recall_a",
    "recall_b",
    "delta",
    "ci_low",
    "ci_high",
    "p_value",
    "p_holm",
)

COMPARE_SCHEMA: dict = {
    "type": "object",
    "required": ["cases_matched", "buckets", "verdict", "regresses_from"],
    "properties": {
        "cases_matched": {"type": "integer"},
        "buckets": {
            "type": "array",
            "items": {
                "type": "object",
                "required": list(_BUCKET_KEYS),
                "properties": {
                    k: {"type": "integer" if k in ("length_lo", "length_hi", "n") else "number"}
                    for k in _BUCKET_KEYS
                },
            },
        },
        "verdict": {"type": "string"},
        "regresses_from": {"type": ["integer", "null"]},
    },
}


def validate_compare(obj: dict) -> None:
    """Raise ValueError if ``obj`` does not follow COMPARE_SCHEMA."""
    check_schema(obj, COMPARE_SCHEMA, "compare")
    extra = set(obj) - set(COMPARE_SCHEMA["required"])
    if extra:
        raise ValueError(f"compare: unexpected keys {sorted(extra)}")


def _delta_heatmap(path: Path, cells: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.full((max(1, len(lengths)), max(1, len(depths))), np.nan)
    fig, ax = plt.subplots(figsize=(1.2 * max(3, len(depths)) + 2, 0.7 * max(3, len(lengths)) + 1.5))
    for c in cells:
        i, j = lengths.index(c["length"]), depths.index(c["depth"])
        grid[i, j] = c["delta"]
        ax.text(j, i, f"{c['delta']:+.2f}\nn={c['n']}", ha="center", va="center", fontsize=7)
    im = ax.imshow(grid, cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (%)")
    ax.set_ylabel("length (tokens)")
    fig.colorbar(im, ax=ax, label="recall B - recall A")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _setting_line(prov: dict) -> str:
    info = prov.get("/get_server_info") if isinstance(prov.get("/get_server_info"), dict) else {}
    keys = ("model", "index_k", "index_q", "score_dtype", "index_topk", "patch")
    parts = [f"{k}={info[k]}" for k in keys if info.get(k) is not None]
    return ", ".join(parts) or prov.get("root", "?")


def _markdown(compare: dict, cells: list[dict], sides: dict, unpaired: int, alpha: float) -> str:
    lines = ["# needlescope compare: A vs B on identical prompts", ""]
    for name, side in sides.items():
        lines.append(f"- **{name}**: {side['run']} ({_setting_line(side['provenance'])})")
    lines += [
        "",
        f"**Verdict:** {compare['verdict']}",
        "",
        f"{compare['cases_matched']} cases scored on both sides; {unpaired} left out because a request "
        f"failed on A or B (errors are never misses). Significance level {alpha:g}; McNemar p-values "
        "are exact and two-sided, Holm-corrected across buckets; intervals are 95% paired bootstrap.",
        "",
        "| length | n | recall A | recall B | delta | 95% CI | p | p (Holm) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in compare["buckets"]:
        span = (
            str(b["length_lo"]) if b["length_lo"] == b["length_hi"] else f"{b['length_lo']}-{b['length_hi']}"
        )
        lines.append(
            f"| {span} | {b['n']} | {b['recall_a']:.2f} | {b['recall_b']:.2f} | {b['delta']:+.2f} "
            f"| [{b['ci_low']:+.2f}, {b['ci_high']:+.2f}] | {b['p_value']:.2g} | {b['p_holm']:.2g} |"
        )
    lines += [
        "",
        "## Per cell",
        "",
        "| length | depth | n | recall A | recall B | delta | 95% CI | p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['length']} | {c['depth']:g} | {c['n']} | {c['recall_a']:.2f} | {c['recall_b']:.2f} "
            f"| {c['delta']:+.2f} | [{c['ci_low']:+.2f}, {c['ci_high']:+.2f}] | {c['p_value']:.2g} |"
        )
    lines += ["", "![delta heatmap](delta_heatmap.png)", ""]
    return "\n".join(lines)


def write_compare_outputs(
    out_dir: Path,
    result: dict,
    *,
    pairs: list[dict],
    unpaired: int,
    sides: dict,
    alpha: float,
) -> dict:
    """Write compare.json (exactly COMPARE_SCHEMA's keys), report.md, delta_heatmap.png and
    pairs.jsonl (one object per paired case: case_id, length, depth, a_correct, b_correct,
    a_answer, b_answer, expected). Returns compare.json's body."""
    out_dir.mkdir(parents=True, exist_ok=True)
    compare = {k: result[k] for k in COMPARE_SCHEMA["required"]}
    validate_compare(compare)
    (out_dir / "compare.json").write_text(json.dumps(compare, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(compare, result["cells"], sides, unpaired, alpha))
    with (out_dir / "pairs.jsonl").open("w") as f:
        for row in pairs:
            f.write(json.dumps(row) + "\n")
    _delta_heatmap(out_dir / "delta_heatmap.png", result["cells"])
    return compare
