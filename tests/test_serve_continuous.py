"""Continuous batching and speculative decoding in ``needlescope serve`` on the organism:
exact rollback of a verify pass, greedy token identity with every serving feature on and off
(and all together, up to 4K tokens), usage and /metrics through the openai client, and the
planted serving faults (hidden from /get_server_info, changing what they claim)."""

from __future__ import annotations

import asyncio
import copy
import json
import urllib.request

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits  # noqa: E402
from needlescope.serve.config import ServeConfig  # noqa: E402
from needlescope.serve.engine import Engine  # noqa: E402
from needlescope.serve.requests import GenRequest  # noqa: E402
from needlescope.serve.sampling import SamplingParams  # noqa: E402
from needlescope.serve.speculative import StateLog, propose, rollback  # noqa: E402
from needlescope.setting import PatchRef, Setting, fault_names, serving_fault_names  # noqa: E402

SERVING_FAULTS = ["batch_variant_scores", "chunk_carry", "prefix_stale_ring", "spec_verify_rows"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def organism():
    model, tokenizer, path = load_bundle("organism")
    return model, tokenizer, path


def _prompts(organism, lengths: tuple[int, ...], depths=(20.0, 80.0), seed: int = 5) -> list[list[int]]:
    """Token ids of multiturn needle cases (answers copied from the prompt: drafts get accepted)."""
    _, tok, path = organism

    def ids(messages):
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]

    spec = CaseSpec(
        kind="multiturn",
        lengths=lengths,
        depths=depths,
        trials=1,
        seed=seed,
        value_digits=trained_value_digits(path),
    )
    return [ids(c.messages) for c in build_cases(spec, lambda m: len(ids(m)))]


def _run(
    cfg: ServeConfig, waves: list[list[list[int]]], params=GREEDY, gap_s: float = 0.05, wait: bool = False
) -> list:
    """Each wave's prompts submitted together, ``gap_s`` after the previous wave (so later
    waves join a running batch), or once it is answered (``wait``); the Final of every
    request, in submission order."""
    engine = Engine(cfg)

    async def final(req):
        return await asyncio.wait_for(req.last_event(), timeout=300)

    async def go():
        engine.start()
        reqs, out = [], []
        for wave in waves:
            sent = [GenRequest(ids, params) for ids in wave]
            for r in sent:
                engine.submit(r)
            reqs += sent
            if wait:
                out += [await final(r) for r in sent]
            else:
                await asyncio.sleep(gap_s)
        return out if wait else [await final(r) for r in reqs]

    try:
        return asyncio.run(go())
    finally:
        engine.close()


def test_propose_copies_what_followed_the_latest_ngram():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]
    assert propose([4, 5, 6, 4, 5], 4) == [6, 4, 5]  # the 2-gram (4, 5) at 0
    assert propose([1, 2, 3], 2) == [] and propose([1, 1], 0) == []
    assert propose([8, 1, 8], 5) == [1, 8]  # ends where the tokens end


def _caches_equal(a: DynamicCache, b: DynamicCache, atol: float) -> None:
    for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        va, vb = vars(la), vars(lb)
        assert va.keys() == vb.keys(), i
        for key, x in va.items():
            y = vb[key]
            for name in x if isinstance(x, dict) else [None]:
                u, v = (x[name], y[name]) if name is not None else (x, y)
                if isinstance(u, torch.Tensor):
                    assert u.shape == v.shape, (i, key, name)
                    torch.testing.assert_close(u, v, atol=atol, rtol=0, msg=f"layer {i} {key} {name}")
                elif not callable(u):
                    assert u == v, (i, key, name)


@torch.inference_mode()
def test_rollback_leaves_the_state_a_forward_of_the_kept_tokens_leaves(organism):
    """A 9-token verify pass from position 124 (crossing CSA windows and the first 128-token
    HCA window), rolled back to each kept length, equals the prefilled state + a forward of just
    those tokens: the ring, buffers, overlaps, compressed entries and counts of every layer."""
    model, P = organism[0], 124
    ids = torch.randint(10, 3000, (1, P + 9), generator=torch.Generator().manual_seed(P))
    pos = torch.arange(P + 9).unsqueeze(0)
    prefilled = DynamicCache(config=model.config)
    model(input_ids=ids[:, :P], position_ids=pos[:, :P], past_key_values=prefilled)

    for kept in (1, 3, 4, 6, 9):
        cache = copy.deepcopy(prefilled)
        with StateLog(cache) as state:
            model(input_ids=ids[:, P:], position_ids=pos[:, P:], past_key_values=cache)
        rollback(state, kept)
        want = copy.deepcopy(prefilled)
        span = slice(P, P + kept)
        model(input_ids=ids[:, span], position_ids=pos[:, span], past_key_values=want)
        _caches_equal(cache, want, atol=1e-5)


@pytest.fixture(scope="module")
def short_prompts(organism):
    return _prompts(organism, (300, 640))


@pytest.fixture(scope="module")
def static_answers(short_prompts):
    return _run(ServeConfig(), [short_prompts[:2], short_prompts[2:]])


@pytest.mark.parametrize("draft", range(1, 9))
def test_speculative_greedy_is_token_identical_at_every_draft_depth(short_prompts, static_answers, draft):
    cfg = ServeConfig(continuous_batching=True, speculative_num_draft_tokens=draft)
    got = _run(cfg, [short_prompts[:2], short_prompts[2:]])
    assert [f.output_ids for f in got] == [f.output_ids for f in static_answers]
    spec = [f.speculative for f in got]
    assert all(s.draft_tokens == draft for s in spec)
    assert sum(s.proposed for s in spec) > 0 and sum(s.accepted for s in spec) > 0  # drafts were verified
    assert all(s.proposed <= draft * s.verify_steps for s in spec)


def test_continuous_batching_joins_mid_flight_and_answers_the_same(short_prompts, static_answers):
    """The second wave joins while the first decodes; same tokens as static batches."""
    got = _run(ServeConfig(continuous_batching=True), [short_prompts[:2], short_prompts[2:]])
    assert [f.output_ids for f in got] == [f.output_ids for f in static_answers]
    first, late = got[0].batch, got[-1].batch
    assert first.mode == "continuous" and not first.joined_mid_flight and first.joined_beside >= 1
    assert late.joined_mid_flight and late.max_running >= 2
    assert all(not f.batch.joined_mid_flight for f in static_answers)
    assert max(f.batch.max_running for f in static_answers) <= 2  # never more than one wave at once


def test_every_feature_together_is_token_identical_up_to_4k(organism, short_prompts):
    """Continuous batching, drafts of 5, a warm prefix cache and 1000-token prefill chunks at
    once against static one-pass batches: one 4K case and the short ones, each sent twice
    (the second time it continues the kept prefix)."""
    prompts = _prompts(organism, (4096,), depths=(50.0,), seed=9) + short_prompts[:2]
    plain = _run(ServeConfig(), [prompts])
    cfg = ServeConfig(
        continuous_batching=True, speculative_num_draft_tokens=5, prefix_cache_mib=64, prefill_chunk=1000
    )
    every = _run(cfg, [prompts, prompts], wait=True)
    assert [f.output_ids for f in every] == [f.output_ids for f in plain + plain]
    assert len(prompts[0]) > 4000
    assert all(f.cached_tokens == 0 for f in every[:3]) and all(f.cached_tokens > 0 for f in every[3:])


def test_serving_faults_are_named_resolved_and_never_shown():
    assert serving_fault_names() == SERVING_FAULTS
    assert set(SERVING_FAULTS) <= set(fault_names())
    for name in SERVING_FAULTS:
        ref = PatchRef.resolve(f"fault:{name}")
        assert (
            ref.is_serving_fault
            and ref.path.parent.name == "faults"
            and ref.path.parent.parent.name == "serve"
        )
        shown = ServeConfig(setting=Setting(patch=ref))
        assert shown.patch_shown is None and shown.to_dict()["patch"] is None
    assert ServeConfig(setting=Setting(patch=PatchRef.resolve("fault:indexer_page_table"))).patch_shown


def _with_fault(name: str, **cfg) -> ServeConfig:
    return ServeConfig(setting=Setting(patch=PatchRef.resolve(f"fault:{name}")), **cfg)


def test_chunk_carry_fault_changes_chunked_prefill_only(short_prompts, static_answers):
    """Dropping the carried compressor state at 100-token chunk boundaries changes answers; the
    same fault without chunking changes nothing (it lives at the boundary)."""
    waves = [short_prompts[:2], short_prompts[2:]]
    chunked = _run(_with_fault("chunk_carry", prefill_chunk=100), waves)
    unchunked = _run(_with_fault("chunk_carry"), waves)
    assert [f.output_ids for f in unchunked] == [f.output_ids for f in static_answers]
    assert [f.output_ids for f in chunked] != [f.output_ids for f in static_answers]


def test_spec_verify_rows_fault_is_silent_below_its_rows_and_undone(short_prompts, static_answers):
    from needlescope.serve.faults.spec_verify_rows import ROWS

    waves = [short_prompts[:2], short_prompts[2:]]
    shallow = _run(_with_fault("spec_verify_rows", speculative_num_draft_tokens=ROWS - 1), waves)
    assert [f.output_ids for f in shallow] == [f.output_ids for f in static_answers]
    healthy = Engine.__dict__["_commit"]
    engine = Engine(_with_fault("spec_verify_rows", speculative_num_draft_tokens=8))
    assert Engine.__dict__["_commit"] is not healthy
    engine.close()
    assert Engine.__dict__["_commit"] is healthy


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_usage_and_metrics_over_http_with_the_openai_client(organism_server):
    """A real server with drafts of 4: the openai client reads usage's extension objects, and
    /metrics and /get_server_info tell the batching and the acceptance rate."""
    openai = pytest.importorskip("openai")
    url = organism_server("--continuous-batching", "--speculative-num-draft-tokens", "4")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    answer = client.completions.create(
        model="organism", prompt=list(range(40, 90)) * 3, max_tokens=8, temperature=0
    )
    usage = answer.usage.model_dump()
    batch, spec = usage["needlescope_batch"], usage["needlescope_speculative"]
    assert batch["mode"] == "continuous" and batch["prefill_batch"] == 1 and batch["max_running"] >= 1
    assert spec["draft_tokens"] == 4 and spec["proposed"] >= spec["accepted"]
    own = client.completions.create(
        model="organism",
        prompt=list(range(40, 90)) * 3,
        max_tokens=4,
        temperature=0,
        extra_body={"speculative_num_draft_tokens": 2},
    )
    assert own.usage.model_dump()["needlescope_speculative"]["draft_tokens"] == 2
    with pytest.raises(openai.BadRequestError, match="speculative_num_draft_tokens"):
        client.completions.create(
            model="organism", prompt=[5, 6], max_tokens=2, extra_body={"speculative_num_draft_tokens": 17}
        )
    native = _post(
        url + "/generate", {"input_ids": list(range(40, 90)) * 3, "sampling_params": {"max_new_tokens": 4}}
    )
    assert native["meta_info"]["needlescope_speculative"]["draft_tokens"] == 4
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    for name in ("decode_batch_size_count", "joined_mid_flight_total", "speculative_acceptance_rate"):
        assert f"needlescope_serve_{name}" in metrics
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
        info = json.load(r)
    assert info["speculative_num_draft_tokens"] == 4 and info["args"]["continuous_batching"] is True
    assert info["batching"].startswith("continuous")


def test_prefix_stale_ring_fault_changes_a_warm_answer_and_nothing_cold():
    """Two random 260-token prompts cold, then the first again warm: healthy, the warm answer
    equals the cold one bit for bit; with the fault it ends 4 tokens past the 256-token cut on
    the other prompt's ring, and its logprobs move."""
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(10, 3000, (260,), generator=gen).tolist() for _ in range(2))
    params = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=0)
    waves = [[a], [b], [a]]

    def logprobs(cfg):
        finals = _run(cfg, waves, params, wait=True)
        assert [f.cached_tokens for f in finals] == [0, 0, 256]
        return [[t.logprob for t in f.tokens] for f in finals]

    healthy = logprobs(ServeConfig(prefix_cache_mib=16))
    faulty = logprobs(_with_fault("prefix_stale_ring", prefix_cache_mib=16))
    assert healthy[2] == healthy[0] and faulty[:2] == healthy[:2]
    assert max(abs(x - y) for x, y in zip(faulty[2], healthy[2])) > 1e-4


def test_batch_variant_fault_leaves_a_request_alone_untouched(short_prompts):
    """At fp8 top-64 (the indexer drops entries at these lengths), requests sent one at a time
    answer as on a healthy server: the fault needs batch mates."""
    numerics = {"index_k": "fp8_e4m3", "index_topk": 64}
    waves = [[p] for p in short_prompts]
    healthy = _run(ServeConfig(setting=Setting(**numerics)), waves, wait=True)
    patch = PatchRef.resolve("fault:batch_variant_scores")
    alone = _run(ServeConfig(setting=Setting(**numerics, patch=patch)), waves, wait=True)
    assert [f.output_ids for f in alone] == [f.output_ids for f in healthy]
    assert all(f.batch.max_running == 1 for f in alone)
