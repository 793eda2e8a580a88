"""The logprob oracle workflow: export one server's greedy logprobs over a fixed prompt set, and
compare another server against that export.

Export, per prompt of the shipped set (``run/data/oracle_prompts.json``, or ``prompts=FILE``):
its token ids from ``/tokenize`` (else the token texts the server echoes with ``echo``, else
nothing; ``prompt_ids_source`` records which), then one greedy ``/v1/completions`` request with
``logprobs: top`` (20 by default). Compare sends the same prompts to the candidate the same way
and scores each pair with ``analysis.oracle``. The first prompt's tokens are checked before any
generation: a candidate that tokenizes differently is a different model, not a numerics change,
and is refused at once (``BadInput``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from needlescope.analysis.oracle import (
    ATOL,
    FLIP_MARGIN,
    NO_PROB,
    Step,
    compare_steps,
    first_difference,
    summarize,
)
from needlescope.errors import BadInput
from needlescope.paths import read_json_object
from needlescope.progress import Progress, no_progress
from needlescope.report.oracle import EXPORT_SCHEMA
from needlescope.schema import check_schema
from needlescope.targets.client import served_models
from needlescope.targets.completions import CompletionsTarget
from needlescope.targets.limits import read_limits
from needlescope.targets.provenance import collect_provenance

__all__ = ["OracleConfig", "PromptSet", "load_prompt_set", "export", "compare", "read_export"]

_PROMPT_SET_SCHEMA = {
    "type": "object",
    "required": ["name", "prompts"],
    "properties": {
        "name": {"type": "string"},
        "value_digits": {"type": "integer"},
        "prompts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "category", "prompt", "max_tokens"],
                "properties": {
                    "id": {"type": "string"},
                    "category": {"type": "string"},
                    "prompt": {"type": "string"},
                    "max_tokens": {"type": "integer"},
                },
            },
        },
    },
}


@dataclass(frozen=True)
class PromptSet:
    name: str
    sha256: str
    prompts: list[dict]
    value_digits: int | None = None
    """Digits of the needle values written into the set's needle prompts (fixed text)."""


def load_prompt_set(path: str | Path | None = None) -> PromptSet:
    """The shipped prompt set, or the one in ``path`` (same format); BadInput when malformed."""
    if path is None:
        raw = resources.files("needlescope.run").joinpath("data/oracle_prompts.json").read_bytes()
        data = json.loads(raw)
    else:
        raw = Path(path).read_bytes() if Path(path).is_file() else b""
        data = read_json_object(path, "give a prompt-set file like needlescope/run/data/oracle_prompts.json")
    try:
        check_schema(data, _PROMPT_SET_SCHEMA, "prompt set")
    except ValueError as e:
        raise BadInput(f"{path}: {e}; see docs/oracle.md for the prompt-set format") from None
    ids = [p["id"] for p in data["prompts"]]
    if not ids or len(set(ids)) != len(ids):
        raise BadInput(f"{path}: prompt ids must be unique and at least one prompt given")
    if any(p["max_tokens"] < 1 for p in data["prompts"]):
        raise BadInput(f"{path}: every prompt's max_tokens must be >= 1")
    return PromptSet(
        name=data["name"],
        sha256=hashlib.sha256(raw).hexdigest(),
        prompts=data["prompts"],
        value_digits=data.get("value_digits"),
    )


@dataclass(frozen=True)
class OracleConfig:
    """One server to query: where, which model (None: the one ``/v1/models`` lists first), how."""

    base_url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    top_logprobs: int = 20
    timeout_s: float = 300.0
    prompts: str | None = None
    flip_margin: float = FLIP_MARGIN
    atol: float = ATOL
    skip_long_prompts: bool = False
    """Leave out, with a note, prompts beyond the target's context instead of refusing the run."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_logprobs <= 20:
            raise BadInput(f"--top-logprobs must be in 1..20 (OpenAI's limit); got {self.top_logprobs}")
        if not self.flip_margin > 0 or not self.atol >= 0:
            raise BadInput("--flip-margin must be > 0 and --atol >= 0")

    def target(self) -> CompletionsTarget:
        model = self.model
        if model is None:
            listed = served_models(self.base_url, self.api_key, flag="--base-url")
            if not listed:
                raise BadInput(f"{self.base_url} lists no model at /v1/models; pass --model")
            model = listed[0]
        return CompletionsTarget(self.base_url, model, api_key=self.api_key, timeout=self.timeout_s)


def _prompt_tokens(target: CompletionsTarget, prompt: str, source: str | None) -> tuple[str, list | None]:
    """(source, ids or token texts) of ``prompt``: ``tokenize`` first, ``echo`` as the fallback."""
    if source in (None, "tokenize"):
        ids = target.tokenize(prompt)
        if ids is not None:
            return "tokenize", ids
    if source in (None, "echo"):
        toks = target.echoed_prompt_tokens(prompt)
        if toks is not None:
            return "echo", toks
    return "none", None


def _record(target: CompletionsTarget, p: dict, source: str, toks: list | None, top: int) -> dict:
    done = target.complete(p["prompt"], p["max_tokens"], top=top)
    return {
        "id": p["id"],
        "category": p["category"],
        "prompt": p["prompt"],
        "max_tokens": p["max_tokens"],
        "prompt_ids": toks if source == "tokenize" else None,
        "prompt_tokens": toks if source == "echo" else None,
        "text": done.text,
        "finish_reason": done.finish_reason,
        "usage_prompt_tokens": done.prompt_tokens,
        "steps": [
            {
                "token": s.token,
                "logprob": _json_lp(s.logprob),
                "top": {t: _json_lp(v) for t, v in s.top.items()},
            }
            for s in done.steps
        ],
    }


def _json_lp(x: float) -> float | None:
    """A logprob as export.json holds it: probability 0 as ``NO_PROB`` (vLLM's -9999.0, which
    ``analysis.oracle`` reads as -inf), a missing one (NaN) as null: strict JSON either way."""
    if math.isnan(x):
        return None
    return max(x, NO_PROB)


def _header(cfg: OracleConfig, target: CompletionsTarget, pset: PromptSet, source: str) -> dict:
    prov = collect_provenance(target.root, target.v1, api_key=cfg.api_key, timeout=min(cfg.timeout_s, 5.0))
    return {
        "kind": "needlescope-oracle-export",
        "model": target.model,
        "base_url": target.v1,
        "prompt_set": pset.name,
        "prompt_set_sha256": pset.sha256,
        "top_logprobs": cfg.top_logprobs,
        "prompt_ids_source": source,
        "server": {k: prov[k] for k in ("/get_server_info", "/version") if k in prov},
    }


def fit_prompts(
    cfg: OracleConfig, target: CompletionsTarget, pset: PromptSet, note: Callable[[str], None]
) -> PromptSet:
    """The prompts that fit the target's advertised context (counted by its ``/tokenize``), before
    any generation: BadInput naming the others, or (``skip_long_prompts``) a note and the rest.
    The needle prompts' values are fixed text; ``note`` says their length beside the target's."""
    prov = collect_provenance(target.root, target.v1, api_key=cfg.api_key, timeout=min(cfg.timeout_s, 5.0))
    limits = read_limits(prov, target.model)
    if pset.value_digits is not None:
        advertised = (
            f"the target advertises {limits.value_digits} ({limits.value_digits_from})"
            if limits.value_digits is not None
            else "the target advertises none"
        )
        warn = "WARNING: " if limits.value_digits not in (None, pset.value_digits) else ""
        note(f"{warn}needle values: {pset.value_digits} digits, fixed by the prompt set; {advertised}")
    if limits.context is None:
        return pset
    long = [
        p["id"]
        for p in pset.prompts
        if len(target.tokenize(p["prompt"]) or ()) + p["max_tokens"] > limits.context
    ]
    if not long:
        return pset
    why = f"beyond the target's context of {limits.context} tokens ({limits.context_from})"
    if not cfg.skip_long_prompts:
        raise BadInput(f"prompt(s) {', '.join(long)} are {why}; pass --skip-long-prompts to leave them out")
    if len(long) == len(pset.prompts):
        # Nothing left to measure: an export or a comparison of no prompt is no result (issue 38).
        raise BadInput(
            f"every prompt ({', '.join(long)}) is {why}: no prompt is left to send; "
            "use a prompt set that fits the target, or a target with a longer context"
        )
    note(f"WARNING: leaving out prompt(s) {', '.join(long)}: {why}")
    return dataclasses.replace(pset, prompts=[p for p in pset.prompts if p["id"] not in long])


def export(
    cfg: OracleConfig, progress: Progress = no_progress, note: Callable[[str], None] = lambda _line: None
) -> dict:
    """Greedy logprobs of every prompt of the set at ``cfg``'s server (the export.json body)."""
    pset = load_prompt_set(cfg.prompts)
    with cfg.target() as target:
        pset = fit_prompts(cfg, target, pset, note)
        source, rows = None, []
        progress("export", 0, len(pset.prompts), "")
        for p in pset.prompts:
            source, toks = _prompt_tokens(target, p["prompt"], source)
            rows.append(_record(target, p, source, toks, cfg.top_logprobs))
            progress("export", len(rows), len(pset.prompts), p["id"])
        return {**_header(cfg, target, pset, source or "none"), "prompts": rows}


def read_export(directory: str | Path) -> dict:
    """The export.json in ``directory``, checked; BadInput when missing or malformed."""
    path = Path(directory) / "export.json"
    if not path.is_file():
        raise BadInput(
            f"{directory} holds no export.json; run `needlescope oracle export --out {directory}` first"
        )
    data = read_json_object(path, "re-run `needlescope oracle export`")
    try:
        check_schema(data, EXPORT_SCHEMA, "export")
    except ValueError as e:
        raise BadInput(f"{path} is not an oracle export ({e}); re-run `needlescope oracle export`") from None
    return data


def _steps(row: dict) -> list[Step]:
    return [
        Step(s["token"], math.nan if s["logprob"] is None else s["logprob"], s["top"]) for s in row["steps"]
    ]


def _ids_equal(ref: dict, source: str, toks: list | None) -> tuple[bool | None, int | None]:
    mine = ref["prompt_ids"] if source == "tokenize" else ref["prompt_tokens"] if source == "echo" else None
    if mine is None or toks is None:
        return None, None
    diff = first_difference(mine, toks)
    return diff is None, diff


def compare(
    ref_dir: str | Path,
    cfg: OracleConfig,
    progress: Progress = no_progress,
    note: Callable[[str], None] = lambda _line: None,
) -> tuple[dict, dict]:
    """(oracle.json body, the candidate's own export) of ``cfg``'s server against ``ref_dir``'s export."""
    ref = read_export(ref_dir)
    by_id = {p["id"]: p for p in ref["prompts"]}
    pset_prompts = [{k: p[k] for k in ("id", "category", "prompt", "max_tokens")} for p in ref["prompts"]]
    pset = PromptSet(ref["prompt_set"], ref["prompt_set_sha256"], pset_prompts)
    ref_source = ref["prompt_ids_source"] if ref["prompt_ids_source"] != "none" else None
    with cfg.target() as target:
        pset = fit_prompts(cfg, target, pset, note)
        rows, cand_rows, equal_flags, comparisons = [], [], [], []
        source = ref_source
        progress("compare", 0, len(pset.prompts), "")
        for i, p in enumerate(pset.prompts):
            source, toks = _prompt_tokens(target, p["prompt"], source)
            equal, diff = _ids_equal(by_id[p["id"]], source, toks)
            if i == 0 and equal is False:
                r = by_id[p["id"]]["prompt_ids"] or by_id[p["id"]]["prompt_tokens"]
                raise BadInput(
                    f"{target.v1} tokenizes differently from the reference ({ref['base_url']}, model "
                    f"{ref['model']!r}): prompt {p['id']!r} is {len(toks)} tokens there vs {len(r)}, first "
                    f"difference at token {diff} ({_at(toks, diff)} vs {_at(r, diff)}); the oracle compares "
                    "numerics of one model and tokenizer, so point it at a server of the same model"
                )
            cand = _record(target, p, source, toks, cfg.top_logprobs)
            cand_rows.append(cand)
            c = compare_steps(
                _steps(by_id[p["id"]]), _steps(cand), flip_margin=cfg.flip_margin, atol=cfg.atol
            )
            comparisons.append(c)
            equal_flags.append(equal)
            progress("compare", len(comparisons), len(pset.prompts), p["id"])
            rows.append(
                {
                    "id": p["id"],
                    "category": p["category"],
                    "prompt_ids_equal": equal,
                    "first_prompt_difference": diff,
                    "ref_text": by_id[p["id"]]["text"],
                    "cand_text": cand["text"],
                    **{k: v for k, v in c.to_dict().items() if k != "ref_margins"},
                }
            )
        cand_export = {**_header(cfg, target, pset, source or "none"), "prompts": cand_rows}
    result = {
        "kind": "needlescope-oracle-compare",
        "reference": {k: ref[k] for k in ("base_url", "model", "prompt_set", "prompt_set_sha256", "server")},
        "candidate": {k: cand_export[k] for k in ("base_url", "model", "server")},
        "flip_margin": cfg.flip_margin,
        "atol": cfg.atol,
        "summary": summarize(comparisons, equal_flags),
        "prompts": rows,
    }
    return result, cand_export


def _at(seq: list, i: int | None) -> str:
    return repr(seq[i]) if i is not None and i < len(seq) else "end"
