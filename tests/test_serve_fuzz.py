"""Property-based API fuzz of ``needlescope serve`` from its own OpenAPI schema (schemathesis).

A real server process on loopback, every operation in ``/openapi.json``, a bounded number of
generated requests each (valid by the schema, and schema-violating ones). For every response:
no 5xx, no hang (each request has a deadline), status code, content type and body conform to
the schema; and ``/health`` answers between requests throughout. The number of requests sent
is printed (docs/serve.md records it).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from needlescope.serve.launch import ServerProcess
from needlescope.testing.checkpoints import save_random

SMALL = dict(hidden_size=32, q_lora_rank=16, o_lora_rank=16, moe_intermediate_size=32, index_topk=4)
EXAMPLES = 12  # per operation and mode: about 400 requests in all, well inside the CI budget
DEADLINE_S = 60  # a request not answered by then is a hang
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = save_random(tmp_path_factory.mktemp("ckpt"), seed=5, **SMALL)
    # A short generation cap keeps every generated request fast; larger max_tokens get a 400.
    with ServerProcess(["--model", str(ckpt), "--port", "0", "--max-new-tokens", "4"]) as srv:
        yield srv


def fuzz(op, mode, server, health, sent) -> None:
    """``EXAMPLES`` generated requests to one operation in one mode, each checked."""
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=server.url, timeout=DEADLINE_S)
        sent["requests"] += 1
        case.validate_response(response, checks=checks)
        assert health.get("/health").status_code == 200
        sent["health_checks"] += 1

    try:
        run()
    except Exception as exc:  # name the operation; hypothesis shows the failing case
        raise AssertionError(f"{op.method.upper()} {op.path} ({mode.value}): {exc}") from exc


def test_fuzz_from_the_openapi_schema_finds_no_5xx_no_hang_and_only_documented_answers(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/health"} <= paths
    sent = {"requests": 0, "health_checks": 0}
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as health:
        for op in operations:
            fuzz(op, GenerationMode.POSITIVE, server, health, sent)
            if len(op.body):  # only a body can be made schema-invalid (paths are free strings)
                fuzz(op, GenerationMode.NEGATIVE, server, health, sent)
    print(
        f"\nAPI fuzz: {sent['requests']} requests over {len(operations)} operations, "
        f"/health ok {sent['health_checks']} times"
    )
    assert sent["requests"] >= len(operations)
