"""Writing reproducer bundles for a run's failing cases, and replaying one against a server."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from needlescope.analysis.taxonomy import classify
from needlescope.cases import score_answer
from needlescope.cases.scoring import prompt_rivals
from needlescope.errors import ProbeError
from needlescope.report.bundle import read_bundle, write_bundle
from needlescope.targets import ChatTarget, normalize_base_url, preflight
from needlescope.targets.client import chat_payload

__all__ = ["write_failure_bundles", "replay_bundle"]


def write_failure_bundles(
    out_dir: Path,
    rows: list[dict],
    cases: dict[str, dict],
    *,
    model: str,
    max_tokens: int,
    extra_body: dict,
    generation: dict,
    provenance: dict,
    limit: int,
) -> list[str]:
    """Bundles for up to ``limit`` misses: first one per failure class, then the rest in order.

    ``rows`` are result rows carrying ``failure`` for misses; returns the bundled case ids.
    """
    misses = [r for r in rows if r.get("status") == "ok" and not r.get("correct")]
    firsts: dict[str, dict] = {}
    for r in misses:
        firsts.setdefault((r.get("failure") or {}).get("category", "?"), r)
    chosen = list(firsts.values()) + [r for r in misses if r not in firsts.values()]
    done = []
    for r in chosen[: max(0, limit)]:
        case = cases[r["case_id"]]
        request = chat_payload(model, case["messages"], max_tokens, extra_body)
        write_bundle(
            out_dir / r["case_id"],
            request=request,
            result=r,
            case=case,
            generation=generation,
            provenance=provenance,
        )
        done.append(r["case_id"])
    return done


async def _send(base_url: str, request: dict, times: int, api_key: str | None) -> list[dict]:
    body = {k: v for k, v in request.items() if k not in ("model", "messages", "max_tokens")}
    out = []
    async with ChatTarget(base_url, request["model"], api_key=api_key) as target:
        for _ in range(times):
            try:
                res = await target.chat(
                    request["messages"], max_tokens=request.get("max_tokens", 32), extra_body=body
                )
            except ProbeError as e:
                out.append({"status": "error", "error": str(e)})
                continue
            out.append(
                {
                    "status": "ok",
                    "answer": res.text,
                    "reasoning": res.reasoning,
                    "finish_reason": res.finish_reason,
                }
            )
    return out


def replay_bundle(bundle: Path, base_url: str, *, times: int = 1, api_key: str | None = None) -> dict:
    """Re-send a bundle's request ``times`` times; say whether (and how often) the miss reproduces.

    Errors are counted apart: a failed request neither reproduces nor clears the failure.
    """
    request, manifest = read_bundle(bundle)
    root, _v1 = normalize_base_url(base_url)
    preflight(root, request["model"], api_key=api_key)
    expected = manifest["expected"]
    answers = asyncio.run(_send(base_url, request, times, api_key))
    classes: Counter[str] = Counter()
    for a in answers:
        if a["status"] != "ok":
            continue
        a["correct"] = score_answer(a["answer"], expected, prompt_rivals(request["messages"], expected))
        if not a["correct"]:
            fail = classify(
                answer=a["answer"],
                expected=expected,
                finish_reason=a["finish_reason"],
                reasoning=a["reasoning"],
                messages=request["messages"],
            )
            a["failure"] = fail.to_dict()
            classes[fail.category] += 1
    scored = [a for a in answers if a["status"] == "ok"]
    reproduced = sum(1 for a in scored if not a["correct"])
    errors = len(answers) - len(scored)
    original = (manifest.get("failure") or {}).get("category")
    if not scored:
        verdict = f"could not tell: all {times} request(s) failed"
    elif reproduced:
        kinds = ", ".join(f"{k} {n}" for k, n in classes.most_common())
        verdict = f"reproduced {reproduced}/{len(scored)} times ({kinds}; originally {original})"
    else:
        verdict = f"did not reproduce: answered correctly {len(scored)}/{len(scored)} times"
    if errors:
        verdict += f"; {errors} request(s) failed and are not counted"
    return {
        "case_id": manifest["case_id"],
        "base_url": base_url,
        "times": times,
        "scored": len(scored),
        "reproduced": reproduced,
        "errors": errors,
        "classes": dict(classes),
        "answers": answers,
        "verdict": verdict,
    }
