"""Both paths, teacher-forced prefill and a server's decode, in the failing case's rank statistics
(``investigate.measure.rank_paths``) and in the live route's emulation, on the organism.

The planted decode-only bug (``bench/planted/indexer_decode_key_slot.py``: each decode step scores
entry s with the key of entry s - 1, prefill untouched) costs answers at their later tokens
(multiturn at 256 tokens with ``index_topk`` 8, at 512 with 16: the third answer token of a few
cases). Teacher-forced, the candidate ranks the needle exactly as the reference does; decoded, it
does not, and the report says "decode-path only: prefill selections identical". An unpatched
model ranks the needle identically on both paths.

Both ledgers set ``prefill_chunk`` (100 and 128 tokens, aligned to no window), so every
in-process pass of these runs (measurements, rank statistics, live emulation) goes through the
KV cache in chunks; the example ledger's runs (tests/test_investigate_organism.py) keep one pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from needlescope.investigate.run import run_investigation  # noqa: E402

DECODE_BUG = Path(__file__).resolve().parents[1] / "bench" / "planted" / "indexer_decode_key_slot.py"
SAYS = "decode-path only: prefill selections identical"

LEDGER = """
[target]
model = "organism"
threads = 2
prefill_chunk = 100
reference = "k=fp32 q=fp32 acc=fp32 topk=8"
candidate = "k=fp32 q=fp32 acc=fp32 topk=8"
extra_patches = ["patches/decode_bug.py"]

[symptom]
kind = "multiturn"
lengths = [256]
depths = [0, 50, 100]
trials = 1
max_new_tokens = 4

[[suspects]]
id = "index_keys_fp8"
tier = 1
hypothesis = "fp8 keys"
setting = "k=fp8_e4m3"
checks = []
"""


@pytest.fixture(scope="module")
def organism():
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle("organism")[:2]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, organism):
    from needlescope.investigate.report.diagnosis import write_reports

    d = tmp_path_factory.mktemp("paths")
    (d / "patches").mkdir()
    shutil.copy(DECODE_BUG, d / "patches" / "decode_bug.py")
    (d / "investigation.toml").write_text(LEDGER)
    md, html = write_reports(run_investigation(d / "investigation.toml", d / "out", loaded=organism))
    return json.loads((d / "out" / "verdicts.json").read_text()), md.read_text(), html.read_text()


def _stats(rp: dict, path: str) -> list:
    return [(ly["layer"], ly[path]) for ly in rp["layers"]]


def test_the_decode_only_bug_moves_the_failing_case_ranks_on_the_decode_path_only(in_process):
    v, md, html = in_process
    rp = v["rank_paths"]
    assert rp is not None and rp["analysed_token"] > 0  # a decode step: answer tokens decoded before it
    assert all(ly["prefill"] is not None and ly["visible"] > 8 for ly in rp["layers"])
    assert _stats(rp, "prefill") == _stats(rp, "reference_prefill")  # the prefill is untouched
    assert _stats(rp, "decode") != _stats(rp, "prefill")
    assert all(ly["prefill_same_as_reference"] for ly in rp["layers"])
    assert not all(ly["decode_same_as_reference"] for ly in rp["layers"])
    assert not rp["paths_agree"] and rp["diverges_first"] == "decode only"
    assert rp["summary"].startswith(SAYS)
    assert "Both paths: teacher-forced prefill and the server's decode" in md and SAYS in md
    assert SAYS in html


def test_an_unpatched_model_ranks_the_needle_identically_on_both_paths(organism):
    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.checkpoint import resolve_model_dir, trained_value_digits
    from needlescope.dsa.prompt import render_prompt
    from needlescope.investigate.decide.localization import decide_rank_paths
    from needlescope.investigate.ledger.plan import Config
    from needlescope.investigate.measure.rank_paths import rank_paths
    from needlescope.investigate.measure.records import measure_case
    from needlescope.setting import Setting

    model, tok = organism
    spec = CaseSpec(
        "multiturn", (512,), (40.0,), 1, 0, value_digits=trained_value_digits(resolve_model_dir("organism"))
    )
    case = build_cases(spec, lambda m: len(render_prompt(tok, m).input_ids))[0]
    ref = Config(Setting(index_topk=16))
    inv = SimpleNamespace(cases=[case], tokenizer=tok, model=model, reference=ref, chunk=None)
    rec = measure_case(model, tok, case, ref, max_new_tokens=4)
    assert len(rec["output_ids"]) >= 3
    # Analysed at a decode step: one answer token (the prefill path runs all ids from scratch) or
    # two (the prefill path continues the prompt's cache with the answer tokens as one chunk).
    for a in (1, 2):
        rp = decide_rank_paths(rank_paths(inv, ref, {**rec, "analysed_token": a}))
        assert rp["query_pos"] == rec["prompt_tokens"] - 1 + a
        assert all(ly["prefill"] is not None and ly["visible"] > 16 for ly in rp["layers"])
        assert _stats(rp, "decode") == _stats(rp, "prefill")  # rank for rank, percentile, needle selected
        assert all(ly["paths_overlap"] == 1.0 for ly in rp["layers"])
        assert rp["paths_agree"] and rp["diverges_first"] == "neither"


LIVE_LEDGER = """
[target]
model = "organism"
threads = 1
prefill_chunk = 128
reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"
candidate = "live"
endpoint = "{url}"

[symptom]
kind = "multiturn"
lengths = [512]
depths = [0, 10, 20, 30, 40, 50]
trials = 1
max_new_tokens = 4

[[suspects]]
id = "decode_bug"
tier = 1
hypothesis = "the decode kernel reads the key cache one slot off"
patch = "patches/decode_bug.py"
checks = ["live_emulation"]
"""


def test_live_emulation_of_a_decode_only_bug_reproduces_it_on_the_decode_path_only(tmp_path, organism):
    from needlescope.investigate.report.diagnosis import write_reports
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    (tmp_path / "patches").mkdir()
    shutil.copy(DECODE_BUG, tmp_path / "patches" / "decode_bug.py")
    live = Setting.parse(f"k=fp32 topk=16 patch={tmp_path / 'patches' / 'decode_bug.py'}")
    with ServerProcess(ServeConfig(model="organism", port=0, setting=live, threads=1), timeout=300) as server:
        (tmp_path / "investigation.toml").write_text(LIVE_LEDGER.format(url=server.url))
        findings = run_investigation(tmp_path / "investigation.toml", tmp_path / "out", loaded=organism)
    v = json.loads((tmp_path / "out" / "verdicts.json").read_text())
    s = next(x for x in v["suspects"] if x["id"] == "decode_bug")
    paths = s["live_paths"]
    assert v["symptom"]["failing_cases"] >= 2 and paths["decode"]["failures"] >= 3
    assert paths["prefill"]["reproduced"] == 0  # teacher-forced, the emulation is the baseline
    assert paths["decode"]["reproduced"] == paths["decode"]["failures"]
    assert paths["decode"]["jaccard_emulation"] > paths["prefill"]["jaccard_emulation"]
    assert s["verdict"] == "implicated" and paths["decided_by"] == "decode", s["reason"]
    assert s["reason"].startswith("decode-path only") and v["root_cause"] == "decode_bug"
    md = write_reports(findings)[0].read_text()
    assert "decode path: failures reproduced, Jaccard" in md and "decode-path only" in md
