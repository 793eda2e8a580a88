"""``needlescope health``: a smoke test of a serving deployment, for readiness probes and cron.

Three checks, in order, each with its latency:

- ``server``: ``GET /health`` (or ``/v1/models`` where there is no ``/health``) answers 200;
- ``chat``: one tiny chat completion asked to answer with the word HEALTHY. A model that answers
  something else is up but does not follow the instruction: status ``warn``, not ``fail``;
- ``needle``: one needle probe at a short length, built and scored as the probe does.

A check is ``ok``, ``warn``, ``fail`` or ``skip`` (the server did not answer, so the later checks
were not tried). The deployment is healthy when no check failed or was skipped.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

import httpx

from needlescope.cases.scoring import normalize_tokens
from needlescope.errors import BadInput, ProbeError
from needlescope.schema import check_schema
from needlescope.targets import ChatTarget, normalize_base_url
from needlescope.targets.limits import choose_value_digits, fit_lengths
from needlescope.watch import probe
from needlescope.watch.config import HealthConfig
from needlescope.watch.probe import RecordingTransport

__all__ = ["HEALTH_PROMPT", "HEALTH_SCHEMA", "Check", "run_health"]

HEALTH_PROMPT = "This is a health check. Reply with the single word HEALTHY and nothing else."

HEALTH_SCHEMA = {
    "type": "object",
    "required": ["healthy", "base_url", "model", "value_digits", "value_digits_source", "checks"],
    "properties": {
        "healthy": {"type": "boolean"},
        "base_url": {"type": "string"},
        "model": {"type": ["string", "null"]},
        "value_digits": {"type": ["integer", "null"]},
        "value_digits_source": {"type": ["string", "null"]},
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "status", "latency_s", "detail"],
                "properties": {
                    "name": {"type": "string"},
                    "status": {"type": "string"},
                    "latency_s": {"type": ["number", "null"]},
                    "detail": {"type": "string"},
                },
            },
        },
    },
}


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """ok | warn | fail | skip"""
    latency_s: float | None
    detail: str


def run_health(cfg: HealthConfig) -> dict:
    """Run the checks; return the report (``HEALTH_SCHEMA``). Never raises for a failing server;
    BadInput (exit 2) when ``--length`` is beyond the context the target advertises or too short
    for the needle, ``--tokenizer PATH`` holds no usable tokenizer, or ``--model`` names a model
    the target does not list."""
    return asyncio.run(_run(cfg))


async def _run(cfg: HealthConfig) -> dict:
    root, v1 = normalize_base_url(cfg.base_url)
    model = cfg.model
    digits: tuple[int, str] | None = None
    async with probe.watch_client(cfg) as client:
        server = await probe.check_server(client, root, v1)
        checks = [Check("server", "ok" if server.error is None else "fail", server.e2e_s, server.detail)]
        if server.error is not None:
            checks += [Check(n, "skip", None, "the server did not answer") for n in ("chat", "needle")]
        else:
            try:
                model = await probe.resolve_model(client, v1, model)
            except (BadInput, httpx.TransportError) as e:
                if isinstance(e, BadInput) and model is not None:
                    raise  # --model names a model the server does not serve: bad usage (exit 2)
                checks += [Check(n, "fail", None, f"no model to ask: {e}") for n in ("chat", "needle")]
            else:
                limits, _ = await asyncio.to_thread(probe.target_limits, cfg, root, v1, model)
                # A length the target cannot hold is a usage error (exit 2), found before any needle.
                fit_lengths((cfg.length,), limits, answer_tokens=cfg.max_tokens, flag="--length")
                digits = choose_value_digits(cfg.value_digits, limits)
                recorder = RecordingTransport()
                async with probe.probe_target(v1, model, cfg, recorder) as target:
                    checks.append(await _chat(target, cfg))
                    checks.append(await _needle(target, recorder, root, model, cfg, digits[0]))
    report = {
        "healthy": all(c.status in ("ok", "warn") for c in checks),
        "base_url": cfg.base_url,
        "model": model,
        "value_digits": digits[0] if digits else None,
        "value_digits_source": digits[1] if digits else None,
        "checks": [asdict(c) for c in checks],
    }
    check_schema(report, HEALTH_SCHEMA, "health")
    return report


async def _chat(target: ChatTarget, cfg: HealthConfig) -> Check:
    try:
        result = await target.chat(
            [{"role": "user", "content": HEALTH_PROMPT}], max_tokens=8, extra_body=cfg.extra_body
        )
    except ProbeError as e:
        return Check("chat", "fail", None, str(e))
    if "healthy" in normalize_tokens(result.text):
        return Check("chat", "ok", result.latency_s, "answered HEALTHY")
    return Check(
        "chat",
        "warn",
        result.latency_s,
        f"answered {result.text[:40]!r}, not HEALTHY: the model is up but does not follow this instruction",
    )


async def _needle(
    target: ChatTarget, recorder: RecordingTransport, root: str, model: str, cfg: HealthConfig, digits: int
) -> Check:
    try:
        counter = await asyncio.to_thread(probe.token_counter, cfg, root, model)
    except BadInput as e:
        if cfg.tokenizer != "server":
            raise  # --tokenizer PATH holds no usable tokenizer: bad usage (exit 2), not the server
        return Check("needle", "fail", None, f"cannot build the needle case: {e}")
    except ProbeError as e:
        return Check("needle", "fail", None, f"cannot build the needle case: {e}")
    try:
        (case,) = await asyncio.to_thread(
            probe.build_probe_cases,
            cfg,
            root,
            model,
            lengths=(cfg.length,),
            depths=(cfg.depth,),
            trials=1,
            value_digits=digits,
            counter=counter,
        )
    except ProbeError as e:
        return Check("needle", "fail", None, f"cannot build the needle case: {e}")
    # A BadInput here is the case itself (a --length too short for the needle): bad usage, exit 2.
    finally:
        probe.close_counter(counter)
    outcome = await probe.probe_case(
        target, recorder, case, max_tokens=cfg.max_tokens, extra_body=cfg.extra_body
    )
    where = f"{cfg.length} tokens, depth {cfg.depth:g}%, a {digits}-digit value"
    if outcome.error is not None:
        return Check("needle", "fail", outcome.e2e_s, f"{outcome.error}: {outcome.detail}")
    if not outcome.correct:
        return Check("needle", "fail", outcome.e2e_s, f"missed the needle at {where}")
    return Check("needle", "ok", outcome.e2e_s, f"recalled the needle at {where}")
