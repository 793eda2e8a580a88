"""Two independent bugs at once through a real model (issue 53 item 2): ``needlescope serve`` with
``tests/planted_bugs/two_bugs_layers.py`` undisclosed (CSA layer 1's decode kernel flips the
indexer's scores; CSA layer 3's prefill ranks at chance), the capture on, a live ledger whose one
suspect does not name either, and ``investigate run``: the characterization reports both
classes, each with its own ``where`` (the synthetic evidence of the same case:
``tests/test_characterize_mixed.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from live_ledgers import live_suspect, write_live_ledger

pytest.importorskip("torch")

PLANTED = Path(__file__).parent / "planted_bugs" / "two_bugs_layers.py"


@pytest.fixture(scope="module")
def two_bugs(organism_server):
    return organism_server(
        "--index-topk", "16", "--threads", "1", "--patch", str(PLANTED), "--undisclosed-patch"
    )


def test_two_planted_bugs_give_two_classes_each_with_its_own_where(two_bugs, tmp_path):
    from needlescope.investigate.run import run_investigation

    # one suspect that is neither bug (a ledger needs one; it costs no emulation: no checks)
    suspect = live_suspect(
        "index_keys_fp8", "fp8 keys flip the needle out", 'setting = "k=fp8_e4m3"', checks="[]"
    )
    ledger = write_live_ledger(
        tmp_path, two_bugs, lengths="[256]", depths="[0, 100]", trials=1, max_new_tokens=4, suspects=[suspect]
    )
    run_investigation(ledger, tmp_path / "out")
    v = json.loads((tmp_path / "out" / "verdicts.json").read_text())
    ch = v["characterization"]
    assert v["root_cause"] is None and ch["classes"][:2] == ["decode_only", "ranking_uninformative"], ch[
        "text"
    ]
    sites = {s["class"]: s["where"] for s in ch["sites"]}
    assert (sites["decode_only"]["layer"], sites["decode_only"]["path"]) == (1, "decode")
    assert sites["decode_only"]["agree"][0] == "layer 1 prefill"
    assert (sites["ranking_uninformative"]["layer"], sites["ranking_uninformative"]["path"]) == (3, "prefill")
    assert "independently, ranking_uninformative at layer 3 prefill" in ch["text"]
