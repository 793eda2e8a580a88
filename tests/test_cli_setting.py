"""One Setting end to end: the shared option group, patches run once and last, bad checkpoints and
outputs refused with one line before any model work, and a child server that gets its whole
ServeConfig (hadamard included) across the process boundary."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.cli.main import app  # noqa: E402
from needlescope.dsa.prompt import render_prompt  # noqa: E402
from needlescope.organism.config import TINY_OVERRIDES  # noqa: E402
from needlescope.serve.config import ServeConfig  # noqa: E402
from needlescope.serve.launch import ServerProcess  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

NEEDLE = "The secret code of the red heron is 2617297."

# Records each execution of its body, one line per execution, then patches nothing.
COUNTING_PATCH = """
from pathlib import Path

with open(Path(__file__).with_suffix(".runs"), "a") as f:
    f.write("ran\\n")


def apply(model):
    return None
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """(model dir, [two prompt files holding NEEDLE])."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("cli_setting")
    path = save_random(root / "model", seed=0, **TINY_OVERRIDES)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    files = []
    for case in build_cases(
        CaseSpec("single", (96, 128), (40.0,), 1, 0), lambda m: len(render_prompt(tok, m).input_ids)
    ):
        msgs = [{**m, "content": m["content"].replace(case.needle, NEEDLE)} for m in case.messages]
        f = root / f"prompt{case.length}.json"
        f.write_text(json.dumps(msgs))
        files.append(f)
    return path, files


def _options(*path: str) -> dict:
    """{flag: help} of a command's options."""
    import typer.main

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {p.opts[0]: p.help for p in cmd.params}


def test_every_setting_command_shares_one_option_group():
    flags = ("--index-k", "--index-q", "--score-dtype", "--index-topk", "--patch")
    commands = [("serve",), ("indexer", "rank-dump"), ("indexer", "diff")]
    helps = [{f: _options(*c)[f] for f in flags} for c in commands]
    assert helps[0] == helps[1] == helps[2]
    assert "arbitrary Python" in helps[0]["--patch"]
    sweep = _options("indexer", "sweep")
    assert sweep["--score-dtype"] == helps[0]["--score-dtype"] and sweep["--patch"] == helps[0]["--patch"]
    assert "arbitrary Python" in _options("serve-probe-explain")["--deploy-patch"]


def test_rank_dump_runs_its_patch_once_per_process_however_often_it_is_applied(bundle, tmp_path, run_cli):
    model, prompts = bundle
    patch = tmp_path / "counting.py"
    patch.write_text(COUNTING_PATCH)
    code, _, err = run_cli(
        "indexer", "rank-dump", "--model", str(model), "--prompt", str(prompts[0]), "--prompt", str(prompts[1]),
        "--needle", NEEDLE, "--positions", "90", "--compare-to-reference", "--patch", str(patch),
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 0, err
    # Applied four times (two prompts, each rank dump and stability candidate), executed once.
    assert patch.with_suffix(".runs").read_text().splitlines() == ["ran"]


def test_rank_dump_runs_no_patch_when_another_input_is_bad(bundle, tmp_path, run_cli):
    model, prompts = bundle
    patch = tmp_path / "counting.py"
    patch.write_text(COUNTING_PATCH)
    code, _, err = run_cli(
        "indexer", "rank-dump", "--model", str(model), "--prompt", str(prompts[0]),
        "--needle", "The secret code of the blue whale is 1.", "--patch", str(patch), "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 2 and "not found" in err
    assert not patch.with_suffix(".runs").exists()


def _broken_checkpoints(model, tmp_path):
    not_json = tmp_path / "not_json"
    not_json.mkdir()
    (not_json / "config.json").write_text("{ this is not json")
    (not_json / "model.safetensors").write_bytes(b"")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in model.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {"is not readable JSON": not_json, "not a readable safetensors file": corrupt}


def test_rank_dump_refuses_broken_checkpoints_and_outputs_with_one_line(bundle, tmp_path, run_cli):
    model, prompts = bundle
    base = ["indexer", "rank-dump", "--prompt", str(prompts[0]), "--needle", NEEDLE, "--positions", "90"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad_role = tmp_path / "bad_role.json"
    bad_role.write_text(json.dumps([{"role": "wizard", "content": NEEDLE}]))
    cases = {words: [*base, "--model", str(d), "--out", str(tmp_path / "o")]
             for words, d in _broken_checkpoints(model, tmp_path).items()}  # fmt: skip
    cases["is not a directory"] = [*base, "--model", str(model), "--out", str(a_file)]
    cases["unknown role(s) 'wizard'"] = [
        "indexer", "rank-dump", "--prompt", str(bad_role), "--needle", NEEDLE, "--model", str(model),
        "--out", str(tmp_path / "o"),
    ]  # fmt: skip
    for words, argv in cases.items():
        code, _, err = run_cli(*argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (words, err)
    assert not (tmp_path / "o").exists() and a_file.read_text() == "x"


def test_serve_refuses_a_corrupt_checkpoint_with_one_line(bundle, tmp_path, run_cli):
    model, _ = bundle
    for words, d in _broken_checkpoints(model, tmp_path).items():
        code, _, err = run_cli("serve", "--model", str(d), "--port", "0")
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (words, err)


def test_child_server_gets_its_whole_setting_as_json(bundle):
    model, _ = bundle
    setting = Setting(index_k="fp8_e4m3", index_topk=4, hadamard=True, patch="fault:indexer_key_slot")
    cfg = ServeConfig(model=str(model), port=0, setting=setting, api_key="sekrit-key")
    with ServerProcess(cfg) as srv:
        assert "sekrit-key" not in " ".join(srv.argv)  # the key travels in the environment
        assert httpx.get(srv.url + "/get_server_info", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer sekrit-key"}
        info = httpx.get(srv.url + "/get_server_info", headers=auth, timeout=30).json()
    assert Setting.from_json({k: info["args"][k] for k in setting.to_json()}) == setting
    assert info["args"]["api_key"] is True
    assert info["index_topk"] == 4 and info["patch"] == "fault:indexer_key_slot"


def test_serve_config_json_replaces_every_other_flag(run_cli):
    code, _, err = run_cli("serve", "--config-json", ServeConfig().to_json(), "--port", "9")
    assert code == 2 and "drop --port" in err
