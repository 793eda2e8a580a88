"""Recall by endpoint (and by replica where a router names it): does any one differ from the rest?"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import BadInput
from .significance import groups_vs_rest

__all__ = ["endpoint_breakdown", "check_same_models"]


def endpoint_breakdown(rows: Iterable[dict], *, alpha: float = 0.05) -> dict:
    """Per ``base_url`` (and per ``replica`` when responses named one): recall, and a Fisher exact
    test of each against all the others, Holm-corrected. Errors are left out, as everywhere.

    Returns ``{"endpoints": [...], "replicas": [...], "differs": [names], "replica_note": str}``;
    ``differs`` names those significantly worse than the rest (a healthy replica beside a faulty
    one is better than "the rest" too, and is not what anyone is looking for).
    """
    rows = [r for r in rows if r.get("status") == "ok"]

    def table(key: str) -> list[dict]:
        outcomes = [(str(r[key]), bool(r.get("correct"))) for r in rows if r.get(key)]
        return [
            {
                "name": g.group,
                "n": g.n,
                "correct": g.correct,
                "recall": g.recall,
                "rest_recall": g.rest_recall,
                "p_value": g.p_value,
                "p_holm": g.p_holm,
            }
            for g in groups_vs_rest(outcomes)
        ]

    endpoints = table("base_url")
    replicas = table("replica")
    differs = [
        e["name"]
        for e in endpoints + replicas
        if e["p_holm"] < alpha
        and e["rest_recall"] is not None
        and e["recall"] is not None
        and e["recall"] < e["rest_recall"]
    ]
    if replicas:
        note = f"{len(replicas)} replica(s) named by the responses (X-Replica-Id or similar)"
    else:
        note = (
            "the responses name no replica; behind a router, per-replica attribution needs each "
            "replica's URL as its own --base-url"
        )
    return {"endpoints": endpoints, "replicas": replicas, "differs": differs, "replica_note": note}


def check_same_models(models_by_url: dict[str, list[str]]) -> None:
    """BadInput naming the first endpoint whose served models differ from the first endpoint's.

    Spreading one probe over replicas only makes sense when they serve the same thing.
    """
    items = list(models_by_url.items())
    if not items:
        return
    first_url, first = items[0]
    for url, ids in items[1:]:
        if sorted(ids) != sorted(first):
            raise BadInput(
                f"--base-url {url} serves {', '.join(sorted(ids)) or '(nothing)'} but {first_url} serves "
                f"{', '.join(sorted(first)) or '(nothing)'}; every --base-url must be a replica of one model"
            )
