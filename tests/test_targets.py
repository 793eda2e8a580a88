"""Target client, preflight, token counting and provenance: mocked transports and the scripted server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from needlescope.errors import BadInput, ContextOverflow, ProtocolViolation, TransportFailure
from needlescope.targets import (
    ChatTarget,
    ServerTokenCounter,
    collect_provenance,
    detect_server_tokenizer,
    normalize_base_url,
    preflight,
    strip_secrets,
)

OK = {
    "choices": [{"message": {"content": "42", "reasoning_content": "think"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}},
}
MSGS = [{"role": "user", "content": "What is the x? Answer with the number only."}]


def run(coro):
    return asyncio.run(coro)


async def _chat(handler, **kw):
    target = ChatTarget("http://t/v1", "m", transport=httpx.MockTransport(handler), backoff_base=0.001, **kw)
    try:
        return await target.chat(MSGS, max_tokens=8, extra_body={"top_k": 1})
    finally:
        await target.aclose()


def test_normalize_base_url():
    assert normalize_base_url("http://h:1") == ("http://h:1", "http://h:1/v1")
    assert normalize_base_url("http://h:1/v1/") == ("http://h:1", "http://h:1/v1")
    with pytest.raises(BadInput):
        normalize_base_url("h:1")
    # an endpoint pasted as the base URL (health read it as "unhealthy: GET .../models 404")
    for url in ("http://h:1/v1/chat/completions", "http://h:1/v1/completions/", "http://h:1/generate"):
        with pytest.raises(BadInput, match=r"names an endpoint .*e\.g\. http://h:1/v1$"):
            normalize_base_url(url)


def test_retries_429_honouring_retry_after():
    calls: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(json.loads(req.content))
        if len(calls) < 3:
            return httpx.Response(
                429, headers={"Retry-After": "0.05"}, json={"error": {"message": "slow down"}}
            )
        return httpx.Response(200, json=OK)

    res = run(_chat(handler))
    assert (res.text, res.reasoning, res.prompt_tokens, res.cached_tokens, res.attempts) == (
        "42",
        "think",
        7,
        3,
        3,
    )
    assert res.latency_s >= 0.1  # two Retry-After waits of 0.05 s
    assert calls[0]["top_k"] == 1 and calls[0]["temperature"] == 0 and calls[0]["model"] == "m"


def test_retries_exhausted_is_transport_failure():
    res = lambda req: httpx.Response(500, json={"error": {"message": "down"}})  # noqa: E731
    with pytest.raises(TransportFailure, match="3 attempts") as info:
        run(_chat(res, retries=2))
    assert info.value.attempts == 3

    def refuse(req):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(TransportFailure):
        run(_chat(refuse, retries=1))


def test_garbage_and_missing_choices_are_protocol_violations():
    with pytest.raises(ProtocolViolation):
        run(_chat(lambda req: httpx.Response(200, content=b"{not json")))
    with pytest.raises(ProtocolViolation, match="no choices"):
        run(_chat(lambda req: httpx.Response(200, json={"choices": []})))


def test_context_overflow():
    msg = {"error": {"message": "This model's maximum context length is 4096 tokens"}}
    with pytest.raises(ContextOverflow):
        run(_chat(lambda req: httpx.Response(400, json=msg)))


def test_spreads_over_base_urls():
    hosts: list[str] = []

    def handler(req):
        hosts.append(req.url.host)
        return httpx.Response(200, json=OK)

    async def go():
        t = ChatTarget(["http://a", "http://b/v1"], "m", transport=httpx.MockTransport(handler))
        try:
            return await asyncio.gather(*(t.chat(MSGS, max_tokens=1) for _ in range(4)))
        finally:
            await t.aclose()

    results = run(go())
    assert sorted(hosts) == ["a", "a", "b", "b"]
    assert {r.base_url for r in results} == {"http://a/v1", "http://b/v1"}


def test_preflight_against_scripted_server(scripted_server):
    url = scripted_server(window=100)
    assert preflight(url, "scripted") == []  # listed: nothing assumed
    assert preflight(url + "/v1", "scripted") == []
    with pytest.raises(BadInput, match="model 'nope' not served at .*; available: scripted"):
        preflight(url, "nope")


def test_preflight_unreachable():
    with pytest.raises(
        BadInput, match=r"cannot reach http://127\.0\.0\.1:9/v1: connection refused; .*--base-url"
    ):
        preflight("http://127.0.0.1:9", "m", timeout=2)


def test_preflight_no_chat_endpoint():
    def handler(req):
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(404)

    with pytest.raises(BadInput, match="no chat completions"):
        preflight("http://t", "m", transport=httpx.MockTransport(handler))


def test_server_token_count_matches_word_rule(scripted_server):
    url = scripted_server(window=100)
    root, _ = normalize_base_url(url)
    counter = detect_server_tokenizer(root, "scripted")
    assert counter is not None and counter.form == "vllm"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b  c\nd"}]
    # "<|system|> be brief" (3) + "<|user|> a b c d" (5) + "<|assistant|>" (1)
    assert counter(msgs) == 9
    counter.close()


def test_server_token_counter_llamacpp_fallback():
    def handler(req):
        body = json.loads(req.content)
        if req.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": "x y z"})
        if req.url.path == "/tokenize" and "content" in body:
            return httpx.Response(200, json={"tokens": [1, 2, 3]})
        return httpx.Response(404)

    counter = ServerTokenCounter("http://t", "m", transport=httpx.MockTransport(handler))
    assert counter(MSGS) == 3 and counter.form == "llamacpp"


def test_chat_against_scripted_server_window(scripted_server):
    url = scripted_server(window=30)
    fact = "The magic number of the red door is 4711."
    filler = " ".join(["hay"] * 50)
    q = "What is the magic number of the red door? Answer with the number only."

    async def go(content):
        t = ChatTarget(url, "scripted")
        try:
            return await t.chat([{"role": "user", "content": content}], max_tokens=8)
        finally:
            await t.aclose()

    near = run(go(f"{filler} {fact} {q}"))
    far = run(go(f"{fact} {filler} {q}"))
    assert near.text == "4711" and far.text == "I don't know"
    assert near.prompt_tokens == 2 + len(f"{filler} {fact} {q}".split())
    assert far.cached_tokens == 1  # shares only "<|user|>" with the first request


def test_provenance_has_no_secrets(scripted_server):
    url = scripted_server(window=100)
    prov = collect_provenance(*normalize_base_url(url))
    assert prov["status"]["/get_server_info"] == 200 and prov["status"]["/version"] == 404
    assert prov["/get_server_info"]["nested"] == {"ok": 1}
    text = json.dumps(prov).lower()
    assert "sk-should" not in text and "hf_secret" not in text and "api_key" not in text


def test_strip_secrets_recursive():
    assert strip_secrets({"API_Key": 1, "a": [{"Password": 2, "b": 3}], "c": {"tokenizer": 1}}) == {
        "a": [{"b": 3}],
        "c": {},
    }


def test_scripted_server_answer_rule():
    from needlescope.testing.scripted_server import answer

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    many = "The secret codes of the red fox are 11111, 22222 and 33333. What are all the secret codes of the red fox?"
    assert answer(user(many), 100) == "11111, 22222, 33333"
    multikey = "The secret code of the blue fox is 4. The secret code of the Red fox is 5. What is the secret code of the red fox?"
    assert answer(user(multikey), 100) == "5"
    assert (
        answer(
            user(
                "The secret code of the red fox is 5. "
                + "hay " * 20
                + "What is the secret code of the red fox?"
            ),
            10,
        )
        == "I don't know"
    )


def test_rejections_are_retried_within_a_time_budget_not_a_count():
    calls = []

    def handler(req):
        calls.append(1)
        if len(calls) <= 8:  # more rejections than ``retries`` allows other failures
            return httpx.Response(503, headers={"Retry-After": "0.01"}, json={"error": {"message": "full"}})
        return httpx.Response(200, json=OK)

    res = run(_chat(handler, retries=2, retry_budget_s=30))
    assert res.attempts == 9
    with pytest.raises(TransportFailure, match="retry budget") as info:
        run(_chat(lambda req: httpx.Response(429, headers={"Retry-After": "0.05"}), retry_budget_s=0.2))
    assert info.value.attempts >= 2


def test_gate_halves_on_rejection_and_grows_back_on_success():
    from needlescope.targets.gate import AdaptiveGate

    async def go():
        gate = AdaptiveGate(8, cooldown_s=0)
        gate.rejected()
        gate.rejected()
        assert (gate.limit, gate.lowest) == (2, 2)
        entered = []

        async def one(i):
            async with gate:
                entered.append(i)
                await asyncio.sleep(0.01)
                assert gate._in_flight <= gate.limit

        await asyncio.gather(*(one(i) for i in range(6)))
        assert sorted(entered) == list(range(6))
        for _ in range(2 + 3):
            gate.success()
        assert gate.limit == 4 and gate.lowest == 2

    run(go())


@pytest.fixture(scope="module")
def rejecting_server():
    """A loopback server that answers every chat 503 with the Retry-After its path names
    (``/<value>/v1/chat/completions``) and counts the attempts per value."""
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import unquote

    from needlescope.testing.servers import in_thread

    attempts: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            value = unquote(self.path.split("/")[1])
            attempts[value] = attempts.get(value, 0) + 1
            body = b'{"error": {"message": "admission queue full"}}'
            self.send_response(503)
            self.send_header("Retry-After", value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with in_thread(Handler) as root:
        yield root, attempts


RETRY_BUDGET_S = 1.0


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_retry_after_that_is_no_wait_keeps_the_backoff(rejecting_server, value):
    """Issue 38 R8: a Retry-After of 0, negative or NaN removed all backoff (about 1,400 attempts
    per case in a 10 s budget). Now the exponential backoff (0.5 s doubling) is the least wait:
    a handful of attempts fill the budget."""
    root, attempts = rejecting_server

    async def go():
        async with ChatTarget(f"{root}/{value}/v1", "m", retry_budget_s=RETRY_BUDGET_S) as target:
            await target.chat(MSGS, max_tokens=8)

    with pytest.raises(TransportFailure, match="retry budget"):
        run(go())
    assert 2 <= attempts[value] <= 4, attempts  # waits of at least 0.25, 0.5, 1 s: three fit in 1 s


@pytest.mark.parametrize("value", ["1e9", "inf", "1e999"])
def test_a_huge_retry_after_waits_at_most_the_backoff_ceiling(rejecting_server, value):
    """The other end of R8's range (held before too, guarded here): a Retry-After far beyond any
    budget is cut to ``backoff_max``: with a 1 s budget and a 0.5 s ceiling the client retries
    after about 0.5 s, not never (or after 31 years)."""
    root, attempts = rejecting_server

    async def go():
        async with ChatTarget(
            f"{root}/{value}/v1", "m", retry_budget_s=RETRY_BUDGET_S, backoff_max=0.5
        ) as target:
            await target.chat(MSGS, max_tokens=8)

    with pytest.raises(TransportFailure, match="retry budget"):
        run(go())
    assert attempts[value] == 2, attempts
