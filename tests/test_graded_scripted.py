"""Graded parts on a server without logprobs, graded resume, and auto-difficulty (scripted server)."""

from __future__ import annotations

import json

from needlescope.cases import CaseSpec, build_cases
from needlescope.run.difficulty import ladder
from needlescope.targets.logprobs import _from_sglang


def _probe(run_cli, url, out, *extra):
    return run_cli(
        "probe", "--base-url", url, "--model", "scripted", "--lengths", "200,400", "--depths", "0,100",
        "--trials", "1", "--out", str(out), *extra,
    )  # fmt: skip


def test_server_without_logprobs_says_so_and_skips(scripted_server, run_cli, tmp_path):
    url = scripted_server()
    for side in ("a", "b"):
        code, out, err = _probe(run_cli, url, tmp_path / side, "--graded")
        assert code == 0, err
        assert "no graded signal: the server offers no prompt logprobs" in out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    graded = summary["graded"]
    assert graded["method"] is None and graded["scored"] == 0 and graded["lengths"] == []
    assert "/completions" in graded["note"] and "/generate" in graded["note"]
    assert "no graded signal" in (tmp_path / "a" / "report.md").read_text()
    code, out, err = run_cli(
        "compare",
        "--a-run",
        str(tmp_path / "a"),
        "--b-run",
        str(tmp_path / "b"),
        "--out",
        str(tmp_path / "ab"),
    )
    assert code == 0, err
    assert json.loads((tmp_path / "ab" / "compare.json").read_text())["graded"] is None
    assert "Not measured" in (tmp_path / "ab" / "report.md").read_text()


def test_sglang_generate_logprobs_are_read_from_the_end_of_the_input_lists():
    # SGLang's /generate answer shape (meta_info lists end at the last input token): a supplement
    # to the real-server tests, as no SGLang runs here.
    body = {
        "meta_info": {
            "input_token_logprobs": [[-0.2, 17, None], [-1.5, 18, None]],
            "input_top_logprobs": [[[-0.2, 17, None], [-2.0, 9, None]], [[-0.5, 4, None], [-1.5, 18, None]]],
        }
    }
    first, second = _from_sglang(body, prompt=[1, 2, 3], gold=[17, 18])
    assert first.rank == 1 and abs(first.margin - 1.8) < 1e-9
    assert second.rank == 2 and abs(second.margin + 1.0) < 1e-9


def test_auto_difficulty_escalates_in_order_and_records_when_the_reference_never_drops(
    scripted_server, run_cli, tmp_path
):
    # The scripted server reads the exact key, so distractors and long values never fool it: the
    # search must climb the whole ladder, hold the hardest level, and say it never got below.
    url = scripted_server()
    code, out, err = _probe(
        run_cli, url, tmp_path, "--kind", "single", "--value-digits", "5", "--auto-difficulty"
    )
    assert code == 0, err
    difficulty = json.loads((tmp_path / "summary.json").read_text())["difficulty"]
    tried = [(lv["distractors"], lv["value_digits"]) for lv in difficulty["levels"]]
    assert tried == ladder("single", None, 5) == [(0, 5), (1, 5), (2, 5), (4, 5), (8, 5), (8, 7), (8, 9)]
    assert all(lv["recall"] == 1.0 and lv["n"] == 4 for lv in difficulty["levels"])
    assert difficulty["reached"] is False and difficulty["chosen"] == {"distractors": 8, "value_digits": 9}
    assert "difficulty level 6: 8 distractors, 9-digit values" in out
    # The main run holds the chosen level: 8 near-duplicate keys and 9-digit values in every prompt.
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 and all(len(r["expected"][0]) == 9 for r in results)
    assert "## Auto-difficulty" in (tmp_path / "report.md").read_text()
    # Resuming replays the recorded search and sends nothing new.
    code, out, err = _probe(
        run_cli, url, tmp_path, "--kind", "single", "--value-digits", "5", "--auto-difficulty", "--resume"
    )
    assert code == 0, err
    assert json.loads((tmp_path / "summary.json").read_text())["difficulty"] == difficulty


def test_distractors_are_near_duplicate_keys_in_every_kind():
    count = lambda msgs: sum(len(m["content"].split()) + 3 for m in msgs)  # noqa: E731
    for kind in ("single", "multiturn", "multivalue"):
        case = build_cases(CaseSpec(kind, (900,), (50,), 1, 3, n_distractors=3), count)[0]
        text = " ".join(m["content"] for m in case.messages)
        noun = case.needle.split()[6].rstrip(".")
        assert text.count(f" {noun} is ") + text.count(f" {noun} are ") == 4, kind
        assert text.count(case.needle) == 1 and case.counted_length == 900


def test_bisect_refuses_graded_and_auto_difficulty_before_any_request(run_cli, tmp_path):
    for flag in ("--graded", "--auto-difficulty"):
        code, _out, err = run_cli(
            "probe", "--base-url", "http://127.0.0.1:9", "--model", "m", "--lengths", "100,900",
            "--bisect", flag, "--out", str(tmp_path / flag),
        )  # fmt: skip
        assert code == 2 and "--bisect measures recall only" in err
        assert not (tmp_path / flag).exists()
