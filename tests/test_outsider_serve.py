"""``needlescope serve`` as an outsider drives it: curl's defaults, raw sockets, the official
openai client, and bodies that break the JSON parser. A real server process on loopback; each
test failed before the fix that made it pass."""

from __future__ import annotations

import json
import socket
import subprocess

import httpx
import openai
import pytest

from needlescope.serve.launch import SERVE_ARGV, ServerProcess
from needlescope.testing.checkpoints import TINY_SERVE, save_random

NAME = "tiny"
MSG = [{"role": "user", "content": "the river ran past the old mill and the baker sold bread"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = save_random(tmp_path_factory.mktemp("ckpt"), seed=5, **TINY_SERVE)
    with ServerProcess(["--model", str(ckpt), "--port", "0", "--served-model-name", NAME]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def raw_post(server, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    """POST over a bare socket with exactly ``headers`` (no Content-Type unless given)."""
    host, port = server.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode() + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    status = int(out.split(b" ", 2)[1])
    return status, json.loads(out.split(b"\r\n\r\n", 1)[1])


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code), err
    return err["message"]


def test_a_logit_bias_key_of_thousands_of_digits_is_a_400_not_a_500(server):
    # int() of a string over 4,300 digits raises ValueError: it was a 500 with a traceback.
    for key in ("9" * 5000, "0" * 5000 + "5" * 10):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": MSG, "max_tokens": 2, "logit_bias": {key: 1}},
            timeout=60,
        )
        assert "outside 0.." in assert_error(r, 400, "logit_bias")
    # a key with leading zeros still names its token
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 2, "logit_bias": {"0005": 1}},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_chat_top_logprobs_out_of_range_is_refused_naming_top_logprobs(server):
    for value in (21, -1):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": value},
            timeout=60,
        )
        msg = assert_error(r, 400, "top_logprobs")
        assert msg.startswith("top_logprobs must be in 0..20"), msg


def test_min_tokens_above_max_tokens_is_refused(server):
    """Before: accepted, and the answer stopped at max_tokens, short of min_tokens (vLLM refuses
    it). Equal is allowed; the native route names the field as it was sent."""
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 2, "min_tokens": 3},
        timeout=60,
    )
    assert "must be at most max_tokens=2" in assert_error(r, 400, "min_tokens")
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 2, "min_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
    native = httpx.post(
        server.url + "/generate",
        json={"text": "hello", "sampling_params": {"max_new_tokens": 1, "min_new_tokens": 4}},
        timeout=60,
    )
    assert_error(native, 400, "sampling_params.min_new_tokens")


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "application/x-www-form-urlencoded"},  # curl -d '{...}' (the docs' examples)
        {},  # requests.post(url, data=json.dumps(body)), a raw socket
        {"Content-Type": "text/plain"},
    ],
    ids=["form-urlencoded", "none", "text-plain"],
)
def test_a_json_body_is_read_as_json_whatever_content_type_it_came_with(server, headers):
    body = {"text": "the old mill", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    status, out = raw_post(server, "/generate", json.dumps(body).encode(), headers)
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == 2
    chat = {"model": NAME, "messages": MSG, "max_tokens": 2}
    status, out = raw_post(server, "/v1/chat/completions", json.dumps(chat).encode(), headers)
    assert status == 200, out
    assert out["object"] == "chat.completion"
    # and a body that is not JSON says so
    status, out = raw_post(server, "/generate", b"text=hello", headers)
    assert status == 400 and out["error"]["code"] == "invalid_json", out


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"messages": [{"role": "user", "content": "\xff\xfe hi"}]}', "not valid UTF-8"),
        (b'{"messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", "4300 digits"),
    ],
    ids=["non-utf8", "deep", "huge-int"],
)
def test_a_body_json_cannot_parse_gets_a_clear_invalid_json_error(server, body, says):
    # FastAPI answered all three "There was an error parsing the body", with no code.
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    msg = assert_error(r, 400, None, "invalid_json")
    assert msg.startswith("malformed JSON body: ") and says in msg, msg
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def _stop_at_a_later_token(client) -> tuple[str, str, int]:
    """(prompt, stop string, tokens before it): a stop string that first occurs in the greedy
    answer as the whole text of a token after the first."""
    for prompt in ("the old mill", "the baker sold bread", "every child in the town"):
        full = client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        lp = full.choices[0].logprobs
        text = full.choices[0].text
        for k in range(1, len(lp.tokens)):
            piece, at = lp.tokens[k], lp.text_offset[k]
            if len(piece.strip()) >= 2 and text.find(piece) == at and not piece.startswith("<"):
                return prompt, piece, k
    pytest.fail("no greedy answer held a usable stop token")


def test_a_stop_string_cuts_the_streamed_logprobs_as_it_cuts_the_whole_answers(client):
    # The stream sent the logprobs of the stop string's tokens, the whole answer left them out.
    prompt, stop, before = _stop_at_a_later_token(client)
    kw = dict(model=NAME, prompt=prompt, max_tokens=16, temperature=0, logprobs=1, stop=stop)
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].logprobs.tokens and len(whole.choices[0].logprobs.tokens) == before
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert streamed == whole.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]

    chat = dict(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
    first = client.chat.completions.create(**chat, logprobs=True, extra_body={"ignore_eos": True})
    pieces = [t.token for t in first.choices[0].logprobs.content]
    text = first.choices[0].message.content
    usable = [
        k
        for k in range(1, len(pieces))
        if len(pieces[k].strip()) >= 2
        and not pieces[k].startswith("<")
        and text.find(pieces[k]) >= 0
        and text.find(pieces[k]) == len("".join(pieces[:k]))
    ]
    if not usable:
        return
    chat["stop"] = pieces[usable[0]]
    whole = client.chat.completions.create(**chat, logprobs=True, extra_body={"ignore_eos": True})
    chunks = list(
        client.chat.completions.create(**chat, logprobs=True, stream=True, extra_body={"ignore_eos": True})
    )
    streamed = [
        t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.token for t in whole.choices[0].logprobs.content]


def test_echoed_logprobs_text_offsets_index_the_echoed_text(server, client):
    # Offsets counted "<|bos|>" and "<unk>" as if they were in the text: past the end of it for a
    # token-id prompt (whose echo leaves special tokens out), off by two for an unknown word.
    ids = httpx.post(server.url + "/tokenize", json={"messages": MSG}, timeout=60).json()["tokens"]
    for prompt in ([ids], "the old mill"):
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0
        )
        choice = r.choices[0]
        text, lp = choice.text, choice.logprobs
        n_prompt = r.usage.prompt_tokens
        assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
        placed = 0
        for tok, at in zip(lp.tokens, lp.text_offset):
            if not (tok.startswith("<") and tok.endswith(">")):
                assert text[at : at + len(tok)] == tok, (tok, at, text)
                placed += 1
        assert placed >= 3
        # the answer starts where the echoed prompt ends
        answer = lp.text_offset[n_prompt]
        assert lp.text_offset[n_prompt - 1] <= answer <= len(text)
        if isinstance(prompt, str):
            assert answer == len(prompt) and text.startswith(prompt)
    # the unknown word is the first token of the text prompt, at 0, and " old" at 3
    assert lp.tokens[:2] == ["<unk>", " old"] and lp.text_offset[:2] == [0, 3]
    # the token-id prompt's special tokens are in its tokens (so the first case was not vacuous)
    assert any(
        t.startswith("<|")
        for t in client.completions.create(model=NAME, prompt=[ids], max_tokens=1, echo=True, logprobs=0)
        .choices[0]
        .logprobs.tokens
    )


def test_an_empty_served_model_name_is_refused_with_exit_2():
    # It was accepted and silently replaced by the model's own name.
    res = subprocess.run(
        [*SERVE_ARGV, "--served-model-name", " ", "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: --served-model-name is empty; give a name or leave it unset"
    ]


@pytest.mark.parametrize("host", ["999.1.1.1", "1.2.3", " "])
def test_a_host_no_machine_has_is_one_line_before_any_warning(host):
    """``--host 999.1.1.1`` printed the "listening ... without an API key" warning first, then
    the bind's error: two lines for one bad flag."""
    res = subprocess.run(
        [*SERVE_ARGV, "--host", host, "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: --host") and "WARNING" not in res.stderr


def test_a_prompt_that_fills_the_context_says_it_leaves_no_room(server):
    # It said "maximum context length is 512 tokens. However, you requested 512 tokens".
    context = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    for path, body in (
        ("/v1/completions", {"prompt": [5] * context}),
        ("/generate", {"input_ids": [5] * context}),
    ):
        r = httpx.post(server.url + path, json=body, timeout=60)
        param = "prompt" if path == "/v1/completions" else "input_ids"
        msg = assert_error(r, 400, param, "context_length_exceeded")
        assert f"your prompt has {context} tokens, which leaves no room" in msg, msg
        assert f"at most {context - 1} prompt tokens" in msg
    # one token less fits, and the completion is clamped to the one token of room left
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * (context - 1)}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
