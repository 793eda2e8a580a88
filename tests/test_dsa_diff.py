"""Differential localization on a tiny random DeepSeek-V4: broken modules are found where they were broken."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.haystack import VOCABULARY  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.diff import (  # noqa: E402
    DIFF_SCHEMA,
    localize,
    rel_err,
    render_diff_md,
    selection_error,
    selection_recall,
    swappable_fraction,
)
from needlescope.dsa.diff_md import trivial_selection_note  # noqa: E402
from needlescope.dsa.emulate import csa_indexers  # noqa: E402
from needlescope.dsa.prompt import needle_token_span, render_prompt  # noqa: E402
from needlescope.schema import check_schema  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402

NEEDLE = "The secret code is 4815927."


def _prompt_text(n_before: int = 30, n_after: int = 30) -> str:
    words = list(VOCABULARY)
    return (
        " ".join(words[:n_before])
        + f" {NEEDLE} "
        + " ".join(words[n_before : n_before + n_after])
        + " What is the secret code?"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # index_topk=4 is well below the ~20 visible entries, so the indexer really chooses.
    return save_random(tmp_path_factory.mktemp("tiny_v4"), seed=1, hidden_size=64, index_topk=4)


@pytest.fixture(scope="module")
def pair(tiny):
    ref, tok, _ = load_bundle(tiny)
    prompt = render_prompt(tok, [{"role": "user", "content": _prompt_text()}])
    span = needle_token_span(prompt, NEEDLE)
    ids = torch.tensor([prompt.input_ids])
    return ref, lambda: load_bundle(tiny)[0], ids, span


def _patch(tmp_path, body: str):
    path = tmp_path / "patch.py"
    path.write_text(textwrap.dedent(body))
    return path


def _by_name(result: dict) -> dict:
    return {m["module"]: m for m in result["modules"]}


@pytest.fixture(scope="module")
def noop_result(pair, tmp_path_factory):
    ref, fresh, ids, span = pair
    cand = fresh()
    patch = _patch(tmp_path_factory.mktemp("noop"), "def apply(model):\n    return None\n")
    return localize(ref, cand, ids, setting=Setting(patch=patch), needle_span=span)


def test_noop_patch_is_bit_identical(noop_result):
    result = noop_result
    assert result["first_divergent_module"] is None
    assert all(m["rel_err"] == 0.0 for m in result["modules"])
    assert all(r["topk_overlap"] == 1.0 for r in result["layers"])
    assert all(r["needle_rank_reference"] == r["needle_rank_candidate"] for r in result["layers"])
    assert result["unmatched"] == {"reference_only": [], "candidate_only": []}
    check_schema(json.loads(json.dumps(result)), DIFF_SCHEMA, "diff")


def test_forward_order_and_hc_streams(pair, noop_result):
    ref = pair[0]
    result = noop_result
    names = [m["module"] for m in result["modules"]]
    n_layers = ref.config.num_hidden_layers
    for i in range(n_layers):
        start, end = names.index(f"model.layers.{i}.hc_streams_in"), names.index(f"model.layers.{i}")
        assert start < names.index(f"model.layers.{i}.attn_hc") < names.index(f"model.layers.{i}.self_attn")
        assert names.index(f"model.layers.{i}.self_attn") < names.index(f"model.layers.{i}.mlp") < end
    assert names.index("model.embed_tokens") < names.index("model.layers.0.hc_streams_in")
    assert names.index(f"model.layers.{n_layers - 1}") < names.index("model.norm") < names.index("lm_head")
    # Children return before their parent.
    assert names.index("model.layers.1.self_attn.compressor.indexer.scorer") < names.index(
        "model.layers.1.self_attn.compressor.indexer"
    )
    kinds = {m["module"]: m["kind"] for m in result["modules"]}
    assert (
        kinds["model.layers.0"] == "hc_streams_out"
        and kinds["model.layers.0.hc_streams_in"] == "hc_streams_in"
    )


def test_scaled_mlp_is_the_first_divergent_module(pair, tmp_path):
    ref, fresh, ids, span = pair
    cand = fresh()
    patch = _patch(
        tmp_path,
        """
        def apply(model):
            handle = model.model.layers[3].mlp.register_forward_hook(lambda mod, args, out: out * 1.5)
            return handle.remove
        """,
    )
    result = localize(ref, cand, ids, setting=Setting(patch=patch), needle_span=span)
    assert result["first_divergent_module"] == "model.layers.3.mlp"
    names = [m["module"] for m in result["modules"]]
    at = names.index("model.layers.3.mlp")
    assert all(m["rel_err"] == 0.0 for m in result["modules"][:at])
    mlp = result["modules"][at]
    assert mlp["in_err"] == 0.0 and mlp["rel_err"] > mlp["expected_rel_err"]
    # Layer 3's indexer runs before its MLP, so every CSA layer still selects identically.
    assert all(r["topk_overlap"] == 1.0 for r in result["layers"])
    # The hook is gone afterwards: the candidate runs clean again.
    again = localize(ref, cand, ids, setting=Setting(patch=_patch(tmp_path, "def apply(m):\n    pass\n")))
    assert again["first_divergent_module"] is None
    # That patch returned no undo: its pristine copy (dsa.pristine) restored the candidate, so it
    # runs again, clean.
    third = localize(ref, cand, ids, setting=Setting(index_k="bf16"))
    assert third["first_divergent_module"] is None


def test_buggy_scorer_is_found_in_its_indexer(pair, tmp_path):
    ref, fresh, ids, span = pair
    cand = fresh()
    patch = _patch(
        tmp_path,
        """
        def apply(model):
            scorer = model.model.layers[3].self_attn.compressor.indexer.scorer
            good = scorer.forward

            def buggy(q, compressed_kv, hidden_states):
                return -good(q, compressed_kv, hidden_states)  # sign bug: picks the worst entries

            scorer.forward = buggy

            def undo():
                scorer.forward = good

            return undo
        """,
    )
    result = localize(ref, cand, ids, setting=Setting(patch=patch), needle_span=span)
    assert result["first_divergent_module"] == "model.layers.3.self_attn.compressor.indexer.scorer"
    layers = {r["layer"]: r for r in result["layers"]}
    assert layers[1]["topk_overlap"] == 1.0
    assert layers[3]["topk_overlap"] < 1.0


def test_fp4_is_within_precision_and_what_reads_it_is_explained(pair):
    ref, fresh, ids, span = pair
    cand = fresh()
    result = localize(
        ref, cand, ids, setting=Setting(index_k="fp4_e2m1", index_q="fp4_e2m1"), needle_span=span
    )
    csa = [layer for layer, _ in csa_indexers(ref)]
    # Emulated precision is not a fault: nothing diverges, and the summary says so.
    assert result["first_divergent_module"] is None
    assert result["summary"] == "no module diverges beyond what its precision explains"
    mods = _by_name(result)
    names = [m["module"] for m in result["modules"]]
    scorer = f"model.layers.{csa[0]}.self_attn.compressor.indexer.scorer"
    # Everything before the first indexer is bit-identical; the scorer's own error is fp4's.
    assert all(m["rel_err"] == 0.0 for m in result["modules"][: names.index(scorer)])
    assert mods[scorer]["verdict"] == "within precision"
    assert 0 < mods[scorer]["own_err"] <= mods[scorer]["own_budget"]
    assert min(r["topk_overlap"] for r in result["layers"]) < 1.0
    # The attention reads the changed selection: it moves, and its own code explains none of it.
    attn = mods[f"model.layers.{csa[0]}.self_attn"]
    assert attn["rel_err"] > 0 and attn["own_err"] == 0.0 and attn["verdict"] in ("explained", "ok")
    assert "explained" in {m["verdict"] for m in result["modules"]}
    assert all(isinstance(r["needle_rank_candidate"], int) for r in result["layers"])
    md = render_diff_md(result)
    assert "No module diverges" in md and "| layer |" in md


def test_rel_err_edge_cases():
    a = torch.tensor([1.0, float("-inf"), 3.0])
    assert rel_err(a.clone(), a) == 0.0
    assert rel_err(torch.tensor([1.0, 0.0, 3.0]), a) == math.inf
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_err(torch.ones(3), torch.zeros(3)) == math.inf
    ref = torch.tensor([3.0, 4.0])
    assert rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.5 / 5.0)
    assert rel_err(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == 0.25
    assert rel_err(torch.zeros(2), torch.zeros(3)) == math.inf


def test_selection_recall_ignores_padding_and_order():
    ref = torch.tensor([[0, 1, 2], [3, 1, -1], [-1, -1, -1]])
    cand = torch.tensor([[2, 1, 0], [3, 5, -1], [-1, -1, -1]])
    recall, changed, counted = selection_recall(cand, ref)
    assert counted == 2  # the all-padding row has nothing to recall
    assert changed == 1
    assert recall == pytest.approx((1.0 + 0.5) / 2)


def test_selection_error_counts_additions_and_drops():
    ref = torch.tensor([[0, 1, -1], [3, 1, -1], [-1, -1, -1]])
    cand = torch.tensor([[0, 1, 2], [3, 1, -1], [-1, -1, -1]])  # row 0 gains entry 2
    err, changed, counted = selection_error(cand, ref)
    assert (changed, counted) == (1, 2)
    assert err == pytest.approx((1 / 3 + 0) / 2)
    assert selection_recall(cand, ref)[0] == 1.0  # recall alone cannot see an addition


def test_swappable_fraction_counts_near_ties_only():
    # Row: selected scores 10, 9 (k=2); unselected 8.9 and 1. With delta 0.1 the 9 and the 8.9
    # can swap (one selection at risk); with a huge delta both selections are at risk but
    # only two outsiders exist.
    scores = torch.tensor([[10.0, 9.0, 8.9, 1.0]])
    vis = torch.tensor([4])
    assert swappable_fraction(scores, vis, 2, torch.tensor([0.0])) == 0.0
    assert swappable_fraction(scores, vis, 2, torch.tensor([0.1])) == pytest.approx(1 / 2)
    assert swappable_fraction(scores, vis, 2, torch.tensor([100.0])) == pytest.approx(2 / 2)
    # A row with every entry selected cannot lose any.
    assert swappable_fraction(scores, torch.tensor([2]), 2, torch.tensor([100.0])) == 0.0


# ------------------------------------------------------------------------------------ CLI


def test_cli_diff_writes_json_and_md(tiny, tmp_path, run_cli):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(_prompt_text())
    out = tmp_path / "out"
    code, stdout, err = run_cli("indexer", "diff", "--model", str(tiny), "--prompt", str(prompt),
        "--needle", NEEDLE, "--index-k", "fp8_e4m3", "--index-q", "bf16", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    obj = json.loads((out / "diff.json").read_text())
    check_schema(obj, DIFF_SCHEMA, "diff")
    assert obj["numerics"]["index_k"] == "fp8_e4m3" and obj["numerics"]["index_q"] == "bf16"
    assert obj["prompt_tokens"] > 0 and obj["patch"] is None
    assert [r["layer"] for r in obj["layers"]] == [1, 3]
    assert "Differential localization" in (out / "diff.md").read_text()
    assert "first divergent module" in stdout
    # Issue 38, item 14: where the top-k holds every entry the overlap of 1 is said to be trivial.
    entries = obj["prompt_tokens"] // 4
    trivial = [r["layer"] for r in obj["layers"] if min(r["k_reference"], r["k_candidate"]) >= entries]
    said = "The comparison of selection is trivial" in stdout.replace("\n", " ")
    assert said == bool(trivial), (trivial, stdout)
    assert said == ("The comparison of selection is trivial" in (out / "diff.md").read_text())


def test_trivial_selection_is_named_per_layer():
    def layer(n: int, k: int) -> dict:
        return {"layer": n, "index_topk": k, "k_reference": k, "k_candidate": k}

    obj = {"prompt_tokens": 512, "layers": [layer(1, 2048), layer(3, 64)]}
    note = trivial_selection_note(obj)
    assert note.startswith("The comparison of selection is trivial in layer 1: the top-k holds all 128")
    assert "--index-topk below 128" in note
    assert trivial_selection_note({"prompt_tokens": 512, "layers": [layer(1, 127)]}) is None


@pytest.mark.parametrize(
    "extra, needle, fragment",
    [
        (["--index-k", "fp8_e5m2"], NEEDLE, "unknown key precision"),
        (["--index-k", "fp8_e4m3"], "a needle that is not there", "not found"),
        ([], NEEDLE, "candidate equals the reference"),
        (["--score-dtype", "fp64"], NEEDLE, "unknown score dtype"),
    ],
)
def test_cli_diff_bad_input_exits_2(tiny, tmp_path, run_cli, extra, needle, fragment):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(_prompt_text())
    code, _, err = run_cli("indexer", "diff", "--model", str(tiny), "--prompt", str(prompt),
        "--needle", needle, "--out", str(tmp_path / "o"), *extra,
    )  # fmt: skip
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1


def test_cli_diff_patch_without_apply_exits_2(tiny, tmp_path, run_cli):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(_prompt_text())
    patch = _patch(tmp_path, "def setup(model):\n    pass\n")
    code, _, err = run_cli("indexer", "diff", "--model", str(tiny), "--prompt", str(prompt),
        "--needle", NEEDLE, "--patch", str(patch), "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 2 and "apply(model)" in err and len(err.strip().splitlines()) == 1


def test_cli_diff_non_deepseek_dir_exits_2(tmp_path, run_cli):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(_prompt_text())
    code, _, err = run_cli("indexer", "diff", "--model", str(model), "--prompt", str(prompt),
        "--needle", NEEDLE, "--index-k", "bf16", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 2 and "DeepSeek-V4" in err and len(err.strip().splitlines()) == 1


def test_cli_prints_call_suffixes_and_records_allow(tiny, tmp_path, run_cli):
    # The query rope is the indexer's second rotary call; break only that one.
    patch = _patch(
        tmp_path,
        """
        def apply(model):
            rope = model.model.layers[1].self_attn.compressor.indexer.rotary_emb
            calls = []

            def hook(mod, args, out):
                calls.append(1)
                return (out[0], -out[1]) if len(calls) % 2 == 0 else out

            return rope.register_forward_hook(hook).remove
        """,
    )
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(_prompt_text())
    out = tmp_path / "out"
    code, stdout, err = run_cli("indexer", "diff", "--model", str(tiny), "--prompt", str(prompt),
        "--needle", NEEDLE, "--patch", str(patch), "--allow", "model.layers.*.attn_hc=bf16", "--out", str(out),
    )  # fmt: skip
    assert code == 1, err  # a divergent module named is a finding (docs/exit_codes.md)
    obj = json.loads((out / "diff.json").read_text())
    name = "model.layers.1.self_attn.compressor.indexer.rotary_emb[call 2]"
    assert obj["first_divergent_module"] == name
    assert obj["allow"] == {"model.layers.*.attn_hc": "bf16"}
    assert f"first divergent module: {name}" in stdout  # console markup did not eat "[call 2]"
    assert name in (out / "diff.md").read_text()


def test_cli_bad_allow_exits_2(tiny, tmp_path, run_cli):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(_prompt_text())
    code, _, err = run_cli("indexer", "diff", "--model", str(tiny), "--prompt", str(prompt),
        "--needle", NEEDLE, "--index-k", "bf16", "--allow", "model.layers.*.attn_hc=fp8", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 2 and "PATTERN=PRECISION" in err and len(err.strip().splitlines()) == 1
