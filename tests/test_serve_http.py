"""``needlescope serve`` over real HTTP: a real CLI process on loopback, the official openai client as caller.

The model is a small random organism-shaped DeepSeek-V4 (``save_random``), so answers are
gibberish; the tests check the contract (token counts, finish reasons, streaming shape, errors)
and agreement with the same model run in-process.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from needlescope.dsa.checkpoint import load_bundle
from needlescope.dsa.emulate import IndexerCapture, emulate
from needlescope.serve.launch import ServerProcess
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import TINY_SERVE, save_random

SERVED_TOPK = 4  # below the checkpoint's 8, so the numerics in force are visible in the payload
NAME = "tiny"
WORDS = "the river ran past the old mill and the baker sold bread to every child in the town"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("ckpt"), seed=1, **TINY_SERVE)


@pytest.fixture(scope="module")
def server(ckpt):
    args = [
        "--model",
        str(ckpt),
        "--port",
        "0",
        "--served-model-name",
        NAME,
        "--index-topk",
        str(SERVED_TOPK),
    ]
    args += ["--max-running-requests", "4", "--max-queued-requests", "64"]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def chat(client, content=WORDS, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}], **kw)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- OpenAI surface ------------------------------------------------------------------------


def test_models_lists_the_served_name(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME]
    info = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert info["max_model_len"] == TINY_SERVE["max_position_embeddings"]


def test_chat_completion_contract(client, server):
    r = chat(client)
    choice = r.choices[0]
    assert r.model == NAME and r.object == "chat.completion"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    count = httpx.post(
        server.url + "/tokenize", json={"model": NAME, "messages": [{"role": "user", "content": WORDS}]}
    )
    assert u.prompt_tokens == count.json()["count"]
    assert u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0


def test_greedy_is_deterministic(client):
    a, b = chat(client), chat(client)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_max_tokens_is_honoured(client):
    n = 5
    r = chat(client, max_tokens=n, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    r = chat(client, max_completion_tokens=n - 2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == n - 2


def test_stop_string_cuts_the_answer(client):
    full = chat(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(full) > 6, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    r = chat(client, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_stop_string_while_streaming_holds_back_partial_matches(client):
    full = chat(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    ref = chat(client, max_tokens=16, stop=stop, extra_body={"ignore_eos": True}).choices[0].message.content
    chunks = list(chat(client, max_tokens=16, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == ref == full[: full.index(stop)]
    assert all(stop not in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_reproduces(client):
    kw = dict(temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    a = chat(client, seed=123, **kw).choices[0].message.content
    b = chat(client, seed=123, **kw).choices[0].message.content
    assert a == b
    others = {chat(client, seed=s, **kw).choices[0].message.content for s in (124, 125, 126)}
    assert others - {a}, "different seeds never changed a sampled answer"


def test_chat_logprobs(client):
    k = 3
    r = chat(client, logprobs=True, top_logprobs=k, max_tokens=6, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == k
        # greedy: the chosen token is the most likely one
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )


def test_chat_stream_matches_non_stream(client):
    ref = chat(client, max_tokens=10)
    chunks = list(chat(client, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == ref.choices[0].message.content
    assert finishes == [ref.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_and_stream(client):
    kw = dict(model=NAME, prompt=WORDS, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    ref = client.completions.create(**kw)
    assert ref.object == "text_completion" and ref.usage.completion_tokens == 7
    assert ref.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    assert chunks[-1].usage.total_tokens == ref.usage.total_tokens


def test_completion_logprobs_and_token_prompt(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": WORDS}).json()["tokens"]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    by_text = client.completions.create(model=NAME, prompt=WORDS, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == by_ids.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


# ---- tokenizer endpoints -------------------------------------------------------------------


def test_tokenize_forms_agree_with_chat_usage(client, server, ckpt):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": WORDS}]
    usage = chat(client).usage.prompt_tokens
    by_messages = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": messages}).json()
    rendered = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    by_prompt = httpx.post(
        server.url + "/tokenize", json={"model": NAME, "prompt": rendered, "add_special_tokens": False}
    ).json()
    assert by_messages["count"] == by_prompt["count"] == usage == len(by_messages["tokens"])
    assert by_messages["tokens"] == by_prompt["tokens"]
    v1 = httpx.post(server.url + "/v1/tokenize", json={"model": NAME, "messages": messages}).json()
    assert v1["count"] == usage
    # vLLM's /detokenize keeps special tokens unless asked: the text tokenises back to the same ids.
    back = httpx.post(server.url + "/detokenize", json={"model": NAME, "tokens": by_prompt["tokens"]}).json()
    again = httpx.post(
        server.url + "/tokenize", json={"model": NAME, "prompt": back["prompt"], "add_special_tokens": False}
    ).json()
    assert again["tokens"] == by_prompt["tokens"]
    plain = httpx.post(
        server.url + "/detokenize",
        json={"model": NAME, "tokens": by_prompt["tokens"], "skip_special_tokens": True},
    ).json()
    assert plain["prompt"].split()[-1] == WORDS.split()[-1]


# ---- info, health, metrics -----------------------------------------------------------------


def test_server_info_reports_numerics_and_args(server):
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["model"] == NAME
    assert info["index_k"] == "fp32" and info["index_q"] == "fp32"
    assert info["index_topk"] == SERVED_TOPK and info["checkpoint_index_topk"] == TINY_SERVE["index_topk"]
    assert info["max_queued_requests"] == 64 and info["max_running_requests"] == 4
    assert info["num_indexer_layers"] == len(info["csa_layers"]) >= 1
    assert isinstance(info["needlescope_version"], str) and info["needlescope_version"]
    assert info["args"]["port"] == 0 and info["args"]["index_topk"] == SERVED_TOPK
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_count_requests_and_tokens(client, server):
    before = metric_samples(server.url)
    r = chat(client, max_tokens=4, extra_body={"ignore_eos": True})
    after = metric_samples(server.url)
    key = ("needlescope_serve_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    assert after[key] - before.get(key, 0) == 1
    gen = ("needlescope_serve_generation_tokens_total", ())
    prompt = ("needlescope_serve_prompt_tokens_total", ())
    assert after[gen] - before[gen] == r.usage.completion_tokens
    assert after[prompt] - before[prompt] == r.usage.prompt_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        k = (f"needlescope_serve_{h}_count", ())
        assert after[k] - before[k] == 1
    assert ("needlescope_serve_queue_depth", ()) in after and (
        "needlescope_serve_running_requests",
        (),
    ) in after


# ---- SGLang /generate with the indexer top-k capture ---------------------------------------


def test_generate_indexer_topk_matches_in_process_capture(server, ckpt):
    n_new = 6
    body = {
        "text": WORDS,
        "sampling_params": {"max_new_tokens": n_new, "temperature": 0},
        "return_indexer_topk": True,
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    meta = out["meta_info"]
    P, C = meta["prompt_tokens"], meta["completion_tokens"]
    raw = np.frombuffer(base64.b64decode(meta["indexer_topk"]), dtype="<i4")

    model, tok, _ = load_bundle(ckpt)
    ids = torch.tensor([tok(WORDS)["input_ids"]])
    cap = IndexerCapture()
    with emulate(model, Setting(index_topk=SERVED_TOPK), capture=cap) as layers, torch.inference_mode():
        gen = model.generate(ids, max_new_tokens=n_new, do_sample=False)
    assert P == ids.shape[1]
    assert out["output_ids"] == gen[0, P:].tolist()
    expected = torch.stack([cap.rows(layer, SERVED_TOPK)[1] for layer in layers], dim=1)
    assert expected.shape == (P + C - 1, len(layers), SERVED_TOPK)
    assert meta["indexer_topk_shape"] == list(expected.shape)
    np.testing.assert_array_equal(raw.reshape(expected.shape), expected.numpy())
    assert (raw == -1).any() and (raw >= 0).any()  # early rows see fewer entries than k: -1 padding


def test_generate_plain(server):
    out = httpx.post(
        server.url + "/generate", json={"text": WORDS, "sampling_params": {"max_new_tokens": 3}}
    ).json()
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) <= 3
    assert "indexer_topk" not in out["meta_info"]


# ---- bad input -----------------------------------------------------------------------------


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(client, server):
    too_long = " ".join([WORDS] * 40)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=too_long, max_tokens=4)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=TINY_SERVE["max_position_embeddings"])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    for payload in (b"{not json", b'{"model": "tiny", "messages": "hello"}', b"[]"):
        r = httpx.post(
            server.url + "/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/generate", json={"sampling_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    r = httpx.get(server.url + "/no/such/route")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.url + "/health").status_code == 200
    assert chat(client, max_tokens=2).usage.completion_tokens >= 1


# ---- the probe, end to end -----------------------------------------------------------------


def test_probe_cli_against_the_server(server, tmp_path):
    lengths = (120, 240)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "needlescope.cli.main",
            "probe",
            "--base-url",
            server.url + "/v1",
            "--model",
            NAME,
        ]
        + [
            "--lengths",
            ",".join(map(str, lengths)),
            "--depths",
            "0,100",
            "--trials",
            "1",
            "--max-tokens",
            "8",
        ]
        + ["--out", str(tmp_path), "--concurrency", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stderr + res.stdout
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(lengths)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["counted_length"] == row["length"] == row["prompt_tokens"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == NAME


def test_generate_returns_only_the_indexer_topk_rows_asked_for(server):
    body = {
        "text": WORDS,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_indexer_topk": True,
    }
    full = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    rows = np.frombuffer(base64.b64decode(full["indexer_topk"]), "<i4").reshape(full["indexer_topk_shape"])
    last = httpx.post(server.url + "/generate", json={**body, "indexer_topk_last": 2}, timeout=60).json()[
        "meta_info"
    ]
    assert last["indexer_topk_shape"] == [2, *full["indexer_topk_shape"][1:]]
    assert last["indexer_topk_positions"] == [len(rows) - 2, len(rows) - 1]
    got = np.frombuffer(base64.b64decode(last["indexer_topk"]), "<i4").reshape(last["indexer_topk_shape"])
    np.testing.assert_array_equal(got, rows[-2:])
    picked = httpx.post(
        server.url + "/generate", json={**body, "indexer_topk_positions": [0, 5]}, timeout=60
    ).json()
    got = np.frombuffer(base64.b64decode(picked["meta_info"]["indexer_topk"]), "<i4")
    np.testing.assert_array_equal(got.reshape(2, *rows.shape[1:]), rows[[0, 5]])
    r = httpx.post(server.url + "/generate", json={**body, "indexer_topk_positions": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "indexer_topk_positions"


def test_echo_scores_the_prompt_as_decoding_scored_the_answer(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": WORDS}).json()["tokens"]
    gen = client.completions.create(
        model=NAME, prompt=[ids], max_tokens=4, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    out_ids = httpx.post(
        server.url + "/tokenize", json={"prompt": gen.choices[0].text, "add_special_tokens": False}
    ).json()["tokens"]
    whole = ids + out_ids
    echo = client.completions.create(model=NAME, prompt=[whole], max_tokens=0, echo=True, logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.usage.completion_tokens == 0 and len(lp.token_logprobs) == len(whole)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    if out_ids and len(out_ids) == len(gen.choices[0].logprobs.token_logprobs):
        # teacher-forced scores of the answer = the scores it was decoded with (cache vs one pass: ~1e-2)
        assert lp.token_logprobs[len(ids) :] == pytest.approx(
            gen.choices[0].logprobs.token_logprobs, abs=2e-2
        )
    vllm = httpx.post(
        server.url + "/v1/completions",
        json={"model": NAME, "prompt": whole, "max_tokens": 1, "prompt_logprobs": 1},
    ).json()["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(whole)
    for t, entry in zip(whole[1:], vllm[1:]):
        assert str(t) in entry and entry[str(t)]["rank"] >= 1
    assert [e[str(t)]["logprob"] for t, e in zip(whole[1:], vllm[1:])] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-5
    )


def test_tokenizer_info_serves_the_chat_template(server, ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["chat_template"] == tok.chat_template and info["eos_token"] == tok.eos_token
