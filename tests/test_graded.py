"""The graded signal end to end: real organism servers, the real probe, store and compare.

One module-scoped set of servers keeps this file to three organism starts (the fault's is
shared with test_compare_organism); every run is tiny (one length, 8 cases). Side A is the
reference numerics at the deployment's top-16 (fp32 keys), so the fp8 comparison isolates key
precision: at the checkpoint's top-2048 every entry up to 8K tokens is selected and index-key
precision cannot move anything (docs/graded.md).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sqlite3
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from scipy.stats import rankdata

from needlescope.run.compare_live import compare_live
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import run_probe
from needlescope.serve.launch import ServerProcess
from needlescope.targets.client import ChatTarget
from needlescope.targets.logprobs import GradedMethod, score_gold

REF = ["--index-topk", "16"]
FAULT = ["--patch", "fault:indexer_page_table", "--index-k", "fp8_e4m3", "--index-topk", "64"]
FP8 = ["--index-k", "fp8_e4m3", "--index-topk", "16"]


@pytest.fixture(scope="module")
def organism(organism_server):
    servers = {
        "ref": ServerProcess(["--model", "organism", "--port", "0", *REF]),
        "fp8": ServerProcess(["--model", "organism", "--port", "0", *FP8]),
    }
    try:
        # Started side by side: each start is mostly the child's own imports and model load. The
        # fault's server is shared with test_compare_organism's deployment (the same flags).
        with ThreadPoolExecutor(len(servers) + 1) as pool:
            fault = pool.submit(organism_server, *FAULT)
            list(pool.map(ServerProcess.start, servers.values()))
            urls = {"fault": fault.result(), **{name: s.url for name, s in servers.items()}}
        yield urls
    finally:
        for s in servers.values():
            s.stop()


def _cfg(url, out, **kw) -> ProbeConfig:
    base = dict(
        base_urls=(url,),
        model="organism",
        kind="multiturn",
        lengths=(384,),  # past ratio x top-64 = 256 tokens, where the page-table fault bites
        depths=(0, 33, 67, 100),
        trials=2,
        value_digits=3,
        concurrency=4,
        out=out,
        graded=True,
        bundles=0,
    )
    return ProbeConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def reference_run(organism, tmp_path_factory):
    """Side A (the reference) probed once, graded; copied into each comparison's folder."""
    out = tmp_path_factory.mktemp("ref") / "a"
    summary = run_probe(_cfg(organism["ref"], out))
    return out, summary


def _compare_with(organism, reference_run, side_b: str, tmp_path) -> dict:
    """compare_live of the reference (its finished run resumed: nothing re-sent) against B."""
    shutil.copytree(reference_run[0], tmp_path / "a")
    cfg_a = _cfg(organism["ref"], tmp_path / "a", resume=True)
    return compare_live(cfg_a, replace(cfg_a, base_urls=(organism[side_b],), resume=False), tmp_path)


def test_reference_run_records_graded_scores_beside_recall(reference_run):
    a_dir, summary = reference_run
    graded = summary["graded"]
    assert graded["method"] == "prompt_logprobs" and graded["scored"] == 8 and graded["errors"] == 0
    (length,) = graded["lengths"]
    assert length["n"] == 8 and length["margin_tokens"] == 24  # 3-digit answers
    assert length["first_rank1"] == 8 and length["margin_min"] > 0  # the reference wins every token
    assert "## Graded signal" in (a_dir / "report.md").read_text()


def test_echo_scores_the_gold_answer_as_prompt_logprobs_do(organism, reference_run):
    a_dir, _ = reference_run
    case = json.loads((a_dir / "results.jsonl").read_text().splitlines()[0])
    with sqlite3.connect(a_dir / "results.sqlite") as db:
        (data,) = db.execute("SELECT data FROM cases WHERE case_id = ?", (case["case_id"],)).fetchone()
    messages = json.loads(data)["messages"]

    async def echo():
        async with ChatTarget(organism["ref"], "organism") as target:
            return await score_gold(
                target, GradedMethod("echo", "/tokenize", "", 5), messages, case["expected"]
            )

    # The run scored this case with vLLM's prompt_logprobs; OpenAI's echo must give the same numbers.
    scored, stored = asyncio.run(echo()), case["graded"]
    assert stored["method"] == "prompt_logprobs" and scored["method"] == "echo"
    assert scored["logprobs"] == pytest.approx(stored["logprobs"], abs=1e-5)
    assert scored["margins"] == pytest.approx(stored["margins"], abs=1e-5)
    assert scored["ranks"] == stored["ranks"]


def test_gold_logprob_is_higher_at_reference_than_with_the_page_table_fault(
    organism, reference_run, tmp_path
):
    result = _compare_with(organism, reference_run, "fault", tmp_path)
    (bucket,) = result["graded"]["buckets"]
    gold = bucket["gold_logprob"]
    assert bucket["n"] == 8
    assert gold["delta_median"] < 0 and gold["p_value"] < 0.05, gold
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    right_on_a = [p for p in pairs if p["a_correct"]]
    lower_on_b = [p for p in right_on_a if p["b_gold_logprob"] < p["a_gold_logprob"]]
    assert len(lower_on_b) > len(right_on_a) / 2
    assert "## Graded signal: margins" in (tmp_path / "report.md").read_text()


def test_fp8_keys_margin_change_is_reported_with_its_direction_or_its_power(
    organism, reference_run, tmp_path
):
    # fp8 keys need not thin this organism's margin (at 384 tokens they widen it by thousandths of
    # a nat; docs/graded.md): the comparison must state whichever it is, checked against the pairs.
    result = _compare_with(organism, reference_run, "fp8", tmp_path)
    graded = result["graded"]
    (bucket,) = graded["buckets"]
    margin = bucket["margin"]
    assert bucket["n"] == 8
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    thinner = sum(p["b_min_margin"] < p["a_min_margin"] for p in pairs)
    wider = sum(p["b_min_margin"] > p["a_min_margin"] for p in pairs)
    assert thinner + wider == margin["n_nonzero"]
    if margin["p_holm"] < 0.05:
        # The direction, computed here from the pairs without the library: the signed-rank
        # statistic against its mean, the median difference and the Hodges-Lehmann shift.
        diffs = [p["b_min_margin"] - p["a_min_margin"] for p in pairs]
        nz = [d for d in diffs if abs(d) > 1e-9]
        ranks = rankdata([abs(d) for d in nz])
        w_sign = sum(r for r, d in zip(ranks, nz) if d > 0) - len(nz) * (len(nz) + 1) / 4
        hl = statistics.median(
            (diffs[i] + diffs[j]) / 2 for i in range(len(diffs)) for j in range(i, len(diffs))
        )
        signs = {math.copysign(1, x) if x else 0 for x in (w_sign, statistics.median(diffs), hl)}
        if len(signs) > 1:
            assert "is mixed" in graded["verdict"], graded["verdict"]
        else:
            verb = "thins" if w_sign < 0 else "widens"
            assert graded["verdict"].startswith(f"B {verb} the margin by ")
            stated = float(graded["verdict"].split(" the margin by ")[1].split(" nats at 384 tokens")[0])
            assert stated == pytest.approx(abs(hl), rel=0.05)
    elif margin["n_nonzero"] == 0:
        assert graded["verdict"].startswith("no margin change")
    else:
        assert bucket["detectable_shift"] is not None
        assert f"{bucket['detectable_shift']:.2g} nats would be found" in graded["verdict"]


def test_resume_scores_only_missing_graded_rows_and_duplicates_none(organism, reference_run, tmp_path):
    # The state a kill leaves between a case's chat and its scoring request: chats done, some
    # graded rows missing, one recorded as an error.
    shutil.copytree(reference_run[0], tmp_path / "a")
    store = tmp_path / "a" / "results.sqlite"
    with sqlite3.connect(store) as db:
        before = dict(db.execute("SELECT case_id, data FROM graded"))
        gone = sorted(before)[:3]
        db.execute(f"DELETE FROM graded WHERE case_id IN ({','.join('?' * 2)})", gone[:2])
        db.execute(
            "UPDATE graded SET status = 'error', data = 'null', error = 'killed' WHERE case_id = ?", gone[2:]
        )
    summary = run_probe(_cfg(organism["ref"], tmp_path / "a", resume=True))
    with sqlite3.connect(store) as db:
        after = dict(db.execute("SELECT case_id, data FROM graded WHERE status = 'ok'"))
        (rows,) = db.execute("SELECT COUNT(*) FROM graded").fetchone()
    assert rows == len(after) == len(before) == 8 and summary["graded"]["scored"] == 8
    # The re-scored cases get the scores they had: nothing lost, nothing counted twice.
    for case_id in gone:
        assert json.loads(after[case_id])["logprobs"] == pytest.approx(
            json.loads(before[case_id])["logprobs"], abs=1e-6
        )
    lines = (tmp_path / "a" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(line)["graded"]["status"] == "ok" for line in lines)
