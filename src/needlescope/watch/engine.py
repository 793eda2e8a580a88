"""The engine's own ``/metrics``, normalized to queue depth, running requests and KV-cache usage.

Each engine names the same facts differently; this table is the whole translation:

| engine | queue depth | running requests | KV-cache usage (0..1) |
|---|---|---|---|
| SGLang | ``sglang:num_queue_reqs`` | ``sglang:num_running_reqs`` | ``sglang:token_usage`` |
| vLLM | ``vllm:num_requests_waiting`` | ``vllm:num_requests_running`` | ``vllm:kv_cache_usage_perc`` (v1), ``vllm:gpu_cache_usage_perc`` (v0) |
| needlescope serve | ``needlescope_serve_queue_depth`` | ``needlescope_serve_running_requests`` | (none: no paged cache) |

Depth and running are summed over label sets (one per model, data-parallel rank or engine);
KV usage is the largest, since the fullest cache is the one that refuses work first. Both vLLM
names are fractions in 0..1 despite the ``_perc`` suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ENGINE_FAMILIES", "EngineLoad", "UnexpectedFormat", "engine_metric_names", "normalize"]

# engine -> (queue depth names, running names, KV usage names); the first name present wins.
ENGINE_FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "sglang": (("sglang:num_queue_reqs",), ("sglang:num_running_reqs",), ("sglang:token_usage",)),
    "vllm": (
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "needlescope": (("needlescope_serve_queue_depth",), ("needlescope_serve_running_requests",), ()),
}


class UnexpectedFormat(ValueError):
    """The body is not Prometheus text, or names none of the known engine families."""


@dataclass(frozen=True)
class EngineLoad:
    engine: str
    queue_depth: float | None
    running: float | None
    kv_cache_usage: float | None


def engine_metric_names() -> set[str]:
    return {name for fams in ENGINE_FAMILIES.values() for names in fams for name in names}


def _first(values: dict[str, list[float]], names: tuple[str, ...], combine) -> float | None:
    for name in names:
        if values.get(name):
            return combine(values[name])
    return None


def normalize(text: str) -> EngineLoad:
    """The load an engine's ``/metrics`` body reports; ``UnexpectedFormat`` when there is none."""
    wanted = engine_metric_names()
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    values.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, IndexError, TypeError) as e:
        raise UnexpectedFormat(f"not Prometheus text ({type(e).__name__}: {str(e)[:120]})") from None
    for engine, (queue, running, kv) in ENGINE_FAMILIES.items():
        depth = _first(values, queue, sum)
        if depth is not None:
            return EngineLoad(engine, depth, _first(values, running, sum), _first(values, kv, max))
    raise UnexpectedFormat(
        "none of the queue metrics of SGLang (sglang:num_queue_reqs), vLLM (vllm:num_requests_waiting) "
        "or needlescope serve (needlescope_serve_queue_depth)"
    )
