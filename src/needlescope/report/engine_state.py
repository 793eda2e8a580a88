"""``engine_state.json`` and ``engine_state.md``: each engine-state factor's paired effect on recall
and margin. The schema is checked before anything is written."""

from __future__ import annotations

from pathlib import Path

from ..paths import atomic_write_json
from ..schema import check_schema

__all__ = ["ENGINE_STATE_SCHEMA", "write_engine_state", "engine_state_markdown"]

_NUM = {"type": ["number", "null"]}
_EFFECT = {
    "type": "object",
    "required": [
        "pairs",
        "errors",
        "recall_a",
        "recall_b",
        "recall_delta",
        "mcnemar_p",
        "margin",
        "answers_differ",
        "first_differing_tokens",
        "cached_tokens_a",
        "cached_tokens_b",
    ],
    "properties": {
        "pairs": {"type": "integer"},
        "errors": {"type": "integer"},
        # null when the factor has no scored pair (every pair failed on the target)
        **{k: _NUM for k in ("recall_a", "recall_b", "recall_delta", "mcnemar_p")},
        "margin": {
            "type": "object",
            "required": ["n", "n_nonzero", "a_median", "b_median", "delta_mean", "delta_median", "p_value"],
            "properties": {
                "n": {"type": "integer"},
                "n_nonzero": {"type": "integer"},
                **{k: _NUM for k in ("a_median", "b_median", "delta_mean", "delta_median", "p_value")},
            },
        },
        "answers_differ": {"type": "integer"},
        "first_differing_tokens": {"type": "array", "items": {"type": "integer"}},
        "cached_tokens_a": _NUM,
        "cached_tokens_b": _NUM,
        "determinism_rate": _NUM,
    },
}

ENGINE_STATE_SCHEMA: dict = {
    "type": "object",
    "required": ["kind", "base_url", "config", "factors"],
    "properties": {
        "kind": {"type": "string"},
        "base_url": {"type": "string"},
        "config": {"type": "object"},
        "factors": {
            "type": "object",
            "properties": {
                name: {
                    "type": "object",
                    "required": ["arms", "effect", "rows"],
                    "properties": {
                        "arms": {"type": "array", "items": {"type": "string"}},
                        "effect": _EFFECT,
                        "rows": {"type": "array", "items": {"type": "array"}},
                    },
                }
                for name in ("cache", "concurrency", "repeat")
            },
        },
    },
}


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def engine_state_markdown(body: dict) -> str:
    lines = [
        "# Engine state as a factor",
        "",
        f"{body['base_url']}, {body['config']['kind']} cases at lengths "
        f"{', '.join(map(str, body['config']['lengths']))}; each factor changes one thing, the same cases in "
        "both arms (paired).",
        "",
        "| factor | arms | pairs | recall A | recall B | Δ recall | McNemar p | margin A (median) | margin B "
        "(median) | Δ margin mean / median | Wilcoxon p | answers differ | cached tokens A / B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in body["factors"].items():
        e, m = f["effect"], f["effect"]["margin"]
        lines.append(
            f"| {name} | {' vs '.join(f['arms'])} | {e['pairs']} | {_f(e['recall_a'], '.2f')} | "
            f"{_f(e['recall_b'], '.2f')} | {_f(e['recall_delta'], '+.2f')} | {_f(e['mcnemar_p'], '.3g')} | "
            f"{_f(m['a_median'])} | {_f(m['b_median'])} | {_f(m['delta_mean'], '+.2g')} / "
            f"{_f(m['delta_median'], '+.2g')} | {_f(m['p_value'] if m['n'] else None, '.3g')} | {e['answers_differ']} | "
            f"{_f(e['cached_tokens_a'], '.0f')} / {_f(e['cached_tokens_b'], '.0f')} |"
        )
    rep = body["factors"].get("repeat")
    if rep is not None:
        e = rep["effect"]
        firsts = e["first_differing_tokens"]
        lines += [
            "",
            f"Determinism ({body['config']['repeats']} identical sends a case): "
            f"{_f(e['determinism_rate'], '.2f')} of cases answered token for token the same every time"
            + (f"; where not, the first differing token was at {firsts}." if firsts else "."),
        ]
    cache = body["factors"].get("cache") or {}
    if cache.get("warm_not_reused"):
        lines += [
            "",
            f"Cache: in {cache['warm_not_reused']} of {cache['effect']['pairs']} pair(s) the warm send reused no "
            "more of the prompt than its cold one (`cached_tokens`), so they compare two cold sends: the "
            "server has no prefix cache or does not report `cached_tokens`, evicted the prefix, or a router "
            "sent the two sends to different replicas.",
        ]
    resumed = cache.get("resume") or {}
    if resumed.get("warm_kept") or resumed.get("pairs_resent"):
        lines += [
            "",
            f"Resumed: {resumed['warm_kept']} warm send(s) continued a cold send of an earlier process "
            f"(the server still held its prefix); {resumed['pairs_resent']} pair(s) sent again under a "
            "fresh nonce (it did not).",
        ]
    errors = sum(f["effect"]["errors"] for f in body["factors"].values())
    if errors:
        lines += ["", f"{errors} case(s) failed on one side (recorded as errors, not scored)."]
    warm_up = {n: f["warm_up_errors"] for n, f in body["factors"].items() if f.get("warm_up_errors")}
    if warm_up:
        lines += [
            "",
            "Failed warm-up sends (those cases may have met a cold cache): "
            + ", ".join(f"{n} {k}" for n, k in warm_up.items())
            + ".",
        ]
    return "\n".join(lines) + "\n"


def write_engine_state(body: dict, out: Path) -> tuple[Path, Path]:
    """Check ``body`` and write ``engine_state.json`` and ``engine_state.md`` under ``out``."""
    check_schema(body, ENGINE_STATE_SCHEMA, "engine_state")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "engine_state.json", out / "engine_state.md"
    atomic_write_json(js, body)
    md.write_text(engine_state_markdown(body), encoding="utf-8")
    return js, md
