"""``serving_factors.json`` and ``serving_factors.md``: which serving factor moves recall
(``run.serving_factors``). The schema is checked before anything is written."""

from __future__ import annotations

from pathlib import Path

from ..paths import atomic_write_json
from ..schema import check_schema

__all__ = ["SERVING_FACTORS_SCHEMA", "serving_factors_markdown", "write_serving_factors"]

_NUM = {"type": ["number", "null"]}
_INT = {"type": "integer"}
_ROW = {
    "type": "object",
    "required": [
        "case_id",
        "nonce",
        "correct",
        "cached_tokens",
        "hit",
        "batch_size",
        "draft_tokens",
        "error",
    ],
    "properties": {
        "case_id": {"type": "string"},
        "nonce": {"type": "string"},
        "correct": {"type": ["boolean", "null"]},
        "cached_tokens": {"type": ["integer", "null"]},
        "hit": {"type": ["boolean", "null"]},
        "batch_size": {"type": ["integer", "null"]},
        "joined_mid_flight": {"type": ["integer", "null"]},
        "draft_tokens": {"type": ["integer", "null"]},
        "acceptance_rate": _NUM,
        "text": {"type": ["string", "null"]},
        "answer": {"type": ["string", "null"]},
        "error": {"type": ["string", "null"]},
    },
}
_ARM = {
    "type": "object",
    "required": ["name", "factors", "endpoint", "warm", "mates", "fields", "recall", "errors", "rows"],
    "properties": {
        "name": {"type": "string"},
        "factors": {"type": "array", "items": {"type": "string"}},
        "endpoint": _INT,
        "warm": {"type": "boolean"},
        "mates": _INT,
        "fields": {"type": "object"},
        "recall": _NUM,
        "errors": _INT,
        "unverified_hits": {"type": ["integer", "null"]},
        "cached_tokens_mean": _NUM,
        "batch_size_mean": _NUM,
        "draft_tokens_reported": {"type": "array", "items": _INT},
        "acceptance_rate_mean": _NUM,
        "rows": {"type": "array", "items": _ROW},
    },
}
_TESTED = {  # what a test of an arm against the baseline has, of recall or of output identity
    "arm": {"type": "string"},
    "factors": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "pairs": _INT,
    "errors": _INT,
    "p": {"type": "number"},
    "p_holm": {"type": "number"},
    "significant": {"type": "boolean"},
    "power": {"type": "number"},
    "pairs_needed": {"type": ["integer", "null"]},
}
_TEST_REQUIRED = ["arm", "factors", "pairs", "errors", "p", "p_holm", "significant", "power"]


def _test_schema(counts: dict) -> dict:
    """A test's schema: ``_TESTED`` plus ``counts`` (required when integer counts)."""
    required = [k for k, v in counts.items() if v is _INT]
    return {"type": "object", "required": _TEST_REQUIRED + required, "properties": {**_TESTED, **counts}}


_TEST = _test_schema({"lost": _INT, "gained": _INT, "recall_base": _NUM, "recall_arm": _NUM, "delta": _NUM})
_ECHO_LEVEL = {
    "type": "object",
    "required": ["level", "tasks", "errors", "corrupted", "rate", "upper95", "p", "p_holm", "significant"],
    "properties": {
        "level": {"type": "string"},
        "tasks": _INT,
        "errors": _INT,
        "corrupted": _INT,
        "rate": _NUM,
        "upper95": {"type": "number"},
        "p": _NUM,
        "p_holm": _NUM,
        "significant": {"type": "boolean"},
    },
}

_IDENTITY_TEST = _test_schema(
    {"departs": _INT, "departs_repeat": _INT, "only_arm": _INT, "only_repeat": _INT}
)
_VERDICT_BASE = ["named", "kind", "arm", "also", "alpha", "min_power", "sentence"]

SERVING_FACTORS_SCHEMA: dict = {
    "type": "object",
    "required": [
        "kind",
        "base_urls",
        "config",
        "cases",
        "requests",
        "arms",
        "tests",
        "verdict",
        "identity",
        "echo",
    ],
    "properties": {
        "kind": {"type": "string"},
        "base_urls": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "config": {"type": "object"},
        "cases": _INT,
        "requests": {
            "type": "object",
            "required": ["sent", "primes", "fillers"],
            "properties": {"sent": _INT, "primes": _INT, "fillers": _INT},
        },
        "arms": {"type": "array", "items": _ARM, "minItems": 1},
        "tests": {"type": "array", "items": _TEST},
        "verdict": {
            "type": "object",
            "required": ["named", "kind", "arm", "also", "alpha", "min_loss", "min_power", "sentence"],
            "properties": {
                "named": {"type": ["string", "null"]},
                "kind": {"type": "string"},  # factor | interaction | none
                "arm": {"type": ["string", "null"]},
                "also": {"type": "array", "items": {"type": "string"}},
                "alpha": {"type": "number"},
                "min_loss": {"type": "number"},
                "min_power": _NUM,
                "sentence": {"type": "string"},
            },
        },
        "identity": {  # null without a repeat arm (the reference)
            "type": ["object", "null"],
            "required": ["reference", "continuation", "repeat_departs", "repeat_pairs", "tests", "verdict"],
            "properties": {
                "reference": {"type": "string"},
                "continuation": _INT,
                "repeat_departs": _INT,
                "repeat_pairs": _INT,
                "tests": {"type": "array", "items": _IDENTITY_TEST},
                "verdict": {
                    "type": "object",
                    "required": [*_VERDICT_BASE, "min_share"],
                    "properties": {"named": {"type": ["string", "null"]}, "min_share": {"type": "number"}},
                },
            },
        },
        "echo": {  # null without --echo
            "type": ["object", "null"],
            "required": ["baseline", "levels", "rows"],
            "properties": {
                "baseline": {"type": "string"},
                "levels": {"type": "array", "items": _ECHO_LEVEL},
                "rows": {"type": "object"},
            },
        },
    },
}


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _served(arm: dict) -> str:
    """What the server said it did for the arm's sends (unknown: -)."""
    parts = []
    if arm["cached_tokens_mean"] is not None:
        parts.append(f"cached {arm['cached_tokens_mean']:.0f}")
    if arm.get("unverified_hits"):
        parts.append(f"{arm['unverified_hits']} hit(s) unverified")
    if arm["batch_size_mean"] is not None:
        parts.append(f"batch {arm['batch_size_mean']:.1f}")
    if arm["draft_tokens_reported"]:
        parts.append("draft " + "/".join(map(str, arm["draft_tokens_reported"])))
    if arm["acceptance_rate_mean"] is not None:
        parts.append(f"accept {arm['acceptance_rate_mean']:.2f}")
    return ", ".join(parts) or "-"


def _identity_markdown(body: dict) -> list[str]:
    """Output identity, apart from recall: each arm's greedy outputs against the baseline's."""
    ident = body.get("identity")
    if ident is None:
        return []
    cont = ident["continuation"]
    what = f"{cont} greedy tokens with `ignore_eos`" if cont else "the answer"
    lines = [
        "",
        "## Output identity: greedy output departs from the baseline's (not a recall loss)",
        "",
        f"Per case, {what} in each arm against the baseline's, paired with the repeat arm's departures "
        f"(repeat departs in {ident['repeat_departs']} of {ident['repeat_pairs']}: the engine's own "
        "nondeterminism); one-sided exact p, Holm across the arms.",
        "",
        f"**{ident['verdict']['sentence']}**",
        "",
        "| arm | pairs | departs | repeat departs | only arm / only repeat | p | Holm p |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in ident["tests"]:
        mark = " **←**" if ident["verdict"]["arm"] == t["arm"] else ""
        lines.append(
            f"| {t['arm']}{mark} | {t['pairs']} | {t['departs']} | {t['departs_repeat']} | "
            f"{t['only_arm']} / {t['only_repeat']} | {t['p']:.2g} | {t['p_holm']:.2g} |"
        )
    return lines


def _caveats(body: dict) -> list[str]:
    """The notes under the recall table: unverified cache hits, silent draft depths, unknown
    batches, failed requests."""
    cfg, lines = body["config"], []
    unverified = [a for a in body["arms"] if a.get("unverified_hits")]
    if unverified:
        lines += [
            "",
            "Cache: "
            + ", ".join(f"{a['name']} {a['unverified_hits']}" for a in unverified)
            + " warm send(s) reported no more `cached_tokens` than their cold send (or none at all): "
            "no verified prefix hit, left out of the test.",
        ]
    silent = [
        a["name"]
        for a in body["arms"]
        if cfg["draft_field"] in a["fields"] and not a["draft_tokens_reported"] and a["recall"] is not None
    ]
    if silent:
        lines += [
            "",
            f"Draft: the server reported no draft depth for {', '.join(silent)} "
            "(`usage.speculative.num_draft_tokens`): it may ignore the request field "
            f"`{cfg['draft_field']}`, and then those arms repeat the baseline's condition.",
        ]
    if any(a["mates"] for a in body["arms"]) and all(a["batch_size_mean"] is None for a in body["arms"]):
        lines += [
            "",
            "Batch: the server reports no batch size (`usage.batch.size`): the batch arms sent their "
            "mates at once, but what the server batched is unknown.",
        ]
    errors = sum(a["errors"] for a in body["arms"])
    if errors:
        lines += ["", f"{errors} request(s) failed (errors, not misses; their pairs are left out)."]
    return lines


def serving_factors_markdown(body: dict) -> str:
    cfg, verdict = body["config"], body["verdict"]
    tests = {t["arm"]: t for t in body["tests"]}
    urls = " vs ".join(
        f"{u} ({label})" for u, label in zip(body["base_urls"], cfg["endpoint_labels"], strict=False)
    )
    if len(body["base_urls"]) == 1:
        urls = body["base_urls"][0]
    req = body["requests"]
    lines = [
        "# Serving factors",
        "",
        f"{urls}: {body['cases']} {cfg['kind']} cases at lengths {', '.join(map(str, cfg['lengths']))}, "
        f"each arm against the baseline on the same cases (exact McNemar, Holm across {len(body['tests'])} "
        f"arms, alpha {cfg['alpha']:g}); {req['sent']} requests ({req['primes']} cache primes, "
        f"{req['fillers']} batch fillers).",
        "",
        f"**{verdict['sentence']}**",
        "",
        "| arm | pairs | recall | Δ vs baseline | lost / gained | p | Holm p | power at "
        f"-{cfg['min_loss']:.0%} | served (usage) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in body["arms"]:
        t = tests.get(arm["name"])
        mark = " **←**" if verdict["arm"] == arm["name"] else ""
        if t is None:
            lines.append(f"| {arm['name']} | - | {_f(arm['recall'])} | - | - | - | - | - | {_served(arm)} |")
            continue
        lines.append(
            f"| {arm['name']}{mark} | {t['pairs']} | {_f(t['recall_arm'])} | {_f(t['delta'], '+.2f')} | "
            f"{t['lost']} / {t['gained']} | {t['p']:.2g} | {t['p_holm']:.2g} | {t['power']:.2f} | {_served(arm)} |"
        )
    lines += _caveats(body)
    lines += _identity_markdown(body)
    echo = body["echo"]
    if echo is not None:
        lines += [
            "",
            f"## Echo probe: exact copy of {cfg['echo_items']} numbers, by draft depth",
            "",
            "| draft depth | tasks | corrupted | rate | 95% upper (Clopper-Pearson) | p vs "
            f"{echo['baseline']} | Holm p |",
            "|---|---|---|---|---|---|---|",
        ]
        for lv in echo["levels"]:
            sig = " **↑**" if lv["significant"] else ""
            lines.append(
                f"| {lv['level']}{sig} | {lv['tasks']} | {lv['corrupted']} | {_f(lv['rate'])} | "
                f"{lv['upper95']:.2f} | {_f(lv['p'], '.2g')} | {_f(lv['p_holm'], '.2g')} |"
            )
    return "\n".join(lines) + "\n"


def write_serving_factors(body: dict, out: Path) -> tuple[Path, Path]:
    """Check ``body`` and write ``serving_factors.json`` and ``serving_factors.md`` under ``out``."""
    check_schema(body, SERVING_FACTORS_SCHEMA, "serving_factors")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "serving_factors.json", out / "serving_factors.md"
    atomic_write_json(js, body)
    md.write_text(serving_factors_markdown(body), encoding="utf-8")
    return js, md
