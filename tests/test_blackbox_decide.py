"""The black-box characterization (``decide.blackbox``): one test per rule on evidence built the
way ``measure.blackbox`` builds it, the architecture numbers' sources, and the ledger."""

from __future__ import annotations

import pytest

from needlescope.errors import BadInput
from needlescope.investigate.decide.blackbox import (
    INSIDE_SELECTION,
    Arch,
    BlackboxContext,
    BlackboxEvidence,
    GridCell,
    characterize_blackbox,
    residue_offsets,
)
from needlescope.investigate.ledger.init import blackbox_ledger
from needlescope.investigate.ledger.ledger import parse_ledger
from needlescope.investigate.measure.blackbox import arch_from

ARCH = Arch(ratio=4, topk=64, source="test")
CTX = BlackboxContext(
    base_url="http://127.0.0.1:8001",
    served_model="organism",
    prompt="p.json",
    needle="n",
    lengths=(1024, 2048),
)
DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)


def _grid(lost: dict[tuple[int, float], int], n: int = 2) -> tuple[GridCell, ...]:
    return tuple(GridCell(length, d, n, lost.get((length, d), 0)) for length in (1024, 2048) for d in DEPTHS)


def _all_lost() -> tuple[GridCell, ...]:
    return _grid({(length, d): 2 for length in (1024, 2048) for d in DEPTHS})


def _scan(lose) -> dict[int, list[int]]:
    """length -> [correct, n] at the scan's lengths around 1024 (three depths each)."""
    return {1024 + d: [0 if lose(1024 + d) else 3, 3] for d in [0, *residue_offsets(ARCH)]}


def _ch(**kw) -> dict:
    return characterize_blackbox(BlackboxEvidence(arch=ARCH, **kw), CTX)


def test_no_case_lost_is_nothing_to_explain():
    ch = _ch(grid=_grid({}))
    assert ch["classes"] == ["none"] and ch["next"] is None


def test_outside_selection_from_a_loss_at_the_dense_length():
    dense = tuple(GridCell(255, d, 2, 2) for d in (0.0, 50.0, 100.0))
    ch = _ch(grid=_all_lost(), dense=dense, failing_length=1024, scan=_scan(lambda n: True))
    assert ch["classes"][0] == "outside_selection"
    e = ch["evidence"]["outside_selection"]
    assert e["p"] == 0.5**6 and "dense length 255" in e["experiment"] and e["capture_adds"]
    # five of six lost is p = 1/32 < 0.05 with none lost elsewhere; four is not enough
    assert "outside_selection" not in _ch(grid=_all_lost(), dense=(GridCell(255, 0.0, 6, 4),))["classes"]


def test_length_residue_from_the_scan_names_the_smallest_clean_modulus_after_holm():
    ch = _ch(grid=_all_lost(), failing_length=1024, scan=_scan(lambda n: n % 4 == 0))
    e = ch["evidence"]["length_residue"]
    assert (e["modulus"], e["residue"]) == (4, 0) and e["p_holm"] < 0.05
    assert ch["where"] == {"route": "blackbox", "experiment": e["experiment"], "modulus": 4, "residue": 0}
    # losses at = 0 mod 16 only: mod 4's class holds lengths that do not lose, so 16 is named
    e16 = _ch(grid=_all_lost(), failing_length=1024, scan=_scan(lambda n: n % 16 == 0))["evidence"]
    assert e16["length_residue"]["modulus"] == 16
    # a loss at every length is no residue
    assert (
        "length_residue"
        not in _ch(grid=_all_lost(), failing_length=1024, scan=_scan(lambda n: True))["classes"]
    )


def test_decode_only_when_the_teacher_forced_answer_ranks_first():
    right = {"ranks": [1, 1], "margins": [2.0, 1.5]}
    ch = _ch(grid=_all_lost(), teacher=(right, right, right), method="prompt_logprobs")
    assert ch["classes"][0] == "decode_only" and ch["where"]["path"] == "decode"
    wrong = {"ranks": [1, 3], "margins": [2.0, -0.4]}
    assert "decode_only" not in _ch(grid=_all_lost(), teacher=(right, wrong), method="x")["classes"]
    # echo gives no ranks: the margins decide; one case scored is too few
    echo = {"ranks": [None], "margins": [0.7]}
    assert "decode_only" in _ch(grid=_all_lost(), teacher=(echo, echo), method="echo")["classes"]
    assert "decode_only" not in _ch(grid=_all_lost(), teacher=(right,), method="x")["classes"]


def test_positional_bias_keeps_the_top_ks_reach_graded_a_wider_window():
    # measured (recency_bias.py, 1K/2K, top-64, ratio 4, CPU): depths 0-50 lost at 1K, 0-75 at 2K:
    # kept within 256 tokens of the end (ratio x top-k), lost from 512: the selection piled up there
    recency = _grid({**{(1024, d): 2 for d in (0.0, 25.0, 50.0)}, **{(2048, d): 2 for d in DEPTHS[:4]}})
    ch = _ch(grid=recency)
    assert ch["classes"] == ["positional_bias"], ch
    e = ch["evidence"]["positional_bias"]
    assert (e["end"], e["kept_within"], e["lost_from"], e["reach"]) == ("last", 256, 512, 256)
    assert ch["where"]["kept_within"] == 256
    # measured (stale_far_keys.py, the same grid): depths 0-25 lost at 1K, 0-50 at 2K: kept within
    # 512 tokens, lost from 768: a window wider than the top-k's reach, graded
    stale = _grid({**{(1024, d): 2 for d in (0.0, 25.0)}, **{(2048, d): 2 for d in (0.0, 25.0, 50.0)}})
    ch = _ch(grid=stale)
    assert ch["classes"] == ["graded"], ch
    assert (ch["evidence"]["graded"]["kept_within"], ch["evidence"]["graded"]["lost_from"]) == (512, 768)
    # the same depths lost at every length is no distance from the end: neither
    fraction = _grid({(length, d): 2 for length in (1024, 2048) for d in (0.0, 25.0, 50.0)})
    assert _ch(grid=fraction)["classes"] == ["undecided"]
    # no window, but the loss grows with length: the shortest at most half the longest's rate
    growing = _grid({(1024, 50.0): 1, **{(2048, d): 2 for d in (0.0, 50.0, 100.0)}})
    ch = _ch(grid=growing)
    assert ch["classes"] == ["graded"] and ch["evidence"]["graded"]["shortest"] == [1024, 1, 10]


def test_state_dependent_when_every_failing_case_answers_otherwise_alone():
    ch = _ch(grid=_all_lost(), rerun=3, not_reproduced=3)
    assert ch["classes"][0] == "state_dependent"
    assert "state_dependent" not in _ch(grid=_all_lost(), rerun=3, not_reproduced=2)["classes"]


def test_the_selection_classes_are_undecided_naming_the_capture_as_next():
    # a loss spread over lengths and depths alike, no dense loss, no residue, teacher-forced wrong
    spread = _grid({(length, d): 1 for length in (1024, 2048) for d in DEPTHS})
    wrong = {"ranks": [4], "margins": [-1.0]}
    ch = _ch(
        grid=spread,
        dense=(GridCell(255, 0.0, 6, 0),),
        failing_length=1024,
        scan=_scan(lambda n: n % 2 == 0),
        teacher=(wrong, wrong),
        method="prompt_logprobs",
    )
    assert ch["classes"] == ["undecided"]
    assert any("indexer capture" in u and all(c in u for c in INSIDE_SELECTION) for u in ch["undecided"])
    assert any("differ only in top-k" in u for u in ch["undecided"])
    assert ch["next"].startswith("needlescope indexer capture --sglang http://127.0.0.1:8001 --prompt p.json")
    # without logprobs, decode_only is what is missing first; without the architecture, the dense length
    assert "needlescope probe" in _ch(grid=spread)["next"] and "--graded" in _ch(grid=spread)["next"]
    no_arch = characterize_blackbox(BlackboxEvidence(arch=Arch(None, None), grid=spread), CTX)
    assert "--config" in no_arch["undecided"][0]


def test_evidence_round_trips_through_json():
    ev = BlackboxEvidence(
        arch=ARCH,
        grid=_all_lost(),
        failing_length=1024,
        scan=_scan(lambda n: True),
        teacher=({"ranks": [1]},),
    )
    import json

    assert BlackboxEvidence.from_json(json.loads(json.dumps(ev.to_json()))) == ev


def test_architecture_from_server_info_else_config_json():
    config = {
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "index_topk": 2048,
    }
    a = arch_from({"index_topk": 64, "prefill_chunk": None}, config)
    assert (a.ratio, a.topk, a.dense_length) == (4, 64, 255)
    assert a.source == "ratio from config.json, index_topk from /get_server_info"
    # vLLM: no /get_server_info; DeepSeek-V4-Flash lists a ratio per layer (0: no compression)
    b = arch_from(None, {"compress_ratios": [0, 4, 128, 4], "index_topk": 2048})
    assert (b.ratio, b.topk) == (4, 2048)
    sg = arch_from({"server_args": {"page_size": 64, "chunked_prefill_size": 8192}}, config)
    assert (sg.page_size, sg.chunk_size) == (64, 8192)
    assert arch_from(None, None).dense_length is None


def test_a_blackbox_ledger_parses_and_refuses_checks_and_a_stray_config(tmp_path):
    text = blackbox_ledger(
        "http://127.0.0.1:9",
        "organism",
        {"kind": "multiturn", "lengths": [1024], "depths": [0], "trials": 1, "seed": 0},
        "",
        config="config.json",
    )
    ledger = parse_ledger(text, tmp_path / "investigation.toml")
    assert ledger.target.blackbox and not ledger.target.live and ledger.suspects == ()
    assert (
        ledger.target.config == (tmp_path / "config.json").resolve()
        or ledger.target.config.name == "config.json"
    )
    with_check = (
        text
        + '\n[[suspects]]\nid = "x"\ntier = 1\nhypothesis = "h"\nsetting = "k=fp8_e4m3"\nchecks = ["ablation"]\n'
    )
    with pytest.raises(BadInput, match="cannot be ablated or emulated against"):
        parse_ledger(with_check, tmp_path / "investigation.toml")
    live = text.replace('candidate = "blackbox"', 'candidate = "live"')
    with pytest.raises(BadInput, match='config is used only with candidate = "blackbox"'):
        parse_ledger(live, tmp_path / "investigation.toml")
