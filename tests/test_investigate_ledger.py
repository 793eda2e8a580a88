"""The investigation ledger: the example parses; malformed ledgers name file and line and exit 2."""

from __future__ import annotations

import pytest

from needlescope.errors import BadInput
from needlescope.investigate.ledger.example import EXAMPLE_LEDGER, write_example
from needlescope.investigate.ledger.ledger import load_ledger, parse_ledger


def test_example_ledger_parses(tmp_path):
    ledger = load_ledger(write_example(tmp_path))
    assert len(ledger.suspects) == 8
    assert sorted({s.tier for s in ledger.suspects}) == [1, 2, 3]
    assert [s.tier for s in ledger.ordered_suspects()] == sorted(s.tier for s in ledger.suspects)
    by = {s.id: s for s in ledger.suspects}
    assert by["index_keys_fp8"].setting_fields == (("index_k", "fp8_e4m3"),)
    assert by["index_topk"].setting_fields == (("index_topk", 64),)
    assert by["triton_paged_indexer"].patch.spec == "fault:indexer_page_table"
    assert by["hc_mix_bf16"].patch.path == (tmp_path / "patches" / "hc_mix_bf16.py").resolve()
    assert ledger.target.candidate.index_topk == 64 and ledger.target.candidate.patch.is_fault


def _bad(tmp_path, text: str) -> str:
    path = tmp_path / "investigation.toml"
    write_example(tmp_path, force=True)
    path.write_text(text)
    with pytest.raises(BadInput) as exc:
        load_ledger(path)
    return str(exc.value)


def test_toml_syntax_error_names_the_line(tmp_path):
    text = EXAMPLE_LEDGER.replace('id = "routed_scaling"', 'id = "routed_scaling')
    line = text.splitlines().index('id = "routed_scaling') + 1
    msg = _bad(tmp_path, text)
    assert f"investigation.toml:{line}:" in msg and "not valid TOML" in msg


def test_unknown_question_type_is_refused_with_its_line(tmp_path):
    text = EXAMPLE_LEDGER.replace('type = "config"               # Q2', 'type = "registry"             # Q2')
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith('type = "registry"'))
    msg = _bad(tmp_path, text)
    assert f":{line}:" in msg and "unknown question type 'registry'" in msg and "server_info" in msg


def test_unknown_check_type_is_refused(tmp_path):
    msg = _bad(tmp_path, EXAMPLE_LEDGER.replace('checks = ["audit:routed_scale"]', 'checks = ["audit:nope"]'))
    assert "unknown check type 'audit:nope'" in msg and "ablation" in msg


def test_a_check_twice_an_unknown_kind_or_device_is_refused_with_its_line(tmp_path):
    """They passed parsing: the duplicate check would record its evidence twice, and the kind and
    the device were refused only when the run started, without FILE:LINE."""
    msg = _bad(
        tmp_path,
        EXAMPLE_LEDGER.replace(
            'checks = ["audit:routed_scale"]', 'checks = ["audit:routed_scale", "audit:routed_scale"]'
        ),
    )
    assert "investigation.toml:" in msg and "checks name audit:routed_scale more than once" in msg
    msg = _bad(tmp_path, EXAMPLE_LEDGER.replace('kind = "multiturn"', 'kind = "nope"', 1))
    assert "investigation.toml:" in msg and "kind = 'nope'; expected one of" in msg
    msg = _bad(tmp_path, EXAMPLE_LEDGER.replace('device = "cpu"', 'device = "tpu"', 1))
    assert "investigation.toml:" in msg and "device = 'tpu'" in msg


def test_missing_key_and_duplicate_id(tmp_path):
    msg = _bad(
        tmp_path, EXAMPLE_LEDGER.replace('hypothesis = "the rewritten MoE', 'hypo = "the rewritten MoE')
    )
    assert "missing key 'hypothesis'" in msg or "unknown key" in msg
    msg = _bad(tmp_path, EXAMPLE_LEDGER.replace('id = "decode_splitk"', 'id = "hc_mix_bf16"'))
    assert "appears twice" in msg


def test_bad_setting_and_patch(tmp_path):
    assert "fp7" in _bad(tmp_path, EXAMPLE_LEDGER.replace('setting = "k=fp8_e4m3"', 'setting = "k=fp7"'))
    assert "does not exist" in _bad(
        tmp_path, EXAMPLE_LEDGER.replace("patches/hc_mix_bf16.py", "patches/missing.py")
    )
    assert "needs exactly one of patch" in _bad(
        tmp_path,
        EXAMPLE_LEDGER.replace(
            'setting = "acc=bf16"', 'setting = "acc=bf16"\npatch = "fault:indexer_key_slot"'
        ),
    )


def test_parse_needs_target_and_suspects(tmp_path):
    with pytest.raises(BadInput, match="missing \\[target\\]"):
        parse_ledger("[symptom]\nlengths=[256]\n", tmp_path / "x.toml")


def test_cli_malformed_ledger_exits_2(tmp_path, run_cli):
    write_example(tmp_path)
    (tmp_path / "investigation.toml").write_text(EXAMPLE_LEDGER.replace("tier = 2", 'tier = "two"', 1))
    code, _, err = run_cli(
        "investigate", "run", str(tmp_path / "investigation.toml"), "--out", str(tmp_path / "o")
    )
    assert code == 2 and "investigation.toml:" in err and "tier" in err


def test_cli_init_writes_and_refuses_to_overwrite(tmp_path, run_cli):
    code, out, _ = run_cli("investigate", "init", str(tmp_path))
    assert code == 0 and (tmp_path / "investigation.toml").read_text() == EXAMPLE_LEDGER
    assert (tmp_path / "patches" / "routed_scale_twice.py").is_file()
    code, _, err = run_cli("investigate", "init", str(tmp_path))
    assert code == 2 and "--force" in err


def test_live_candidate_needs_an_endpoint_and_live_checks(tmp_path):
    live = EXAMPLE_LEDGER.replace(
        'candidate = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"',
        'candidate = "live"',
    )
    msg = _bad(tmp_path, live)
    assert 'candidate = "live" needs endpoint' in msg and "investigation.toml:" in msg
    with_url = live.replace('endpoint = ""', 'endpoint = "http://127.0.0.1:9"')
    msg = _bad(tmp_path, with_url)  # the example's suspects ask for ablation
    assert "check 'ablation' needs an in-process candidate" in msg and "live_emulation" in msg
    ok = with_url.replace('"ablation"', '"live_emulation"')
    path = tmp_path / "investigation.toml"
    path.write_text(ok)
    ledger = load_ledger(path)
    assert ledger.target.live and ledger.target.candidate is None
    back = ok.replace('candidate = "live"', 'candidate = "k=fp8_e4m3 topk=64"')
    assert "check 'live_emulation' needs candidate" in _bad(tmp_path, back)


def test_prefill_chunk_is_a_validated_target_field(tmp_path):
    assert load_ledger(write_example(tmp_path)).target.prefill_chunk is None  # one pass by default
    path = tmp_path / "investigation.toml"
    path.write_text(EXAMPLE_LEDGER.replace("threads = 2", "threads = 2\nprefill_chunk = 1024", 1))
    assert load_ledger(path).target.prefill_chunk == 1024
    for bad, says in (
        ("0", "prefill_chunk = 0; expected 1..1048576"),
        ('"1K"', "a positive number of tokens"),
    ):
        text = EXAMPLE_LEDGER.replace("threads = 2", f"threads = 2\nprefill_chunk = {bad}", 1)
        line = text.splitlines().index(f"prefill_chunk = {bad}") + 1
        msg = _bad(tmp_path, text)
        assert f"investigation.toml:{line}:" in msg and says in msg, msg


def test_cli_prefill_chunk_is_validated_before_anything_runs(tmp_path, run_cli):
    write_example(tmp_path)
    code, _, err = run_cli(
        "investigate",
        "run",
        str(tmp_path / "investigation.toml"),
        "--out",
        str(tmp_path / "o"),
        "--prefill-chunk",
        "0",
    )
    assert code == 2 and "chunk must be a positive number" in err and not (tmp_path / "o").exists()


def _blackbox_text(extra: str = "", **target) -> str:
    from needlescope.investigate.ledger.init import blackbox_ledger

    symptom = {"kind": "multiturn", "lengths": [256], "depths": [0], "trials": 1, "seed": 0}
    return blackbox_ledger("http://127.0.0.1:9", "organism", symptom, "", **target) + extra


def test_a_blackbox_plan_and_served_model_are_typed_and_checked(tmp_path):
    path = tmp_path / "investigation.toml"
    plain = parse_ledger(_blackbox_text(), path)
    assert (plain.blackbox.dense_cases, plain.blackbox.failing_cases, plain.blackbox.scan_depths) == (6, 3, 3)
    assert plain.target.served_model is None
    text = _blackbox_text("[blackbox]\nfailing_cases = 2\nscan_depths = 1\n", served_model="/srv/model")
    ledger = parse_ledger(text, path)
    assert ledger.blackbox.to_json() == {"dense_cases": 6, "failing_cases": 2, "scan_depths": 1}
    assert ledger.target.served_model == "/srv/model"
    for extra, says in (
        ("[blackbox]\ndense_cases = 4\n", "dense_cases = 4; expected 5..1000"),  # 4 losses: p 1/16
        ("[blackbox]\nfailing_cases = 1\n", "failing_cases = 1; expected 2..100"),
        ("[blackbox]\nscan_depths = 2.5\n", "scan_depths = 2.5; expected an integer in 1..100"),
        (
            "[blackbox]\nscan_depth = 2\n",
            "unknown key 'scan_depth' in [blackbox] (did you mean 'scan_depths'?)",
        ),
        ("[blackbx]\n", "unknown top-level key(s) blackbx (did you mean 'blackbox'?)"),
    ):
        with pytest.raises(BadInput, match="investigation.toml:") as exc:
            parse_ledger(_blackbox_text(extra), path)
        assert says in str(exc.value)
    # the line named is the key's
    with pytest.raises(BadInput) as exc:
        parse_ledger(_blackbox_text("[blackbox]\nfailing_cases = 2\nscan_depths = 0\n"), path)
    assert f"investigation.toml:{len(_blackbox_text().splitlines()) + 3}:" in str(exc.value)


def test_blackbox_keys_are_refused_on_other_routes(tmp_path):
    path = tmp_path / "investigation.toml"
    suspect = '[[suspects]]\nid = "x"\ntier = 1\nhypothesis = "h"\nsetting = "k=fp8_e4m3"\nchecks = ["live_emulation"]\n'
    live = _blackbox_text("[blackbox]\nscan_depths = 2\n" + suspect).replace(
        'candidate = "blackbox"', 'candidate = "live"'
    )
    with pytest.raises(BadInput, match=r'\[blackbox\] is used only with candidate = "blackbox"'):
        parse_ledger(live, path)
    served = _blackbox_text(served_model="m").replace('candidate = "blackbox"', 'candidate = "live"')
    with pytest.raises(BadInput, match='served_model is used only with candidate = "blackbox"'):
        parse_ledger(served, path)
    with pytest.raises(BadInput, match="served_model is empty"):
        parse_ledger(_blackbox_text().replace("[symptom]", 'served_model = " "\n[symptom]', 1), path)
