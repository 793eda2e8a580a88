"""The shipped recipe as code: it equals the recorded run's stages, runs them in order, and is deterministic."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from needlescope.errors import BadInput  # noqa: E402
from needlescope.organism.recipe import SHIPPED_STAGES, recipe_configs, train_recipe  # noqa: E402
from needlescope.organism.train import TrainConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORDED = (
    ROOT / "docs" / "organism_runs" / "run5_stage1_training.json",
    ROOT / "src" / "needlescope" / "organism" / "weights" / "training.json",
)


def _as_recorded(cfg: TrainConfig) -> dict:
    d = json.loads(json.dumps(asdict(cfg), default=list))
    d.pop("init_from")
    return d


def test_shipped_stages_are_the_configs_of_the_run_that_made_the_shipped_weights(tmp_path):
    plan = recipe_configs(tmp_path)
    assert [target for target, _ in plan] == [tmp_path / "stage1", tmp_path]
    assert plan[0][1].init_from is None and plan[1][1].init_from == str(tmp_path / "stage1")
    for (_, cfg), path in zip(plan, RECORDED, strict=True):
        recorded = json.loads(path.read_text())["config"]
        assert (recorded.pop("init_from") is None) == (cfg.init_from is None)
        assert _as_recorded(cfg) == recorded


def test_recipe_runs_stages_in_order_casts_to_bf16_and_repeats_bit_for_bit(tmp_path, tiny_train):
    stages = (
        ("first", TrainConfig(**tiny_train, steps_dense=2, steps_distil=1)),
        ("second", TrainConfig(**tiny_train, steps_dense=1, steps_distil=1, lr=2e-3)),
    )
    done = train_recipe(tmp_path / "a", device="cpu", stages=stages)
    assert [s["out"] for s in done["stages"]] == [str(tmp_path / "a" / "first"), str(tmp_path / "a")]
    second = json.loads((tmp_path / "a" / "training.json").read_text())
    assert second["config"]["init_from"] == str(tmp_path / "a" / "first")
    final = load_file(tmp_path / "a" / "model.safetensors")
    first = load_file(tmp_path / "a" / "first" / "model.safetensors")
    assert {v.dtype for v in final.values() if v.is_floating_point()} == {torch.bfloat16}
    assert torch.float32 in {v.dtype for v in first.values()}
    assert any(not torch.equal(first[k].to(torch.bfloat16), final[k]) for k in final)  # stage 2 trained
    train_recipe(tmp_path / "b", device="cpu", stages=stages)
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_cli_without_recipe_flags_refuses_cuda_it_does_not_have(tmp_path, run_cli_completed):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    res = run_cli_completed("organism", "train", "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "CUDA is not available" in res.stderr and len(res.stderr.splitlines()) == 1


def test_cli_dispatches_to_the_recipe_or_to_one_stage(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import needlescope.organism.recipe as recipe
    import needlescope.organism.train as train_mod
    from needlescope.cli.main import app

    calls = []
    monkeypatch.setattr(
        recipe, "train_recipe", lambda out, **kw: calls.append(("recipe", kw)) or {"stages": [], "wall_s": 0}
    )
    monkeypatch.setattr(
        train_mod, "train", lambda cfg, out, **kw: calls.append(("stage", cfg)) or {"steps": {}, "wall_s": 0}
    )
    runner = CliRunner()
    assert (
        runner.invoke(
            app, ["organism", "train", "--out", str(tmp_path), "--device", "cpu", "--seed", "3"]
        ).exit_code
        == 0
    )
    assert calls[-1] == (
        "recipe",
        {"seed": 3, "device": "cpu", "workers": None, "on_log": calls[-1][1]["on_log"]},
    )
    args = [
        "organism",
        "train",
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--steps-dense",
        "5",
        "--workers",
        "0",
    ]
    assert runner.invoke(app, args).exit_code == 0
    kind, cfg = calls[-1]
    assert kind == "stage" and cfg.steps_dense == 5 and cfg.workers == 0 and cfg.seed == 0
    assert SHIPPED_STAGES[0][1].steps_dense != 5


def test_cli_recipe_flags_reach_the_stage_config_converted(tmp_path, monkeypatch):
    """Every recipe flag given becomes its TrainConfig field (paths, KEY=INT and weight lists converted)."""
    from typer.testing import CliRunner

    import needlescope.organism.train as train_mod
    from needlescope.cli.main import app
    from needlescope.dsa.checkpoint import shipped_dir

    calls = []
    monkeypatch.setattr(
        train_mod, "train", lambda cfg, out, **kw: calls.append(cfg) or {"steps": {}, "wall_s": 0}
    )
    args = ["organism", "train", "--out", str(tmp_path), "--device", "cpu", "--lr", "0.002"]
    init = shipped_dir()  # --init-from must name a real DeepSeek-V4 checkpoint (checked before training)
    args += ["--init-from", str(init), "--config-override", "hidden_size=64"]
    args += ["--config-override", "num_hidden_layers=3", "--kind-weights", "1,2,3,4,5"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    (cfg,) = calls
    assert cfg.lr == 0.002 and cfg.init_from == str(init)
    assert cfg.config_overrides == {"hidden_size": 64, "num_hidden_layers": 3}
    assert cfg.kind_weights == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert cfg.steps_dense == TrainConfig().steps_dense  # a flag not given keeps its default
    bad = CliRunner().invoke(
        app, ["organism", "train", "--out", str(tmp_path), "--device", "cpu", "--config-override", "x"]
    )
    assert isinstance(bad.exception, BadInput) and "KEY=INT" in str(bad.exception)  # main() maps it to exit 2
