"""The localizer's headline agrees with its evidence (issue 54 items 10 and 11), on a tiny random
DeepSeek-V4 (index_topk 4, so the indexer really chooses) with two planted patch files:

- ``attn_out_bf16_before_proj.py``: the attention output rounded to bf16 inside the output
  projection's forward. Benign: ``indexer diff`` names no module; each projection is judged
  against its input rounding's budget ("reduced precision, within its rounding", bf16).
- ``indexer_query_table.py``: the indexer's code asks the rotary for the main attention's table
  for its queries. The top-k changes; the headline names the indexer, whose code chose the
  table (the rotary computed faithfully what it was asked), not "none" with a side note.
- ``attn_out_bf16_before_derope.py``: the attention output stored in bf16 *before* the
  attention's own de-rotation (its rotary application with ``-sin``), all inside
  ``self_attn``'s code: what the projection reads is no rounding of anything a hook sees. Found
  by replaying ``self_attn`` with one of its own intermediate values rounded (``dsa.diff_rounding``
  case 6); it named ``self_attn`` in every layer before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.diff import NO_DIVERGENCE, localize  # noqa: E402
from needlescope.dsa.emulate import csa_indexers  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

PLANTED = Path(__file__).parent / "planted_bugs"
ROUNDING = PLANTED / "attn_out_bf16_before_proj.py"
QUERY_TABLE = PLANTED / "indexer_query_table.py"
BEFORE_DEROPE = PLANTED / "attn_out_bf16_before_derope.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random(tmp_path_factory.mktemp("tiny_v4"), seed=1, hidden_size=64, index_topk=4)
    ids = torch.randint(5, 200, (1, 96), generator=torch.Generator().manual_seed(0))
    return path, load_bundle(path)[0], ids


def _localize(tiny, patch: Path) -> dict:
    path, reference, ids = tiny
    return localize(reference, load_bundle(path)[0], ids, setting=Setting(patch=patch))


def test_attention_output_rounded_before_the_projection_names_no_module(tiny):
    diff = _localize(tiny, ROUNDING)
    assert diff["first_divergent_module"] is None and diff["summary"] == NO_DIVERGENCE, diff["summary"]
    rows = [m for m in diff["modules"] if m["module"].endswith(".self_attn.o_a_proj")]
    moved = [m for m in rows if m["own_err"] > 0]
    assert moved, "the rounding moved no projection: the test plants nothing"
    for m in moved:
        assert m["verdict"] == "reduced precision, within its rounding" and m["precision"] == "bf16", m
        assert m["own_err"] <= m["own_budget"], m


def test_a_query_key_rope_table_mismatch_is_the_indexers_headline(tiny):
    diff = _localize(tiny, QUERY_TABLE)
    first_csa = csa_indexers(tiny[1])[0][0]
    indexer = f"model.layers.{first_csa}.self_attn.compressor.indexer"
    assert min(r["topk_overlap"] for r in diff["layers"]) < 1.0  # the selection changed
    assert diff["first_divergent_module"] == indexer, diff["summary"]
    assert diff["summary"].startswith(f"first divergent module: {indexer}"), diff["summary"]
    assert "RoPE-table mismatch" in diff["summary"]
    verdicts = {m["module"]: m["verdict"] for m in diff["modules"]}
    assert verdicts[indexer] == "diverges"
    # the rotary computed what it was asked: not blamed
    assert all(v != "diverges" for k, v in verdicts.items() if ".rotary_emb" in k)


def test_cli_diff_on_the_benign_rounding_exits_clean_and_says_so(tiny, tmp_path, run_cli):
    path, _, ids = tiny
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps({"input_ids": ids[0].tolist(), "needle_token_span": [40, 48]}))
    out = tmp_path / "out"
    code, stdout, err = run_cli("indexer", "diff", "--model", str(path), "--input-ids", str(ids_file),
        "--patch", str(ROUNDING), "--out", str(out))  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "diff.json").read_text())["first_divergent_module"] is None
    assert NO_DIVERGENCE in stdout


def test_an_attention_output_rounded_before_its_de_rotation_names_no_module(tiny):
    path, reference, ids = tiny
    diff = localize(reference, load_bundle(path)[0], ids[:, :24], setting=Setting(patch=BEFORE_DEROPE))
    assert diff["first_divergent_module"] is None and diff["summary"] == NO_DIVERGENCE, diff["summary"]
    moved = [m for m in diff["modules"] if m["module"].endswith(".self_attn") and m["own_err"] > 0]
    assert len(moved) == 5, "the rounding moved no attention: the test plants nothing"
    for m in moved:
        assert m["verdict"] == "reduced precision, within its rounding" and m["precision"] == "bf16", m
        assert m["own_err"] <= m["own_budget"], m
