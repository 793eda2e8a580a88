"""Explain a failure of two finished probes: rank-dump the failing case, try fixes, write DIAGNOSIS.md.

``run(ExplainConfig(...)) -> Explanation`` picks the case to explain (``pick_case_to_explain``),
replays it in-process under the deployment setting (a rank dump) and under each candidate fix;
``write(explanation, out)`` checks ``rankdump.json`` against ``RANKDUMP_SCHEMA`` and
``fixes.json`` against ``FIXES_SCHEMA`` before writing them, then writes ``DIAGNOSIS.md``
(``needlescope.report.diagnosis``) from those artifacts.

``fixes.json`` schema (``FIXES_SCHEMA``)::

    {"case_id": str,
     "fixes": [{"numerics": {"index_k": str, "index_q": str, "score_dtype": str,
                             "index_topk": int | null, "hadamard": bool | null},
                "patch": str | null, "label": str,
                "selected_all_layers": bool, "answer_correct": bool | null,
                "layers": [{"layer": int, "best_rank": int, "margin": float, "selected": bool}]}]}

``label`` is the fix's ``Setting`` text form; ``selected_all_layers`` is true when every CSA
layer that can see the needle at the first answer position has a needle entry in its top-k.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.progress import Event, no_event
from needlescope.report.diagnosis import write_diagnosis
from needlescope.run.probe import STORE_NAME
from needlescope.run.store import ResultStore
from needlescope.schema import check_schema
from needlescope.setting import Setting

__all__ = [
    "FIXES_SCHEMA",
    "ExplainConfig",
    "Explanation",
    "default_fixes",
    "fix_record",
    "pick_failing_case",
    "pick_case_to_explain",
    "run",
    "validate_fixes",
    "write",
]


_NUMERICS = {
    "type": "object",
    "required": ["index_k", "index_q", "score_dtype", "index_topk", "hadamard"],
    "properties": {
        "index_k": {"type": "string"},
        "index_q": {"type": "string"},
        "score_dtype": {"type": "string"},
        "index_topk": {"type": ["integer", "null"]},
        "hadamard": {"type": ["boolean", "null"]},
    },
}
FIXES_SCHEMA: dict = {
    "type": "object",
    "required": ["case_id", "fixes"],
    "properties": {
        "case_id": {"type": "string"},
        "fixes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["numerics", "patch", "label", "selected_all_layers", "answer_correct", "layers"],
                "properties": {
                    "numerics": _NUMERICS,
                    "patch": {"type": ["string", "null"]},
                    "label": {"type": "string"},
                    "selected_all_layers": {"type": "boolean"},
                    "answer_correct": {"type": ["boolean", "null"]},
                    "layers": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["layer", "best_rank", "margin", "selected"],
                            "properties": {
                                "layer": {"type": "integer"},
                                "best_rank": {"type": "integer"},
                                "margin": {"type": "number"},
                                "selected": {"type": "boolean"},
                            },
                        },
                    },
                },
            },
        },
    },
}
"""JSON-Schema-style description of ``fixes.json`` (checked by ``validate_fixes``)."""


def validate_fixes(obj: dict) -> None:
    """Raise ValueError unless ``obj`` follows FIXES_SCHEMA."""
    check_schema(obj, FIXES_SCHEMA, "fixes")


def default_fixes(deployment: Setting) -> tuple[Setting, ...]:
    """The fixes tried on a failing case, cheapest first: bf16 keys, ``index_topk`` doubled and
    quadrupled, bf16 keys with the doubled top-k (each keeping the deployment's patch), and,
    when there is a patch, the same numerics without it."""
    if deployment.index_topk is None:
        raise BadInput("the deployment setting needs an explicit index_topk to derive fixes from")
    k = deployment.index_topk
    bf16 = deployment.with_(index_k="bf16")
    fixes = [
        bf16,
        deployment.with_(index_topk=2 * k),
        deployment.with_(index_topk=4 * k),
        bf16.with_(index_topk=2 * k),
    ]
    if deployment.patch is not None:
        fixes.append(deployment.numerics_only)
    return tuple(fixes)


def pick_failing_case(reference_rows: list[dict], deployment_rows: list[dict]) -> tuple[str, str]:
    """(case_id, why): the case to explain. Prefers right-under-reference, wrong-under-deployment.

    Longest length first, then the shallowest depth. Falls back to any deployment miss (then
    the reference missed it too, which the report says).
    """
    ref_ok = {r["case_id"] for r in reference_rows if r["status"] == "ok" and r["correct"]}
    misses = [r for r in deployment_rows if r["status"] == "ok" and not r["correct"]]
    if not misses:
        raise ValueError("the deployment answered every case correctly; there is no failure to explain")
    misses.sort(key=lambda r: (-r["length"], r["depth"], r["trial"]))
    for r in misses:
        if r["case_id"] in ref_ok:
            return r["case_id"], "right under the reference numerics, wrong under the deployment setting"
    return misses[0]["case_id"], "wrong under both settings (no deployment-only failure exists)"


def pick_case_to_explain(reference_rows: list[dict], deployment_rows: list[dict]) -> tuple[str, str]:
    """``pick_failing_case``, or, when the deployment missed nothing, its longest case (the one
    with the most entries competing for top-k), so the report still shows the indexer margins."""
    try:
        return pick_failing_case(reference_rows, deployment_rows)
    except ValueError:
        ok = [r for r in deployment_rows if r["status"] == "ok"]
        if not ok:
            raise ValueError("the deployment probe has no scored case to explain") from None
        ok.sort(key=lambda r: (-r["length"], r["depth"], r["trial"]))
        return ok[0]["case_id"], (
            "no probed case failed under the deployment setting; this is its longest case, "
            "shown for the indexer margins"
        )


@dataclass(frozen=True)
class ExplainConfig:
    """Two finished probes of one checkpoint (``deployment_dir`` ran under ``deployment``) and the fixes to try."""

    model: Path
    reference_dir: Path
    deployment_dir: Path
    deployment: Setting
    fixes: tuple[Setting, ...]
    device: str = "cpu"


@dataclass(frozen=True)
class Explanation:
    """What ``run`` found; ``write`` turns it into ``rankdump.json``, ``fixes.json`` and DIAGNOSIS.md."""

    config: ExplainConfig
    case: dict
    why: str
    rankdump: dict
    fixes: dict


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _case(out: Path, case_id: str) -> dict:
    with ResultStore(out / STORE_NAME) as store:
        for c in store.cases():
            if c["case_id"] == case_id:
                return c
    raise KeyError(case_id)


def fix_record(fix: Setting, dump: dict) -> dict:
    """One ``fixes.json`` entry: the fix and what its rank dump of the case shows."""
    layers = [layer for layer in dump["layers"] if layer["positions"]]
    return {
        "numerics": fix.numerics_json(),
        "patch": None if fix.patch is None else fix.patch.spec,
        "label": fix.label(),
        "selected_all_layers": all(layer["positions"][0]["selected"] for layer in layers),
        "answer_correct": dump.get("answer_correct"),
        "layers": [
            {
                "layer": layer["layer"],
                **{k: layer["positions"][0][k] for k in ("best_rank", "margin", "selected")},
            }
            for layer in layers
        ],
    }


def run(cfg: ExplainConfig, on_phase: Event = no_event) -> Explanation:
    """Rank-dump the case to explain under the deployment setting and under each fix."""
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.rankdump import rank_dump

    case_id, why = pick_case_to_explain(_rows(cfg.reference_dir), _rows(cfg.deployment_dir))
    case = _case(cfg.deployment_dir, case_id)
    on_phase("rank dump", {"case": case_id})
    model, tokenizer, _ = load_bundle(cfg.model, device=cfg.device)

    def dump(setting: Setting, label: str = "") -> dict:
        return rank_dump(
            model,
            tokenizer,
            case["messages"],
            needle=case["needle"],
            setting=setting,
            expected=case["expected"],
            label=label,
        )

    deployment_dump = dump(cfg.deployment, case_id)
    on_phase("fixes", {"candidates": len(cfg.fixes)})
    tried = [fix_record(fix, dump(fix)) for fix in cfg.fixes]
    return Explanation(cfg, case, why, deployment_dump, {"case_id": case_id, "fixes": tried})


def write(result: Explanation, out: Path) -> Path:
    """Check and write ``rankdump.json`` and ``fixes.json``, then DIAGNOSIS.md; returns its path."""
    from needlescope.dsa.rankdump import validate_rankdump

    validate_rankdump(result.rankdump)
    validate_fixes(result.fixes)
    cfg = result.config
    (out / "rankdump.json").write_text(json.dumps(result.rankdump, indent=1))
    (out / "fixes.json").write_text(json.dumps(result.fixes, indent=1))
    return write_diagnosis(
        out,
        model=str(cfg.model),
        reference=json.loads((cfg.reference_dir / "summary.json").read_text()),
        deployment=json.loads((cfg.deployment_dir / "summary.json").read_text()),
        deployment_label=cfg.deployment.label(),
        case=result.case,
        why=result.why,
        rankdump=result.rankdump,
        fixes=result.fixes["fixes"],
        deployment_patch=None if cfg.deployment.patch is None else cfg.deployment.patch.spec,
        heatmaps=(
            os.path.relpath(cfg.reference_dir / "heatmap.png", out),
            os.path.relpath(cfg.deployment_dir / "heatmap.png", out),
        ),
    )
