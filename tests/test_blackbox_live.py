"""The black-box route against a real endpoint without a capture: ``needlescope serve
--no-indexer-capture`` with a planted decode-path bug it does not disclose (the capture route's
planted set, tests/planted_bugs/). ``investigate init --live`` writes a black-box ledger (it
refused such an endpoint before), and ``investigate run`` names the class from the answers and
the server's prompt logprobs alone."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

PLANTED = Path(__file__).parent / "planted_bugs"


@pytest.fixture(scope="module")
def no_capture(organism_server):
    flags = ("--index-k", "fp8_e4m3", "--index-topk", "16", "--threads", "1", "--no-indexer-capture")
    return organism_server(*flags, "--patch", str(PLANTED / "decode_sign_flip.py"), "--undisclosed-patch")


def test_the_switch_turns_the_capture_off(no_capture):
    info = httpx.get(f"{no_capture}/get_server_info", timeout=30).json()
    assert info["enable_return_indexer_topk"] is False and info["patch"] is None
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "return_indexer_topk": True}
    r = httpx.post(f"{no_capture}/generate", json=body, timeout=60)
    assert r.status_code == 400 and "capture is off" in r.text, r.text


def test_a_decode_path_bug_is_decode_only_from_outside(no_capture, run_cli, tmp_path):
    from needlescope.dsa.checkpoint import resolve_model_dir

    config = resolve_model_dir("organism") / "config.json"
    code, out, err = run_cli(
        "investigate", "init", str(tmp_path), "--live", no_capture, "--config", str(config)
    )
    assert code == 0, err
    ledger = tmp_path / "investigation.toml"
    text = ledger.read_text()
    assert (
        'candidate = "blackbox"' in text and 'config = "config.json"' in text and "[[suspects]]" not in text
    )
    # small and cheap: 256 tokens (64 entries past top-16), three depths
    text = text.replace("lengths = [1024, 2048]", "lengths = [256]").replace("trials = 2", "trials = 1")
    ledger.write_text(text.replace("depths = [0, 25, 50, 75, 100]", "depths = [0, 50, 100]"))
    code, out, err = run_cli("investigate", "run", str(ledger), "--out", str(tmp_path / "out"))
    assert code == 0, err
    v = json.loads((tmp_path / "out" / "verdicts.json").read_text())
    ch = v["characterization"]
    assert ch["classes"][0] == "decode_only", ch["text"]
    e = ch["evidence"]["decode_only"]
    assert e["experiment"].startswith("the answer teacher-forced") and e["capture_adds"]
    assert v["root_cause"] is None and v["suspects"] == []
    assert "what kind of bug: decode_only" in " ".join(out.split())
    inv = json.loads((tmp_path / "out" / "investigation.json").read_text())
    assert inv["route"] == "blackbox"
    assert "decided by the answer teacher-forced" in (tmp_path / "out" / "DIAGNOSIS.md").read_text()
