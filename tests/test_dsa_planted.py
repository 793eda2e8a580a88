"""The localizer against planted faults on the shipped organism (CPU, a 512-token multiturn prompt).

Each planted fault (tests/planted_faults.py, not a built-in fault) must be pinned on the
module it lives in, benign reduced precision must be exonerated, and no other module may be
flagged, at index_topk 64 and at the checkpoint's own index_topk.
"""

from __future__ import annotations

import fnmatch

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.diff import NO_DIVERGENCE, localize  # noqa: E402
from needlescope.dsa.prompt import needle_token_span, render_prompt  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from planted_faults import INDEXER, PLANTED, Planted  # noqa: E402

LENGTH = 512
# Modules a planted fault lives in (every call of them may diverge); all others must not.
FAULTY = {
    "routed_scale_no_undo": "model.layers.*.mlp.gate",
}


@pytest.fixture(scope="module")
def organism():
    ref, tok, _ = load_bundle("organism")

    def count(messages):
        return len(render_prompt(tok, messages).input_ids)

    spec = CaseSpec(kind="multiturn", lengths=(LENGTH,), depths=(50.0,), trials=1, seed=3, value_digits=3)
    case = build_cases(spec, count)[0]
    prompt = render_prompt(tok, case.messages)
    ids = torch.tensor([prompt.input_ids])
    return ref, ids, needle_token_span(prompt, case.needle)


def _diverging(result: dict) -> list[str]:
    return [m["module"] for m in result["modules"] if m["verdict"] == "diverges"]


@pytest.mark.parametrize("index_topk", [64, None], ids=["topk64", "checkpoint_topk"])
@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_planted_fault_is_localized(organism, tmp_path, planted: Planted, index_topk):
    ref, ids, span = organism
    patch = tmp_path / f"{planted.name}.py"
    patch.write_text(planted.body)
    result = localize(
        ref,
        load_bundle("organism")[0],
        ids,
        setting=Setting(index_topk=index_topk, patch=patch),
        needle_span=span,
    )
    expect = planted.expected(full_k=index_topk is None)
    assert result["first_divergent_module"] == expect
    faulty = FAULTY.get(planted.name, expect)
    false = [m for m in _diverging(result) if faulty is None or not fnmatch.fnmatchcase(m, faulty)]
    assert false == []  # zero false implications
    if expect is None:
        assert result["summary"] == NO_DIVERGENCE
    verdicts = {m["module"]: m["verdict"] for m in result["modules"]}
    for name in planted.reduced:
        assert verdicts[name] == "reduced precision, within its rounding", name
    # The ranks come from the scores the top-k used: a rank <= k always means selected.
    assert all(r["rank_consistent"] for r in result["layers"])
    layer1 = next(r for r in result["layers"] if r["layer"] == 1)
    if planted.name == "visibility_leak":
        # Only additions where k covers every entry; they count in the selection error.
        assert layer1["selection_error"] > 0 and layer1["positions_changed"] > LENGTH // 2
    if expect == INDEXER:
        row = next(m for m in result["modules"] if m["module"] == INDEXER)
        assert row["own_err"] > row["own_budget"]
        # The scorer it calls is not blamed for what the indexer's own code did.
        assert verdicts[f"{INDEXER}.scorer"] != "diverges"


def test_fp8_keys_are_explained_not_divergent(organism):
    ref, ids, span = organism
    result = localize(
        ref,
        load_bundle("organism")[0],
        ids,
        setting=Setting(index_k="fp8_e4m3", index_topk=64),
        needle_span=span,
    )
    assert result["first_divergent_module"] is None and result["summary"] == NO_DIVERGENCE
    verdicts = {m["module"]: m["verdict"] for m in result["modules"]}
    assert verdicts[f"{INDEXER}.scorer"] == "within precision"
    assert min(r["topk_overlap"] for r in result["layers"]) < 1.0  # the selection did change
    assert "explained" in verdicts.values()  # and what read it moved, explained by it
