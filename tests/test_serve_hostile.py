"""``needlescope serve`` against hostile and odd input: a real server process on loopback, raw
HTTP and the official openai client as callers. Every test is named after the behaviour it
guards; each failed before the fix that made it pass."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from needlescope.serve.launch import ServerProcess
from needlescope.testing.checkpoints import TINY_SERVE, save_random

NAME = "tiny"
BODY_LIMIT = 100_000
WORDS = "the river ran past the old mill and the baker sold bread to every child in the town"
MSG = [{"role": "user", "content": WORDS}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("ckpt"), seed=3, **TINY_SERVE)


@pytest.fixture(scope="module")
def server(ckpt):
    args = ["--model", str(ckpt), "--port", "0", "--served-model-name", NAME]
    args += ["--max-running-requests", "4", "--max-body-bytes", str(BODY_LIMIT)]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def post(server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        kw["content"], kw["headers"] = body, {"content-type": "application/json"}
    else:
        kw["json"] = body
    return httpx.post(server.url + path, timeout=60, **kw)


def chat_body(**kw) -> dict:
    return {"model": NAME, "messages": MSG, "max_tokens": 4, "temperature": 0, **kw}


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


# ---- item 5: one bad request never fails its neighbours -------------------------------------


def test_huge_seeds_and_tiny_temperatures_are_served_beside_normal_requests(server):
    odd = [
        chat_body(seed=2**64, temperature=1.0, ignore_eos=True),
        chat_body(seed=-(2**70), temperature=0.7, ignore_eos=True),
        chat_body(temperature=1e-40, ignore_eos=True),
        chat_body(ignore_eos=True),
    ]
    # Same prompt, fired together: they batch, so a bad row would fail its neighbours.
    with cf.ThreadPoolExecutor(len(odd)) as pool:
        answers = list(pool.map(lambda b: post(server, "/v1/chat/completions", b), odd))
    assert [r.status_code for r in answers] == [200] * len(odd), [r.text for r in answers]
    # temperature below the epsilon is greedy: the same answer as temperature 0
    assert answers[2].json()["choices"][0]["message"] == answers[3].json()["choices"][0]["message"]
    gen = post(
        server, "/generate", {"text": WORDS, "sampling_params": {"max_new_tokens": 3, "sampling_seed": 2**64}}
    )
    assert gen.status_code == 200, gen.text
    again = post(
        server, "/generate", {"text": WORDS, "sampling_params": {"max_new_tokens": 3, "sampling_seed": 2**64}}
    )
    assert again.json()["output_ids"] == gen.json()["output_ids"]  # a huge seed still seeds


# ---- item 6: body size, over-long text ------------------------------------------------------


def test_a_body_over_the_limit_is_refused_with_413_and_the_server_stays_healthy(server):
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (BODY_LIMIT * 3)}])).encode()
    err = assert_error(post(server, "/v1/chat/completions", big), 413, None)
    assert str(BODY_LIMIT) in err["message"] and "--max-body-bytes" in err["message"]

    def chunked():
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(
        server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert_error(r, 413, None)
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/chat/completions", chat_body()).status_code == 200


def test_text_longer_than_any_context_is_refused_before_tokenising(server):
    info = httpx.get(server.url + "/get_server_info").json()
    too_many_chars = "y" * (info["context_length"] * 64)  # under the body limit, over any 512-token text
    err = assert_error(
        post(server, "/v1/completions", {"model": NAME, "prompt": too_many_chars}), 400, "prompt"
    )
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]


def test_tokenising_runs_off_the_event_loop():
    """A tokenizer call that blocks must leave the loop free for other coroutines (``/health``)."""
    import asyncio
    import threading

    from needlescope.organism.tokenizer import build_tokenizer
    from needlescope.serve.tokens import Tokens

    release = threading.Event()

    class Slow:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

        def __call__(self, text, **kw):
            assert release.wait(timeout=30), "the loop never ran while tokenising"
            return self.tok(text, **kw)

    tokens = Tokens(Slow(build_tokenizer()), context_length=512)

    async def main():
        task = asyncio.create_task(tokens.text_ids(WORDS))
        await asyncio.sleep(0)  # the encode is now waiting on its thread
        release.set()  # runs on the loop: only possible if the loop is free
        return await task

    try:
        assert len(asyncio.run(main())) > 5
    finally:
        tokens.close()


# ---- item 7: lone surrogates ----------------------------------------------------------------


@pytest.mark.parametrize(
    "path, raw, param",
    [
        (
            "/v1/chat/completions",
            b'{"model":"tiny","messages":[{"role":"user","content":"a\\ud800b"}]}',
            "messages.0.content",
        ),
        ("/generate", b'{"text":"\\ud800","sampling_params":{"max_new_tokens":2}}', "text"),
        ("/tokenize", b'{"prompt":"x\\udfff"}', "prompt"),
        ("/v1/completions", b'{"model":"tiny","prompt":"ok","stop":["\\ud800"]}', "stop.0"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field_and_keeps_the_connection(server, path, raw, param):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, param)
        assert "surrogate" in r.json()["error"]["message"]
        assert (
            c.get("/health").status_code == 200
        )  # same client, the connection survived or was replaced cleanly


# ---- items 8, 9: strict numbers, n: null ----------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", True),
        ("temperature", True),
        ("n", True),
        ("seed", 1.5),
        ("top_p", "0.5"),
        ("logprobs", 1),
    ],
)
def test_booleans_strings_and_floats_are_not_accepted_as_other_types(server, field, value):
    assert_error(post(server, "/v1/chat/completions", chat_body(**{field: value})), 400, field)


def test_n_null_means_one(client):
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=2, n=None)
    assert len(r.choices) == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSG, max_tokens=2, n=2)
    assert e.value.body["param"] == "n"


# ---- item 10: implemented and refused parameters --------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("response_format", {"type": "json_object"}),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("best_of", 2),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("guided_regex", "[0-9]+"),
        ("skip_special_tokens", False),
    ],
)
def test_parameters_that_would_change_the_output_are_refused_by_name(server, field, value):
    err = assert_error(post(server, "/v1/chat/completions", chat_body(**{field: value})), 400, field)
    assert field in err["message"]


def test_neutral_values_of_refused_parameters_and_unknown_fields_are_accepted(server):
    body = chat_body(
        response_format={"type": "text"}, tools=[], tool_choice="none", presence_penalty=0, user="u"
    )
    body["some_vendor_extra"] = {"x": 1}
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_logit_bias_forces_a_token(client, server):
    tok = post(server, "/tokenize", {"prompt": " bread", "add_special_tokens": False}).json()["tokens"][-1]
    r = client.completions.create(
        model=NAME,
        prompt=WORDS,
        max_tokens=4,
        temperature=0,
        logit_bias={str(tok): 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    ids = post(server, "/tokenize", {"prompt": r.choices[0].text, "add_special_tokens": False}).json()[
        "tokens"
    ]
    assert ids == [tok] * 4, (r.choices[0].text, ids)
    bad = post(server, "/v1/completions", {"model": NAME, "prompt": "a", "logit_bias": {str(tok): 101}})
    assert_error(bad, 400, "logit_bias")


def test_stop_token_ids_and_min_tokens(server):
    base = {"text": WORDS, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    free = post(server, "/generate", base).json()["output_ids"]
    first = free[0]
    stopped = post(
        server,
        "/generate",
        {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [first]}},
    )
    meta = stopped.json()["meta_info"]
    assert meta["completion_tokens"] == 1 and meta["finish_reason"] == {"type": "stop", "matched": first}
    held = post(
        server,
        "/generate",
        {
            **base,
            "sampling_params": {**base["sampling_params"], "stop_token_ids": [first], "min_new_tokens": 3},
        },
    ).json()
    assert held["meta_info"]["completion_tokens"] >= 3 and first not in held["output_ids"][:3]


def test_repetition_penalty_changes_the_answer_and_is_bounded(server):
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/generate", {"text": WORDS, "sampling_params": sp}).json()["output_ids"]
    assert len(set(plain)) < len(plain), "the greedy answer has no repeats to penalise"
    sp["repetition_penalty"] = 10
    penalised = post(server, "/generate", {"text": WORDS, "sampling_params": sp}).json()["output_ids"]
    assert penalised != plain
    assert_error(
        post(server, "/v1/chat/completions", chat_body(repetition_penalty=0)), 400, "repetition_penalty"
    )


def test_pick_applies_repetition_penalty_min_tokens_ban_and_min_p():
    import torch

    from needlescope.serve.sampling import make_sampling, pick

    def params(**kw):
        return make_sampling(3, context_length=64, vocab_size=4, cap=8, max_tokens=2, **kw)

    logits = torch.tensor([3.0, 2.0, 0.5, -1.0])
    seen = torch.tensor([0])
    assert pick(logits, params(temperature=0), seen, (), None) == 0
    assert pick(logits, params(temperature=0, repetition_penalty=2.0), seen, (), None) == 1
    assert pick(logits, params(temperature=0), seen, (0,), None) == 1
    g = torch.Generator().manual_seed(0)
    draws = {pick(logits, params(temperature=1.0, min_p=0.3), seen, (), g) for _ in range(50)}
    assert draws == {0, 1}  # tokens under 0.3 x the top probability are never drawn


# ---- items 11, 12, 13 -----------------------------------------------------------------------


def test_completions_accept_a_one_element_list_of_token_lists(client, server):
    ids = post(server, "/tokenize", {"prompt": WORDS}).json()["tokens"]
    by_lists = client.completions.create(model=NAME, prompt=[ids], max_tokens=3, temperature=0)
    by_text = client.completions.create(model=NAME, prompt=WORDS, max_tokens=3, temperature=0)
    assert by_lists.choices[0].text == by_text.choices[0].text
    assert by_lists.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=3)
    assert "batched prompts" in e.value.message


def test_models_retrieve(client):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_a_special_token_renders_the_same_chosen_and_as_an_alternative(client, server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    eos = info["eos_token"]
    eos_id = post(server, "/tokenize", {"prompt": eos, "add_special_tokens": False}).json()["tokens"][0]
    r = client.chat.completions.create(
        model=NAME,
        messages=MSG,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        logit_bias={str(eos_id): 100},
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == [eos, eos] and r.choices[0].message.content == ""
    for t in content:
        assert all(alt.token for alt in t.top_logprobs), "an alternative rendered as an empty string"
    # the alternatives list renders the same id the same way: score the EOS as a prompt token
    echo = client.completions.create(model=NAME, prompt=[[5, eos_id]], max_tokens=0, echo=True, logprobs=1)
    assert echo.choices[0].logprobs.tokens[-1] == eos


# ---- item 26 (server side) -------------------------------------------------------------------


def test_server_info_publishes_the_trained_value_length(server):
    from pathlib import Path

    import needlescope.organism as organism
    from needlescope.dsa.checkpoint import recorded_value_digits

    assert (
        httpx.get(server.url + "/get_server_info").json()["trained_value_digits"] is None
    )  # no training.json
    shipped = Path(organism.__file__).parent / "weights"
    assert recorded_value_digits(shipped) == 3  # the organism's recipe trains on 3-digit values


# ---- item 15: API key, paths ------------------------------------------------------------------

KEY = "sk-test-needlescope-0123"


@pytest.fixture(scope="module")
def keyed(ckpt):
    import os

    os.environ["NEEDLESCOPE_API_KEY"] = KEY  # the environment form; the child inherits it
    try:
        args = ["--model", str(ckpt), "--port", "0", "--served-model-name", NAME, "--expose-paths"]
        srv = ServerProcess(args)
        with srv:
            os.environ.pop("NEEDLESCOPE_API_KEY")
            yield srv
    finally:
        os.environ.pop("NEEDLESCOPE_API_KEY", None)


def test_an_api_key_guards_every_route_but_health_and_is_never_echoed(keyed, ckpt):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/health").status_code == 200
    for path in ("/v1/models", "/get_server_info", "/metrics", "/tokenizer_info"):
        err = assert_error(httpx.get(keyed.url + path), 401, None)
        assert err["code"] == "invalid_api_key"
        assert httpx.get(keyed.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(keyed.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0) as c:
        assert c.chat.completions.create(model=NAME, messages=MSG, max_tokens=2).usage.completion_tokens >= 1
    info = httpx.get(keyed.url + "/get_server_info", headers=auth).json()
    assert info["auth"] is True and info["args"]["api_key"] is True
    assert KEY not in json.dumps(info) and KEY not in keyed.stderr
    # --expose-paths shows the model directory
    assert info["model_path"] == str(ckpt.resolve()) and info["args"]["model"] == str(ckpt)
    assert httpx.get(keyed.url + "/v1/models", headers=auth).json()["data"][0]["root"] == str(ckpt.resolve())


def test_no_absolute_paths_without_expose_paths(server, ckpt):
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["model_path"] is None and str(ckpt) not in json.dumps(info)
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["root"] == NAME


def test_a_non_loopback_bind_without_a_key_warns(tmp_path):
    import subprocess

    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import SERVE_ARGV

    assert ServeConfig(host="0.0.0.0").exposed_without_key
    assert not ServeConfig(host="0.0.0.0", api_key="k").exposed_without_key
    assert not ServeConfig().exposed_without_key
    # A missing model stops the server after the warning, so nothing ever binds 0.0.0.0 here.
    argv = [*SERVE_ARGV, "--model", str(tmp_path / "missing"), "--host", "0.0.0.0", "--port", "0"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "without an API key" in res.stderr


def test_a_live_investigation_and_a_capture_reach_a_keyed_server(keyed, tmp_path, run_cli):
    """A server started with --api-key answered every investigate/capture request 401: they had
    no way to send a key ('investigate init --live' wrote a ledger from nothing it had read)."""
    import asyncio

    from needlescope.errors import ProtocolViolation
    from needlescope.investigate.ledger.ledger import Question
    from needlescope.investigate.measure.questions import QuestionContext, answer
    from needlescope.targets.sglang import SGLangTarget

    async def info(key):
        async with SGLangTarget(keyed.url, timeout=60, api_key=key) as target:
            return await target.server_info()

    assert asyncio.run(info(KEY))["auth"] is True
    with pytest.raises(ProtocolViolation, match="401"):
        asyncio.run(info(None))
    code, _, stderr = run_cli("investigate", "init", str(tmp_path / "no-key"), "--live", keyed.url)
    assert code == 2 and "needs an API key; pass --api-key" in stderr, stderr
    code, _, stderr = run_cli(
        "investigate", "init", str(tmp_path / "inv"), "--live", keyed.url, "--api-key", KEY
    )
    assert code == 0, stderr
    ledger = (tmp_path / "inv" / "investigation.toml").read_text()
    assert KEY not in ledger and f'endpoint = "{keyed.url}"' in ledger
    q = Question(type="server_info", params={"field": "auth"})
    ctx = QuestionContext(base=tmp_path, checkpoint=None, endpoint=keyed.url, api_key=KEY)
    assert answer(q, ctx).value == "true" and KEY not in repr(ctx)
