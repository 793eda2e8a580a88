"""The organism demo: serve a DeepSeek-V4 checkpoint twice, probe both, explain the failure.

``run_organism_demo(DemoConfig(model=..., out=...), on_phase)`` runs, in order:

1. **serve**: two real ``needlescope serve`` processes on loopback, one with reference indexer
   numerics (fp32, the checkpoint's ``index_topk``), one with the deployment-like setting
   (numerics plus an optional patch, by default the built-in ``fault:indexer_page_table``);
2. **probe**: ``run_probe`` with multiturn needles against each (``reference/``, ``deployment/``);
3. **rank dump**: the failing case (right under the reference, wrong under the deployment,
   longest length first) is replayed in-process under the deployment numerics (``rankdump.json``);
4. **fixes**: the same case under each candidate fix (``default_fixes``: bf16 keys, larger
   ``index_topk``, and, when the deployment carries a patch, the same numerics without it): is the needle
   selected, is the answer right (``fixes.json``);
5. **report**: ``DIAGNOSIS.md`` from those artifacts (``needlescope.report.diagnosis``).

Every artifact is written through its own documented schema; the report reads only them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from needlescope.dsa.emulate import Numerics, load_patch
from needlescope.errors import BadInput
from needlescope.report.diagnosis import write_diagnosis
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import STORE_NAME, run_probe
from needlescope.run.store import ResultStore
from needlescope.serve.launch import ServerProcess

__all__ = [
    "DemoConfig",
    "Setting",
    "default_fixes",
    "run_organism_demo",
    "explain_failure",
    "pick_failing_case",
    "pick_case_to_explain",
]

Phase = Callable[[str, dict], None]


@dataclass(frozen=True)
class Setting:
    """Indexer numerics plus an optional patch (a Python file or a built-in ``fault:NAME``)."""

    numerics: Numerics
    patch: str | None = None

    def label(self) -> str:
        return self.numerics.label() + (f" patch={self.patch}" if self.patch else "")

    def to_dict(self) -> dict:
        return {"numerics": self.numerics.to_dict(), "patch": self.patch, "label": self.label()}


@dataclass(frozen=True)
class DemoConfig:
    """What the demo probes. ``deployment`` is the setting under suspicion."""

    model: str
    out: Path
    # fp8 keys as SGLang stores them, index_topk 64 (every entry at 256 tokens, 1/16 of them at
    # 4K), and a Triton indexer that reads the paged key cache without the block table:
    # precision and top-k alone cost this organism at most 8 points at 4K; with the fault,
    # recall holds only while top-k covers every entry (docs/organism.md, "Deployment-like settings").
    deployment: Numerics = Numerics(index_k="fp8_e4m3", index_topk=64)
    patch: str | None = "fault:indexer_page_table"
    lengths: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    trials: int = 2
    seed: int = 0
    threads: int = 1
    # None: the digits the checkpoint was trained on (training.json), else the probe's default.
    value_digits: int | None = None
    device: str = "cpu"
    concurrency: int = 2
    fixes: tuple[Setting, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.deployment.index_topk is None:
            raise BadInput("the deployment setting needs an explicit index_topk")
        if self.trials < 1:
            raise BadInput(f"trials must be >= 1, got {self.trials}")
        if self.concurrency < 1:
            raise BadInput(f"concurrency must be >= 1, got {self.concurrency}")
        if self.patch is not None:
            load_patch(self.patch)  # a bad patch fails here, not inside the deployment server

    @property
    def setting(self) -> Setting:
        return Setting(self.deployment, self.patch)

    def fix_candidates(self) -> tuple[Setting, ...]:
        return self.fixes or default_fixes(self.setting)


def default_fixes(d: Setting) -> tuple[Setting, ...]:
    """The fixes tried on a failing case, cheapest first: bf16 keys, ``index_topk`` doubled and
    quadrupled, bf16 keys with the doubled top-k (each keeping the deployment's patch), and,
    when there is a patch, the same numerics without it."""
    n = d.numerics
    bf16 = Numerics(index_k="bf16", index_q=n.index_q, score_dtype=n.score_dtype, index_topk=n.index_topk)
    fixes = [
        Setting(bf16, d.patch),
        Setting(replace(n, index_topk=2 * n.index_topk), d.patch),
        Setting(replace(n, index_topk=4 * n.index_topk), d.patch),
        Setting(replace(bf16, index_topk=2 * n.index_topk), d.patch),
    ]
    if d.patch:
        fixes.append(Setting(n))
    return tuple(fixes)


def serve_args(
    model: str, numerics: Numerics | None, threads: int = 1, device: str = "cpu", patch: str | None = None
) -> list[str]:
    """``needlescope serve`` arguments for ``model`` under ``numerics`` (None: the checkpoint's own)."""
    args = ["--model", model, "--port", "0", "--threads", str(threads), "--served-model-name", "organism"]
    args += ["--device", device]
    if patch:
        args += ["--patch", patch]
    if numerics is not None:
        args += [
            "--index-k",
            numerics.index_k,
            "--index-q",
            numerics.index_q,
            "--score-dtype",
            numerics.score_dtype,
        ]
        if numerics.index_topk is not None:
            args += ["--index-topk", str(numerics.index_topk)]
    return args


def pick_failing_case(reference_rows: list[dict], deployment_rows: list[dict]) -> tuple[str, str]:
    """(case_id, why): the case to explain. Prefers right-under-reference, wrong-under-deployment.

    Longest length first, then the shallowest depth. Falls back to any deployment miss (then
    the reference missed it too, which the report says).
    """
    ref_ok = {r["case_id"] for r in reference_rows if r["status"] == "ok" and r["correct"]}
    misses = [r for r in deployment_rows if r["status"] == "ok" and not r["correct"]]
    if not misses:
        raise ValueError("the deployment answered every case correctly; there is no failure to explain")
    misses.sort(key=lambda r: (-r["length"], r["depth"], r["trial"]))
    for r in misses:
        if r["case_id"] in ref_ok:
            return r["case_id"], "right under the reference numerics, wrong under the deployment setting"
    return misses[0]["case_id"], "wrong under both settings (no deployment-only failure exists)"


def pick_case_to_explain(reference_rows: list[dict], deployment_rows: list[dict]) -> tuple[str, str]:
    """``pick_failing_case``, or, when the deployment missed nothing, its longest case (the one
    with the most entries competing for top-k), so the report still shows the indexer margins."""
    try:
        return pick_failing_case(reference_rows, deployment_rows)
    except ValueError:
        ok = [r for r in deployment_rows if r["status"] == "ok"]
        if not ok:
            raise ValueError("the deployment probe has no scored case to explain") from None
        ok.sort(key=lambda r: (-r["length"], r["depth"], r["trial"]))
        return ok[0]["case_id"], (
            "no probed case failed under the deployment setting; this is its longest case, "
            "shown for the indexer margins"
        )


def _probe(url: str, cfg: DemoConfig, value_digits: int, out: Path, on_event) -> None:
    pcfg = ProbeConfig(
        base_urls=(f"{url}/v1",),
        model="organism",
        kind="multiturn",
        lengths=cfg.lengths,
        depths=cfg.depths,
        trials=cfg.trials,
        seed=cfg.seed,
        out=out,
        concurrency=cfg.concurrency,
        timeout_s=600.0,
        value_digits=value_digits,
    )
    run_probe(pcfg, on_event)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _case(out: Path, case_id: str) -> dict:
    with ResultStore(out / STORE_NAME) as store:
        for c in store.cases():
            if c["case_id"] == case_id:
                return c
    raise KeyError(case_id)


def run_organism_demo(cfg: DemoConfig, on_phase: Phase, on_event=lambda *_: None) -> Path:
    """Run every phase; returns the path of DIAGNOSIS.md. ``on_phase(name, info)`` marks progress."""
    from needlescope.organism.bundle import require_deepseek_v4, resolve_model_dir, trained_value_digits

    path = resolve_model_dir(cfg.model)
    require_deepseek_v4(path)
    digits = cfg.value_digits or trained_value_digits(path)
    cfg.out.mkdir(parents=True, exist_ok=True)
    on_phase("serve", {"model": str(path)})
    with (
        ServerProcess(serve_args(str(path), None, cfg.threads, cfg.device)) as ref_srv,
        ServerProcess(serve_args(str(path), cfg.deployment, cfg.threads, cfg.device, cfg.patch)) as dep_srv,
    ):
        for name, srv in (("reference", ref_srv), ("deployment", dep_srv)):
            on_phase(f"probe {name}", {"url": srv.url})
            _probe(srv.url, cfg, digits, cfg.out / name, on_event)
    return explain_failure(
        path,
        cfg.out,
        reference_dir=cfg.out / "reference",
        deployment_dir=cfg.out / "deployment",
        deployment=cfg.setting,
        fixes=cfg.fix_candidates(),
        on_phase=on_phase,
        device=cfg.device,
    )


def explain_failure(
    path: Path,
    out: Path,
    *,
    reference_dir: Path,
    deployment_dir: Path,
    deployment: Setting,
    fixes: tuple[Setting, ...],
    on_phase: Phase,
    device: str = "cpu",
) -> Path:
    """Rank-dump the failing case of two finished probes (``deployment_dir`` ran under ``deployment``),
    try each fix on it, and write ``rankdump.json``, ``fixes.json`` and DIAGNOSIS.md into ``out``."""
    from needlescope.dsa.rankdump import rank_dump, validate_rankdump
    from needlescope.organism.bundle import load_bundle

    case_id, why = pick_case_to_explain(_rows(reference_dir), _rows(deployment_dir))
    case = _case(deployment_dir, case_id)
    on_phase("rank dump", {"case": case_id})
    model, tokenizer, _ = load_bundle(path, device=device)
    dump = rank_dump(
        model,
        tokenizer,
        case["messages"],
        needle=case["needle"],
        numerics=deployment.numerics,
        patch=deployment.patch,
        expected=case["expected"],
        label=case_id,
    )
    validate_rankdump(dump)
    (out / "rankdump.json").write_text(json.dumps(dump, indent=1))
    on_phase("fixes", {"candidates": len(fixes)})
    tried = []
    for fix in fixes:
        d = rank_dump(
            model,
            tokenizer,
            case["messages"],
            needle=case["needle"],
            numerics=fix.numerics,
            patch=fix.patch,
            expected=case["expected"],
        )
        tried.append(
            {
                **fix.to_dict(),
                "selected_all_layers": all(
                    layer["positions"][0]["selected"] for layer in d["layers"] if layer["positions"]
                ),
                "answer_correct": d.get("answer_correct"),
                "layers": [
                    {"layer": layer["layer"], **_first(layer)} for layer in d["layers"] if layer["positions"]
                ],
            }
        )
    (out / "fixes.json").write_text(json.dumps({"case_id": case_id, "fixes": tried}, indent=1))
    on_phase("report", {})
    return write_diagnosis(
        out,
        model=str(path),
        reference=json.loads((reference_dir / "summary.json").read_text()),
        deployment=json.loads((deployment_dir / "summary.json").read_text()),
        deployment_label=deployment.label(),
        case=case,
        why=why,
        rankdump=dump,
        fixes=tried,
        heatmaps=(
            os.path.relpath(reference_dir / "heatmap.png", out),
            os.path.relpath(deployment_dir / "heatmap.png", out),
        ),
    )


def _first(layer: dict) -> dict:
    p = layer["positions"][0]
    return {k: p[k] for k in ("best_rank", "margin", "selected")}
