"""``needlescope indexer rank-dump`` / ``sweep`` through the real CLI on a tiny random DeepSeek-V4."""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.prompt import render_prompt  # noqa: E402
from needlescope.dsa.rankdump import validate_rankdump  # noqa: E402
from needlescope.dsa.stability import validate_stability  # noqa: E402
from needlescope.dsa.sweep import validate_sweep  # noqa: E402
from needlescope.organism.config import TINY_OVERRIDES  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

TINY = TINY_OVERRIDES
NEEDLE = "The secret code of the red heron is 2617297."


@pytest.fixture
def cli(run_cli_completed):
    """``needlescope indexer ARGS`` through the real entry point (``main``: exit codes and the
    one-line errors as on the shell), in this process."""
    return functools.partial(run_cli_completed, "indexer")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """(model dir, [prompt files of 128 and 256 tokens holding the same needle])."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("cli_rank")
    path = save_random(root / "model", seed=0, **TINY)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    files = []
    for case in build_cases(
        CaseSpec("single", (128, 256), (40.0,), 1, 0), lambda m: len(render_prompt(tok, m).input_ids)
    ):
        msgs = [{**m, "content": m["content"].replace(case.needle, NEEDLE)} for m in case.messages]
        f = root / f"prompt{case.length}.json"
        f.write_text(json.dumps(msgs))
        files.append(f)
    return path, files


def test_rank_dump_writes_valid_outputs(bundle, tmp_path, cli):
    model, prompts = bundle
    res = cli(
        "rank-dump",
        "--model",
        str(model),
        "--prompt",
        str(prompts[0]),
        "--prompt",
        str(prompts[1]),
        "--needle",
        NEEDLE,
        "--index-k",
        "fp4_e2m1",
        "--index-q",
        "fp8_e4m3",
        "--index-topk",
        "8",
        "--max-new-tokens",
        "3",
        "--compare-to-reference",
        "--out",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    for name in (
        "rankdump.json",
        "rankdump.md",
        "rank_vs_layer.png",
        "margin_vs_length.png",
        "stability.json",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    dump = json.loads((tmp_path / "rankdump.json").read_text())
    validate_rankdump(dump)
    assert [d["label"] for d in dump["prompts"]] == ["prompt128", "prompt256"]
    assert [d["prompt_tokens"] for d in dump["prompts"]] == [128, 256]
    assert dump["index_topk"] == 8 and dump["numerics"]["index_q"] == "fp8_e4m3"
    stab = json.loads((tmp_path / "stability.json").read_text())
    validate_stability(stab)
    assert stab["reference"]["index_k"] == "fp32" and stab["candidate"]["index_k"] == "fp4_e2m1"
    assert len(stab["prompts"]) == 2
    assert "best rank" in res.stdout
    assert "Selection stability" in (tmp_path / "rankdump.md").read_text()


def test_sweep_writes_valid_outputs(bundle, tmp_path, cli):
    model, _ = bundle
    res = cli(
        "sweep",
        "--model",
        str(model),
        "--kind",
        "single",
        "--lengths",
        "128",
        "--depths",
        "50",
        "--index-k",
        "fp32,fp4_e2m1",
        "--index-topk",
        "2,64",
        "--no-generate",
        "--out",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    validate_sweep(sweep)
    assert len(sweep["settings"]) == 4 and sweep["generate"] is False
    assert "## Verdict" in (tmp_path / "sweep.md").read_text()
    assert "cheapest setting" in res.stdout or "no setting" in res.stdout


def test_bad_inputs_exit_2_with_one_line(bundle, tmp_path, cli):
    model, prompts = bundle
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes(b"")
    no_apply = tmp_path / "patch.py"
    no_apply.write_text("def not_apply(model):\n    return None\n")
    base = ["rank-dump", "--prompt", str(prompts[0]), "--out", str(tmp_path / "o")]
    cases = {
        "unknown key precision (index_k) 'fp5'": [
            *base,
            "--model",
            str(model),
            "--needle",
            NEEDLE,
            "--index-k",
            "fp5",
        ],
        "not found": [*base, "--model", str(model), "--needle", "The secret code of the blue whale is 1."],
        "'llama'": [*base, "--model", str(llama), "--needle", NEEDLE],
        "apply(model)": [*base, "--model", str(model), "--needle", NEEDLE, "--patch", str(no_apply)],
    }
    for expect, args in cases.items():
        res = cli(*args)
        err = res.stderr
        assert res.returncode == 2, (expect, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], (expect, err)
    assert not (tmp_path / "o").exists()


def test_rank_dump_compares_two_models(bundle, tmp_path, cli):
    from needlescope.dsa.stability import validate_stability

    model, prompts = bundle
    other = save_random(tmp_path / "other", seed=1, **TINY)
    res = cli(
        "rank-dump",
        "--model",
        str(model),
        "--compare-model",
        str(other),
        "--prompt",
        str(prompts[0]),
        "--needle",
        NEEDLE,
        "--index-topk",
        "4",
        "--max-new-tokens",
        "2",
        "--out",
        str(tmp_path / "out"),
    )
    assert res.returncode == 0, res.stderr
    stab = json.loads((tmp_path / "out" / "stability.json").read_text())
    validate_stability(stab)
    assert stab["reference"]["model"] == str(other) and stab["candidate"]["model"] == str(model)
    # Two differently seeded random models select differently somewhere.
    assert stab["summary"]["mean_recall"] < 1.0


def test_rank_dump_chunked_over_two_devices_writes_the_one_pass_dump(bundle, tmp_path, cli):
    """--chunk and --device cpu,cpu --max-memory (docs/scale.md) leave every rank unchanged; --chunk 0 is refused."""
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.placement import unit_bytes

    model, prompts = bundle
    budget = str(int(sum(n for _, n in unit_bytes(load_bundle(model)[0])) * 0.6))
    base = ["rank-dump", "--model", str(model), "--prompt", str(prompts[1]), "--needle", NEEDLE]
    base += ["--index-topk", "512", "--max-new-tokens", "3"]  # above the 64 entries: no tie-break at the cut
    one = cli(*base, "--out", str(tmp_path / "one"))
    split = cli(
        *base,
        "--chunk",
        "64",
        "--device",
        "cpu,cpu",
        "--max-memory",
        budget,
        "--out",
        str(tmp_path / "two"),
    )
    assert one.returncode == 0 and split.returncode == 0, (one.stderr, split.stderr)
    a = json.loads((tmp_path / "one" / "rankdump.json").read_text())
    b = json.loads((tmp_path / "two" / "rankdump.json").read_text())
    assert a["generated_tokens"] == b["generated_tokens"]
    # float32: the chunked run reduces over fewer masked keys, so scores agree to rounding (exactness
    # is tested in float64 in tests/test_dsa_passes.py); ranks, ties and selection are equal.
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        for pa, pb in zip(la["positions"], lb["positions"], strict=True):
            for key in ("query_pos", "visible_entries", "needle_entries", "best_rank", "ties", "selected"):
                assert pa[key] == pb[key], (la["layer"], key)
            for key in ("needle_score", "cutoff_score", "margin"):
                assert pa[key] == pytest.approx(pb[key], rel=1e-4, abs=1e-6)
    bad = cli(*base, "--chunk", "0", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "chunk must be a positive number" in bad.stderr
