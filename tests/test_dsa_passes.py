"""Chunked prefill and token-by-token decode through DeepSeek-V4's KV cache, on the organism.

Equality is checked in float64: a one-pass forward reduces over T keys (softmax sums and the
probability-value product run over every masked position) where a chunked one reduces over
``window + entries so far``, so float32 results differ in the last bits and a near-tie in the
indexer scores can swap two entries; in float64 those differences are far below the float32
rounding the model's own fp32 casts (norms, indexer scores) apply, and the runs agree exactly.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits  # noqa: E402
from needlescope.dsa.emulate import IndexerCapture, emulate  # noqa: E402
from needlescope.dsa.passes import decode, greedy, prefill  # noqa: E402
from needlescope.dsa.prompt import render_prompt  # noqa: E402
from needlescope.dsa.rankdump import rank_dump, validate_rankdump  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.investigate.ledger.plan import Config  # noqa: E402
from needlescope.investigate.measure.records import case_record, final_logits, measure_cases  # noqa: E402
from needlescope.setting import Setting  # noqa: E402

# Below the organism's 500 entries at 2K, so the top-k is a real selection.
SETTING = Setting(index_topk=128)


@pytest.fixture(scope="module")
def organism32():
    return load_bundle("organism")


@pytest.fixture(scope="module")
def organism64():
    model, tok, path = load_bundle("organism")
    model = model.double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model, tok, path


@pytest.fixture(scope="module")
def dumps_2k(organism64):
    """The 2K rank dump with greedy answer, one pass and in 512-token chunks (four chunks, 500
    entries for a top-128), with their captures."""
    model, tok, path = organism64

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    spec = CaseSpec("single", (2000,), (30.0,), 1, 11, value_digits=trained_value_digits(path))
    case = build_cases(spec, count)[0]
    out = {"case": case}
    for chunk in (None, 512):
        capture = IndexerCapture(keep_scores=True)
        with torch.no_grad(), emulate(model, SETTING, capture=capture):
            dump = rank_dump(
                model,
                tok,
                case.messages,
                needle=case.needle,
                setting=SETTING,
                max_new_tokens=4,
                capture=capture,
                chunk=chunk,
                expected=case.expected,
            )
        out[chunk] = (dump, capture)
    return out


def test_chunked_rank_dump_equals_one_pass_token_for_token_and_rank_for_rank(dumps_2k):
    one, chunked = dumps_2k[None][0], dumps_2k[512][0]
    validate_rankdump(chunked)
    assert one["prompt_tokens"] > 1900
    assert chunked["generated_tokens"] == one["generated_tokens"] and one["generated_tokens"]
    assert chunked["layers"] == one["layers"]  # every rank, tie count, score, margin and selection
    assert any(p["best_rank"] > 1 for layer in one["layers"] for p in layer["positions"])


def test_measure_records_of_a_chunked_run_equal_the_one_pass_records(dumps_2k, organism64):
    """``investigate.measure.records`` builds its record from the generated tokens and the capture; both
    come out of the 2K runs identical, at the first answer token and at a decode step."""
    _, tok, _ = organism64
    case = dumps_2k["case"]
    prompt = render_prompt(tok, case.messages)
    tokens, k = dumps_2k[None][0]["generated_tokens"], SETTING.index_topk
    answer = tok.decode([t for t in tokens if t != tok.eos_token_id], skip_special_tokens=True).strip()
    # the same answer scored against a value differing in its last digit: analysed at a decode step
    wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
    for expected in (case.expected, (wrong,)):
        c = dataclasses.replace(case, expected=expected)
        one, chunked = (
            case_record(
                c, prompt, dump["generated_tokens"], tok, cap, cap.layers(), 0, k, dump["compress_ratio"]
            )
            for dump, cap in (dumps_2k[None], dumps_2k[512])
        )
        assert chunked == one
        assert one["layers"] and all(ly["visible"] > k for ly in one["layers"])
    assert one["analysed_token"] > 0 and one["layers"][0]["query_pos"] > one["prompt_tokens"] - 1


def test_measure_cases_and_final_logits_in_chunks_equal_one_pass(organism64):
    model, tok, path = organism64

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    cases = build_cases(
        CaseSpec("multiturn", (300,), (20.0, 80.0), 1, 3, value_digits=trained_value_digits(path)), count
    )
    cfg = Config(Setting(index_topk=16))
    with torch.no_grad():
        one = measure_cases(model, tok, cases, cfg, max_new_tokens=4)
        chunked = measure_cases(model, tok, cases, cfg, max_new_tokens=4, chunk=64)
        logits = [final_logits(model, tok, cases[0].messages, cfg, chunk=c) for c in (None, 50)]
    assert chunked == one and len(one) == 2 and all(r["layers"] for r in one)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-9)


def test_chunked_capture_has_the_one_pass_topk_rows_and_scores(dumps_2k):
    one, chunked = dumps_2k[None][1], dumps_2k[512][1]
    assert len(chunked.calls) > len(one.calls)  # 4 chunks and the decode steps, per layer
    for layer in one.layers():
        pos1, rows1 = one.rows(layer, width=SETTING.index_topk)
        pos2, rows2 = chunked.rows(layer, width=SETTING.index_topk)
        assert torch.equal(pos1, pos2)
        spos1, s1 = one.score_rows(layer)
        spos2, s2 = chunked.score_rows(layer)
        assert torch.equal(spos1, spos2)
        ties = 0
        for t in range(len(s1)):
            visible = (int(spos1[t]) + 1) // 4
            assert torch.equal(s1[t][:visible], s2[t][:visible])
            a, b = set(rows1[t].tolist()) - {-1}, set(rows2[t].tolist()) - {-1}
            assert len(a) == len(b)
            if a != b:  # only entries scoring exactly the cutoff may be swapped (topk's tie-break)
                cutoff = s1[t][sorted(a)].min()
                assert bool((s1[t][sorted(a ^ b)] == cutoff).all())
                ties += 1
        assert ties < len(s1) // 10


def test_decode_from_a_position_equals_teacher_forced_logits(organism32):
    model, _, _ = organism32
    torch.manual_seed(5)
    ids = torch.randint(3, 3000, (1, 1040))
    p = 1019  # decoding crosses the 1024 boundary: a CSA window and an HCA window close there
    with torch.no_grad(), emulate(model, Setting(index_topk=16)):
        teacher = prefill(model, ids, logits_at=range(p, 1040))
        start = prefill(model, ids[:, :p], chunk=333, keep_cache=True)  # chunks not aligned to any window
        stepped = decode(model, ids[:, p:], start.cache)
    assert stepped.positions == teacher.positions
    torch.testing.assert_close(stepped.logits, teacher.logits, rtol=0, atol=1e-4)
    # A dropped indexer block bias at decode would let every query see every entry: not so.
    with torch.no_grad(), emulate(model, Setting(index_topk=2048)):
        wide = prefill(model, ids, logits_at=range(p, 1040))
    assert (wide.logits - teacher.logits).abs().max() > 1e-2


def test_greedy_equals_generate_and_only_requested_logits_come_back(organism32):
    model, tok, _ = organism32
    ids = torch.randint(3, 3000, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        got = greedy(model, ids, 6, eos_token_id=None, chunk=64)
        run = prefill(model, ids, chunk=100, logits_at=[299, 5, 150, 5])
        whole = model(ids, use_cache=False).logits.float()
    assert got == want[0, 300:].tolist()
    assert run.logits.shape == (1, 4, model.config.vocab_size)
    torch.testing.assert_close(run.logits, whole[:, [299, 5, 150, 5]], rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunk", [0, -3, 1.5, True])
def test_a_bad_chunk_is_refused(organism32, chunk):
    model, _, _ = organism32
    with pytest.raises(BadInput, match="chunk must be a positive number"):
        prefill(model, torch.zeros(1, 8, dtype=torch.long), chunk=chunk)


def test_logits_outside_the_run_are_refused(organism32):
    model, _, _ = organism32
    with pytest.raises(BadInput, match="outside the tokens run"):
        prefill(model, torch.zeros(1, 8, dtype=torch.long), chunk=4, logits_at=[8])
