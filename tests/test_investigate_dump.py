"""``candidate = "dump"``: an investigation whose candidate is an engine's tensor dump.

The "engine" is the organism with a planted fault (layer 3's attention output projection scaled
by 1.25), dumped over two TP ranks in SGLang's dumper layout (``testing.sglang_dump``) into the
ledger's folder. The ledger names the dump; the DIAGNOSIS's localization must come from it.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.dump_mapping import load_mapping  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.investigate.ledger.ledger import load_ledger  # noqa: E402
from needlescope.investigate.run import run_investigation  # noqa: E402
from needlescope.testing.sglang_dump import write_sglang_dump  # noqa: E402

FAULT = "model.layers.3.self_attn.o_b_proj"


def dump_ledger(directory, checks: str = "[]", dump: str = "dumps") -> str:
    text = f"""
[target]
model = "organism"
threads = 1
reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"
candidate = "dump"
dump = "{dump}"

[symptom]
kind = "single"
lengths = [128]
depths = [50]
trials = 1
max_new_tokens = 4

[[suspects]]
id = "attn_out"
tier = 1
hypothesis = "the attention output projection is wrong"
setting = "k=fp8_e4m3"
checks = {checks}
"""
    path = directory / "investigation.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def organism():
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle("organism")[:2]


def test_dump_candidate_localizes_from_the_dump(tmp_path, organism):
    model = organism[0]
    ids = torch.randint(10, 3000, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    handle = model.get_submodule(FAULT).register_forward_hook(lambda m, i, o: o * 1.25)
    try:
        write_sglang_dump(
            model, ids, tmp_path / "dumps", mapping=load_mapping(), passes=[32, 16], index_topk=8
        )
    finally:
        handle.remove()
    out = tmp_path / "out"
    findings = run_investigation(dump_ledger(tmp_path), out, loaded=organism)
    v = json.loads((out / "verdicts.json").read_text())
    loc = v["localization"]
    assert loc["case_id"] == "dump" and loc["diverges_first"] == "dump"
    path = loc["paths"][0]
    assert path["path"] == "dump" and path["first_divergent_module"] == FAULT and path["layer"] == 3
    assert path["module_type"] == "Linear" and path["own_err"] > path["own_budget"]
    assert [ly["layer"] for ly in path["layers"]] == [1, 3]
    assert "compare-dump dumps" in loc["command"] and str(tmp_path) not in loc["command"]
    assert v["suspects"][0]["verdict"] == "inconclusive"
    inv = json.loads((out / "investigation.json").read_text())
    assert inv["route"] == "dump"
    cmp = json.loads((out / "localize" / "compare_dump.json").read_text())
    assert cmp["first_beyond"]["reference"] == FAULT
    from needlescope.investigate.report.diagnosis import write_reports

    md = write_reports(findings)[0].read_text()
    section = md.split("## Where the divergence starts", 1)[1]
    assert "The engine's tensor dump" in section and FAULT in section
    assert "non_intrusive__model.layers.3.self_attn.wo_b.output" in section


def test_dump_route_refusals(tmp_path):
    (tmp_path / "dumps").mkdir()
    with pytest.raises(BadInput, match="cannot be ablated"):
        load_ledger(dump_ledger(tmp_path, checks='["ablation"]'))
    with pytest.raises(BadInput, match="leave checks out"):
        load_ledger(dump_ledger(tmp_path, checks='["audit:index_keys_fp8"]'))
    with pytest.raises(BadInput, match="not a directory"):
        load_ledger(dump_ledger(tmp_path, dump="missing"))
    with pytest.raises(BadInput, match="outside the ledger's folder"):
        load_ledger(dump_ledger(tmp_path, dump="../elsewhere"))
