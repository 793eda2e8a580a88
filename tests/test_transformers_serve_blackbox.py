"""The black-box investigation against ``transformers serve``, with bugs planted in transformers'
own DeepseekV4 code (``tests/planted_bugs/transformers/``: each a ``sitecustomize.py`` that
patches a class of ``modeling_deepseek_v4`` before the server loads anything, no undo, nothing
in what the server reports).

One server per bug on one copy of the organism whose ``index_topk`` is 32 (the dense length is
then 127 tokens, where the organism answers; at top-16 it would be 63, below the lengths it was
trained on, where the healthy model loses needles by itself). All start at once; then
``investigate init --live URL --config config.json --served-model PATH`` writes each black-box
ledger (transformers serve has no /get_server_info, no /tokenize, and its /v1/models fails
offline), and the four investigations run at once, in threads of this process (the route reads
answers over HTTP: a child process each would import torch and transformers again for nothing;
``tests/test_blackbox_live.py`` runs the ``investigate run`` command itself). The grid is 256 and
384 tokens at depths 0/25/75/100, one trial; the ``[blackbox]`` plan sends two failing cases again
and scans two depths. transformers serve gives no prompt logprobs, so the teacher-forced
experiment is not available: a decode-path bug must come out ``undecided``, naming them.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("accelerate")  # transformers' serving extra
pytest.importorskip("torch")

from planted_bugs.transformers import CLASSES  # noqa: E402
from transformers_serve import organism_copy, plant, started  # noqa: E402

BUGS = Path(__file__).parent / "planted_bugs" / "transformers"
SYMPTOM = {
    "lengths = [1024, 2048]": "lengths = [256, 384]",
    "depths = [0, 25, 50, 75, 100]": "depths = [0, 25, 75, 100]",
    "trials = 2": "trials = 1",
}
PLAN = "[blackbox]\nfailing_cases = 2\nscan_depths = 2\n"
DECIDABLE = [name for name, cls in CLASSES.items() if cls != "decode_only"]


def _init_args(directory: Path, url: str, weights: Path) -> list[str]:
    return ["investigate", "init", str(directory), "--live", url, "--config", str(weights / "config.json")]


def _cli_code(*argv: str) -> int:
    """The exit code of the ``needlescope`` entry point run in this process (a module fixture has
    no ``run_cli``)."""
    from needlescope.cli import main as cli_main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["needlescope", *argv])
        try:
            cli_main.main()
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
    return 0


def _investigate(ledger: Path, out: Path):
    """The investigation's ``Findings``, or the exception it raised (reported by the test)."""
    from needlescope.investigate.run import run_investigation

    try:
        return run_investigation(ledger, out)
    except Exception as exc:  # noqa: BLE001 - handed to the test that reads this run
        return exc


@pytest.fixture(scope="module")
def investigated(tmp_path_factory):
    """{"weights", "urls": {bug: URL}, "runs": {bug: its out dir}, "errors": {bug: exception}}."""
    root = tmp_path_factory.mktemp("tfserve_blackbox")
    weights = organism_copy(root / "organism_top32", 32)
    bugs = {name: plant(root / Path(name).stem, (BUGS / name).read_text()) for name in CLASSES}
    with started(weights, bugs, root) as urls:
        ledgers = {}
        for name, url in urls.items():
            d = root / f"inv_{Path(name).stem}"
            assert _cli_code(*_init_args(d, url, weights), "--served-model", str(weights)) == 0, name
            text = (d / "investigation.toml").read_text()
            for was, now in SYMPTOM.items():
                assert was in text, text
                text = text.replace(was, now)
            (d / "investigation.toml").write_text(text + PLAN)
            ledgers[name] = d
        with ThreadPoolExecutor(len(ledgers)) as pool:
            done = dict(
                zip(
                    ledgers,
                    pool.map(lambda d: _investigate(d / "investigation.toml", d / "out"), ledgers.values()),
                )
            )
        errors = {name: r for name, r in done.items() if isinstance(r, Exception)}
        yield {
            "weights": weights,
            "urls": urls,
            "runs": {n: d / "out" for n, d in ledgers.items()},
            "errors": errors,
        }


def _verdicts(investigated, bug) -> dict:
    assert bug not in investigated["errors"], repr(investigated["errors"].get(bug))
    return json.loads((investigated["runs"][bug] / "verdicts.json").read_text())


@pytest.mark.parametrize("bug", DECIDABLE)
def test_a_bug_planted_in_transformers_gets_its_class_from_outside(investigated, bug):
    v = _verdicts(investigated, bug)
    ch = v["characterization"]
    assert ch["classes"][0] == CLASSES[bug], ch["text"]
    e = ch["evidence"][CLASSES[bug]]
    assert e["experiment"] and e["capture_adds"] and ch["where"]["route"] == "blackbox"
    assert v["root_cause"] is None and v["suspects"] == []  # no wrong root cause: the black box names none
    measured = ch["measured"]["evidence"]
    # what transformers serve lacks is said, not guessed: no prompt logprobs, no /tokenize
    assert measured["method"] is None and "/tokenize" in measured["method_note"]
    assert (measured["arch"]["ratio"], measured["arch"]["topk"]) == (4, 32)
    inv = json.loads((investigated["runs"][bug] / "investigation.json").read_text())
    assert inv["route"] == "blackbox"
    assert inv["symptom"]["plan"] == {"dense_cases": 6, "failing_cases": 2, "scan_depths": 2}
    assert inv["symptom"]["served_model"] == str(investigated["weights"])


def test_a_decode_path_bug_is_undecided_naming_the_missing_logprobs(investigated):
    bug = next(name for name, cls in CLASSES.items() if cls == "decode_only")
    v = _verdicts(investigated, bug)
    ch = v["characterization"]
    # decode_only needs the answer teacher-forced; transformers serve cannot: no class is guessed
    assert ch["classes"] == ["undecided"] and ch["evidence"] == {}, ch["text"]
    assert ch["undecided"][0].startswith("prompt logprobs would test decode_only"), ch["undecided"]
    assert "/tokenize" in ch["undecided"][0] and "--graded" in ch["next"]
    assert v["root_cause"] is None and v["suspects"] == []
    lost = sum(c["lost"] for c in ch["measured"]["evidence"]["grid"])
    assert lost > 0  # the bug costs recall: undecided is not "nothing to explain"


def test_without_a_served_model_init_and_run_say_what_to_set(investigated, run_cli, tmp_path):
    name, url = next(iter(investigated["urls"].items()))
    weights = investigated["weights"]
    code, out, err = run_cli(*_init_args(tmp_path / "init", url, weights))
    assert code == 2 and "--served-model" in err and "Traceback" not in err, out + err
    # a ledger written by hand without it: the run stops before sending a case, naming the key
    ledger = investigated["runs"][name].parent / "investigation.toml"
    text = "\n".join(ln for ln in ledger.read_text().splitlines() if not ln.startswith("served_model"))
    (tmp_path / "investigation.toml").write_text(text)
    (tmp_path / "config.json").write_bytes((weights / "config.json").read_bytes())
    code, out, err = run_cli(
        "investigate", "run", str(tmp_path / "investigation.toml"), "--out", str(tmp_path / "o")
    )
    assert code == 2 and "served_model" in err and "Traceback" not in err, out + err
    # a served_model the server does not serve: its own refusal, in one line, before any case
    (tmp_path / "investigation.toml").write_text(
        text.replace("[symptom]", 'served_model = "nope"\n[symptom]', 1)
    )
    code, out, err = run_cli(
        "investigate", "run", str(tmp_path / "investigation.toml"), "--out", str(tmp_path / "o2")
    )
    assert code == 2 and "'nope' failed (HTTP 400: Server is pinned" in " ".join(err.split()), out + err


def test_a_ledger_from_a_probe_sends_the_model_the_probe_sent(investigated, run_cli, tmp_path):
    from needlescope.investigate.ledger.ledger import load_ledger

    bug = next(name for name, cls in CLASSES.items() if cls == "outside_selection")
    url, w = investigated["urls"][bug], str(investigated["weights"])
    code, out, err = run_cli("probe", "--base-url", url + "/v1", "--model", w, "--tokenizer", w, "--value-digits", "3",
                             "--lengths", "256", "--depths", "0", "--trials", "1", "--out", str(tmp_path / "p"))  # fmt: skip
    assert code == 0, out + err
    code, out, err = run_cli("investigate", "init", str(tmp_path / "fp"), "--from-probe", str(tmp_path / "p"))
    assert code == 0, out + err
    ledger = load_ledger(tmp_path / "fp" / "investigation.toml")
    assert ledger.target.blackbox and ledger.target.served_model == w
    assert (ledger.symptom.lengths, ledger.symptom.depths) == ((256,), (0.0,))
