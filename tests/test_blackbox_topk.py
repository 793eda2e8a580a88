"""Two endpoints that differ only in top-k (``decide.blackbox_topk``, the black box's experiment on
the selection): one test per rule on evidence built the way ``measure.blackbox`` builds it (paired
cells per length), the characterization it feeds, and the ledger's ``topk_endpoint``."""

from __future__ import annotations

import json

import pytest

from needlescope.errors import BadInput
from needlescope.investigate.decide.blackbox import (
    Arch,
    BlackboxContext,
    BlackboxEvidence,
    GridCell,
    characterize_blackbox,
)
from needlescope.investigate.decide.blackbox_topk import (
    PairCell,
    TopkPair,
    entries,
    pair_lengths,
    pair_readings,
    topk_ruled_out,
)
from needlescope.investigate.ledger.init import blackbox_ledger
from needlescope.investigate.ledger.ledger import parse_ledger

ARCH = Arch(ratio=4, topk=16, source="test")
CTX = BlackboxContext(base_url="http://127.0.0.1:8001", served_model="organism", prompt="p.json", needle="n")
GRID = tuple(GridCell(256, d, 2, 2) for d in (0.0, 50.0, 100.0))
# B dense: 191 tokens (47 entries <= 48); both selective: 256 (64 entries) and 384 (96)
DENSE_B, BOTH = 191, (256, 384)


def _pair(*cells: PairCell) -> TopkPair:
    return TopkPair("http://127.0.0.1:8002", 16, 48, 4, "/get_server_info", cells)


def _ch(pair: TopkPair) -> dict:
    # prompt logprobs offered (and the teacher-forced answer wrong): the capture is what is left
    ev = BlackboxEvidence(arch=ARCH, grid=GRID, method="prompt_logprobs", topk_pair=pair)
    return characterize_blackbox(ev, CTX)


def test_the_pairs_lengths_and_regimes():
    assert pair_lengths(4, 16, 48) == [DENSE_B, 384] and entries(DENSE_B, 4) == 47
    rows = pair_readings(_pair(PairCell(384, 12, 9, 2, 7, 0), PairCell(DENSE_B, 12, 6, 0, 6, 0)))
    assert [(r["length"], r["a"], r["b"]) for r in rows] == [
        (DENSE_B, "selective", "dense"),
        (384, "selective", "selective"),
    ]
    assert rows[1]["restores"] and rows[1]["p"] == 2 * 0.5**7


def test_a_loss_the_larger_top_k_keeps_where_it_selects_every_entry_is_outside_selection():
    ch = _ch(_pair(PairCell(DENSE_B, 12, 12, 12, 0, 0), PairCell(256, 10, 10, 10, 0, 0)))
    assert ch["classes"][0] == "outside_selection"
    e = ch["evidence"]["outside_selection"]
    assert e["experiment"].startswith("two endpoints that differ only in top-k (16 vs 48)")
    assert (e["lost"], e["n"], e["p"]) == (12, 12, 0.5**12) and e["capture_adds"]
    # measured (hash_router_table.py): the short dense length loses too; the pair's longer one is named
    both = characterize_blackbox(
        BlackboxEvidence(
            arch=ARCH,
            grid=GRID,
            dense=(GridCell(63, 0.0, 10, 10),),
            topk_pair=_pair(PairCell(DENSE_B, 15, 15, 15, 0, 0)),
        ),
        CTX,
    )
    assert (
        both["where"]["length"] == DENSE_B and "top-k" in both["evidence"]["outside_selection"]["experiment"]
    )
    # four losses of twelve: p = 1/16, not enough
    assert "outside_selection" not in _ch(_pair(PairCell(DENSE_B, 12, 12, 4, 8, 0)))["classes"]


def test_a_loss_the_dense_top_k_restores_rules_out_outside_selection():
    ch = _ch(_pair(PairCell(DENSE_B, 12, 8, 0, 8, 0)))
    assert ch["classes"] == ["undecided"]
    ruled = ch["topk_pair"]["ruled_out"]
    assert set(ruled) == {"outside_selection"} and ruled["outside_selection"]["gained"] == 8
    assert ch["topk_pair"]["narrowed_to"] == ["misaddressed", "needle_excluded", "ranking_uninformative"]
    # five gains of five discordant: McNemar p = 1/16, nothing ruled out
    assert topk_ruled_out(_pair(PairCell(DENSE_B, 12, 5, 0, 5, 0))) == {}


def test_a_loss_the_larger_top_k_restores_where_both_choose_rules_out_needle_excluded():
    ch = _ch(_pair(PairCell(DENSE_B, 12, 8, 0, 8, 0), PairCell(256, 10, 10, 3, 7, 0)))
    out = ch["topk_pair"]
    assert set(out["ruled_out"]) == {"outside_selection", "needle_excluded"}
    assert out["narrowed_to"] == ["misaddressed", "ranking_uninformative"]
    assert ch["classes"] == ["undecided"]
    assert "capture of a failing case decides misaddressed and ranking_uninformative" in ch["undecided"][-1]
    assert "ruled out outside_selection and needle_excluded" in ch["undecided"][-1]
    assert ch["next"].startswith("needlescope indexer capture")
    # the pair was measured: it is no longer listed as missing
    assert not any("topk_endpoint" in u for u in ch["undecided"])


def test_no_case_regained_where_both_choose_while_dense_restores_rules_out_misaddressed():
    # 64 and 96 entries: a chance ranking regains each lost case with p 2/3 and 0.4
    pair = _pair(
        PairCell(DENSE_B, 12, 8, 0, 8, 0), PairCell(256, 10, 10, 10, 0, 0), PairCell(384, 12, 12, 12, 0, 0)
    )
    ch = _ch(pair)
    why = ch["topk_pair"]["ruled_out"]["misaddressed"]
    assert why["p_chance"] == pytest.approx((1 / 3) ** 10 * 0.6**12)
    assert ch["topk_pair"]["narrowed_to"] == ["needle_excluded", "ranking_uninformative"]
    # without the dense restore the loss may be outside the selection: nothing but that is read
    assert "misaddressed" not in topk_ruled_out(_pair(PairCell(256, 10, 10, 10, 0, 0)))
    # two lost cases are too few; one regained is no "none regained"
    assert "misaddressed" not in topk_ruled_out(
        _pair(PairCell(DENSE_B, 12, 8, 0, 8, 0), PairCell(384, 2, 2, 2, 0, 0))
    )
    assert "misaddressed" not in topk_ruled_out(
        _pair(PairCell(DENSE_B, 12, 8, 0, 8, 0), PairCell(256, 10, 10, 9, 1, 0))
    )


def test_without_a_pair_the_top_k_endpoint_is_listed_as_what_would_narrow_it():
    ch = characterize_blackbox(BlackboxEvidence(arch=ARCH, grid=GRID), CTX)
    assert "topk_pair" not in ch and any("topk_endpoint" in u for u in ch["undecided"])


def test_the_pair_round_trips_through_json():
    ev = BlackboxEvidence(arch=ARCH, grid=GRID, topk_pair=_pair(PairCell(DENSE_B, 12, 8, 0, 8, 0)))
    assert BlackboxEvidence.from_json(json.loads(json.dumps(ev.to_json()))) == ev


def test_the_ledgers_topk_endpoint_is_validated(tmp_path):
    symptom = {"kind": "multiturn", "lengths": [256], "depths": [0], "trials": 1, "seed": 0}
    text = blackbox_ledger("http://127.0.0.1:9", "organism", symptom, "", topk_endpoint="http://127.0.0.1:10")
    path = tmp_path / "investigation.toml"
    t = parse_ledger(text, path).target
    assert (t.topk_endpoint, t.topk_endpoint_topk) == ("http://127.0.0.1:10", None)
    with_topk = text.replace("# topk_endpoint_topk = 128", "topk_endpoint_topk = 128")
    assert parse_ledger(with_topk, path).target.topk_endpoint_topk == 128
    bad = {
        'topk_endpoint = "http://127.0.0.1:9"': "is the endpoint itself",
        'topk_endpoint = "127.0.0.1:10"': "expected http://HOST:PORT",
    }
    for line, message in bad.items():
        with pytest.raises(BadInput, match=message):
            parse_ledger(text.replace('topk_endpoint = "http://127.0.0.1:10"', line), path)
    with pytest.raises(BadInput, match=r"expected 1\.\.1048576"):
        parse_ledger(with_topk.replace("topk_endpoint_topk = 128", "topk_endpoint_topk = 0"), path)
    alone = blackbox_ledger("http://127.0.0.1:9", "organism", symptom, "")
    with pytest.raises(BadInput, match="topk_endpoint_topk needs topk_endpoint"):
        parse_ledger(alone.replace("# topk_endpoint_topk = 128", "topk_endpoint_topk = 128"), path)
    live = text.replace('candidate = "blackbox"', 'candidate = "live"')
    with pytest.raises(BadInput, match='topk_endpoint is used only with candidate = "blackbox"'):
        parse_ledger(live, path)


def test_the_pairs_dense_restore_outweighs_a_loss_at_the_short_dense_length():
    # measured (topk_drops_best.py, top-16 vs top-48, CPU): 5 of 10 lost at the 63-token dense
    # length (p = 1/32), 14 of 15 restored by top-48 at 191 tokens
    short = (GridCell(63, 0.0, 10, 5),)
    alone = characterize_blackbox(BlackboxEvidence(arch=ARCH, grid=GRID, dense=short), CTX)
    assert alone["classes"][0] == "outside_selection"
    pair = _pair(PairCell(DENSE_B, 15, 15, 1, 14, 0))
    ch = characterize_blackbox(BlackboxEvidence(arch=ARCH, grid=GRID, dense=short, topk_pair=pair), CTX)
    assert "outside_selection" not in ch["classes"] and "outside_selection" in ch["topk_pair"]["ruled_out"]


def test_init_refuses_a_topk_endpoint_without_live(run_cli, tmp_path):
    code, _, err = run_cli("investigate", "init", str(tmp_path), "--topk-endpoint", "http://127.0.0.1:10")
    assert code == 2 and "--topk-endpoint goes with --live URL" in err


def test_a_restore_pooled_over_every_length_where_the_smaller_chooses_rules_out_outside_selection():
    # measured (key_cache_shift2.py, top-16 vs top-48): 5 of 6 restored where top-48 is dense
    # (p = 0.06), 2 of 6 at 256 and 6 of 12 at 384: pooled 13 gained, none dropped
    pair = _pair(
        PairCell(DENSE_B, 15, 6, 1, 5, 0), PairCell(256, 10, 6, 4, 2, 0), PairCell(384, 15, 12, 6, 6, 0)
    )
    ruled = topk_ruled_out(pair)
    assert (
        ruled["outside_selection"]["lengths"] == [DENSE_B, 256, 384]
        and ruled["outside_selection"]["gained"] == 13
    )
    assert "needle_excluded" in ruled and "misaddressed" not in ruled
    # the dense length alone (p = 0.06) rules nothing out
    assert topk_ruled_out(_pair(PairCell(DENSE_B, 15, 6, 1, 5, 0))) == {}
