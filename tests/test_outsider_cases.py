"""Cases and their scoring as an outsider meets them: answers in another form, hedges over the
distractors, a user haystack without sentence ends or with numbers of its own, and a grader that
returns logprobs no probability has.

The peers are the scripted server's own handler served in this process on loopback, with one
quirk each: its right answer rewritten into another form, or an echo-logprob scorer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from needlescope.cases import CaseSpec, build_cases, score_answer
from needlescope.errors import BadInput
from needlescope.testing import scripted_server as ss
from needlescope.testing.servers import in_thread

_FACT = re.compile(r"\bis (\d+)\.")


def _peer(rewrite: Callable[[str, dict], str] | None = None, logprob: Callable[[int], float] | None = None):
    """The scripted server (whitespace tokens, answers every needle it sees), its chat answers
    passed through ``rewrite(answer, request)``, and with ``logprob`` an OpenAI ``echo`` scorer
    at ``/v1/completions`` whose every logprob is ``logprob(len(prompt ids))``."""

    class Quirky(ss.Handler):
        state = ss.State(ss.parse_options(["--window", "100000"]))
        request: dict = {}

        def _body(self) -> dict:
            self.request = super()._body()
            return self.request

        def _send(self, status: int, body: object, headers: dict | None = None) -> None:
            if rewrite is not None and isinstance(body, dict) and body.get("object") == "chat.completion":
                message = body["choices"][0]["message"]
                message["content"] = rewrite(message["content"], self.request)
            super()._send(status, body, headers)

        def do_POST(self) -> None:
            if self.path != "/v1/completions" or logprob is None:
                super().do_POST()
                return
            ids = self._body()["prompt"]
            value = logprob(len(ids))
            lp = {
                "tokens": [str(i) for i in ids],
                "token_logprobs": [value] * len(ids),
                "top_logprobs": [{"rival": -6.0}] * len(ids),
            }
            self._send(200, {"choices": [{"text": "", "logprobs": lp}]})

    return in_thread(Quirky)


def _probe(run_cli, url: str, out: Path, *flags: str) -> tuple[int, str, str]:
    return run_cli(
        "probe", "--base-url", f"{url}/v1", "--model", "scripted", "--lengths", "200",
        "--depths", "0,100", "--trials", "1", "--value-digits", "3", "--out", str(out), *flags,
    )  # fmt: skip


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_multivalue_answered_as_asked_without_spaces_is_correct(run_cli, tmp_path):
    """multivalue asks for "the numbers only, separated by commas": "826,133,662" is that answer.
    It was a miss, and the taxonomy called it `partial` with 3 of 3 values found."""
    with _peer(lambda answer, _req: answer.replace(", ", ",")) as url:
        code, _out, err = _probe(run_cli, url, tmp_path / "mv", "--kind", "multivalue")
    assert code == 0, err
    rows = _rows(tmp_path / "mv")
    assert [r["answer"].count(",") for r in rows] == [2, 2] and " " not in rows[0]["answer"]
    assert [r["correct"] for r in rows] == [True, True]


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        ("code:477", True),
        ("<answer>477</answer>", True),
        ("４７７", True),  # fullwidth digits
        ("٤٧٧", True),  # Arabic-Indic digits
        ("答案是477。", True),
        ("```\n477\n```", True),
        ("<think>The amber falcon is 512 and the blue falcon is 477.</think>\n477", True),
        ("<think>The blue falcon is 477, so the answer", False),  # cut off while thinking: no answer
        ("4770", False),
        ("1477", False),
        ("47 7", False),
        ("477 or 512", False),  # a hedge over the distractor
        ("477, 512", False),
        ("512", False),
    ],
)
def test_an_answer_is_read_as_numbers_whatever_its_form(answer, ok):
    assert score_answer(answer, ["477"], rivals=["512"]) is ok


def test_a_thousands_separated_value_is_that_value():
    assert score_answer("The code is 4,817,263.", ["4817263"])
    assert not score_answer("4,817,2630", ["4817263"])
    assert not score_answer("14,817,263", ["4817263"])


def test_naming_every_value_in_the_prompt_is_a_miss_classed_distractor(run_cli, tmp_path):
    """A model that lists every secret code it saw scored 1.00 on multikey, the kind that tests
    telling the keys apart; `replay` of such a miss said it did not reproduce."""

    def every_value(answer: str, request: dict) -> str:
        stated = _FACT.findall(json.dumps(request.get("messages")))
        return " or ".join([answer, *(v for v in stated if v != answer)])

    with _peer(every_value) as url:
        code, out, err = _probe(run_cli, url, tmp_path / "mk", "--kind", "multikey")
        assert code == 0, err
        rows = _rows(tmp_path / "mk")
        assert all(r["answer"].count(" or ") == 4 for r in rows)
        assert [r["correct"] for r in rows] == [False, False]
        assert {r["failure"]["category"] for r in rows} == {"distractor"}
        bundle = next((tmp_path / "mk" / "bundles").iterdir())
        code, out, err = run_cli("replay", str(bundle), "--base-url", f"{url}/v1")
    assert code == 0, err
    assert "reproduced 1/1 times (distractor 1" in out


def _words(messages: list[dict]) -> int:
    return sum(len(m["content"].split()) + 3 for m in messages)


def test_a_haystack_without_sentence_ends_still_places_the_needle_at_its_depth():
    """A log or code file as --haystack-file: no period anywhere, so depths 25 and 50 both went
    to the very start of the prompt and 75 to the very end."""
    hay = " ".join(f"line{i % 97} ok" for i in range(3000))
    depths = (0.0, 25.0, 50.0, 75.0, 100.0)
    spec = CaseSpec("single", (1200,), depths, 1, 3, haystack_text=hay, value_digits=3)
    for c in build_cases(spec, _words):
        text = c.messages[0]["content"]
        assert c.counted_length == 1200
        assert abs(text.index(c.needle) / len(text) - c.depth / 100) < 0.06, c.case_id


def test_a_multiturn_needle_in_unpunctuated_text_sits_where_its_depth_says_in_its_turn():
    """Multiturn places the needle at its depth in the whole conversation (issue 54 item 12: it
    ran over the user turns only), always in a user turn. Without sentence ends it went to the
    turn's start or end."""
    hay = " ".join(f"line{i % 97} ok" for i in range(3000))
    spec = CaseSpec("multiturn", (1200,), (10.0, 40.0, 60.0, 90.0), 1, 3, haystack_text=hay, value_digits=3)
    for c in build_cases(spec, _words):
        turns = c.messages[:-1]  # the question follows the conversation
        held = [m for m in turns if c.needle in m["content"]]
        assert c.counted_length == 1200 and [m["role"] for m in held] == ["user"], c.case_id
        before = sum(len(m["content"]) for m in turns[: turns.index(held[0])])
        where = (before + held[0]["content"].index(c.needle)) / sum(len(m["content"]) for m in turns)
        assert abs(where - c.depth / 100) < 0.05, (c.case_id, where)


def test_no_value_is_a_number_the_users_haystack_states():
    """A haystack that states numbers (an essay with years, a table) made some of them a second
    needle: the value itself could stand in the filler, or a distractor's."""
    hay = "The ledger lists " + " ".join(str(n) for n in range(10, 95)) + " and stops."
    spec = CaseSpec("multikey", (600,), (50.0,), 4, 0, haystack_text=hay, value_digits=2, n_distractors=4)
    for c in build_cases(spec, _words):
        values = _FACT.findall(c.messages[0]["content"])
        assert len(values) == 5 and set(values) == {"95", "96", "97", "98", "99"}, values
        assert c.expected[0] in values
    with pytest.raises(BadInput, match="not stated in the haystack file cannot give 6 distinct"):
        CaseSpec("multikey", (600,), (50.0,), 1, 0, haystack_text=hay, value_digits=2, n_distractors=5)


def test_graded_logprobs_that_no_probability_has_are_errors_never_scores(run_cli, tmp_path):
    """An echo scorer that passes detection (a finite logprob on the tiny ping) and then answers
    NaN for the real prompts: every margin of the cell was NaN, the report said "median token
    margin +nan nats" and summary.json held NaN, which strict JSON readers refuse."""

    def logprob(n_ids: int) -> float:
        return -0.5 if n_ids < 50 else math.nan

    with _peer(logprob=logprob) as url:
        code, out, err = _probe(run_cli, url, tmp_path / "g", "--graded")
    assert code == 0, err
    text = (tmp_path / "g" / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    graded = summary["graded"]
    assert graded["method"] == "echo" and graded["scored"] == 0 and graded["errors"] == 2
    rows = _rows(tmp_path / "g")
    assert [r["graded"]["status"] for r in rows] == ["error", "error"]
    assert "logprob of nan" in rows[0]["graded"]["error"]
    assert [r["correct"] for r in rows] == [True, True]  # recall is scored as usual


@pytest.mark.parametrize(
    ("answer", "category"),
    [
        ("<think>The code is 477.</think>", "empty_or_length"),  # thought, then gave no answer
        ("٥١٢", "distractor"),  # the distractor's value in Arabic-Indic digits
        ("477 or 512", "distractor"),
    ],
)
def test_a_miss_is_classed_by_the_numbers_the_scorer_read(answer, category):
    """The failure taxonomy reads an answer as scoring does: before, a thought-out right value
    with no answer after it was `partial` (1 of 1 values found), and a distractor in another
    script `unrelated`."""
    from needlescope.analysis.taxonomy import classify

    messages = [
        {"role": "user", "content": "The code of the red fox is 512. The code of the blue fox is 477."}
    ]
    assert not score_answer(answer, ["477"], rivals=["512"])
    assert (
        classify(answer=answer, expected=["477"], finish_reason="stop", messages=messages).category
        == category
    )


def test_a_number_of_another_length_in_the_prompt_is_no_rival():
    """A year or a section number in a user's haystack, cited beside the right value, is not a
    hedge over the distractors: only numbers as long as a value are rivals."""
    from needlescope.cases.scoring import prompt_rivals, score_answer

    messages = [{"role": "user", "content": "In 2019 (section 3) the code of the red fox is 4817263; "
                 "the code of the red owl is 5551234. What is the code of the red fox?"}]  # fmt: skip
    rivals = prompt_rivals(messages, ["4817263"])
    assert rivals == ["5551234"]
    assert score_answer("4817263, as section 3 of 2019 says", ["4817263"], rivals)
    assert not score_answer("4817263 or 5551234", ["4817263"], rivals)


def test_a_haystack_file_that_is_a_device_is_not_called_missing(run_cli, tmp_path):
    code, _, stderr = run_cli(
        "probe", "--base-url", "http://127.0.0.1:9", "--model", "m", "--haystack-file", "/dev/null",
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 2 and "--haystack-file /dev/null is not a regular file" in stderr, stderr
