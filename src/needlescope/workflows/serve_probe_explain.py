"""Serve, probe, explain: a DeepSeek-V4 checkpoint served twice, both probed, the failure explained.

``run(ServeProbeExplainConfig(model=..., out=...), on_phase) -> Path`` (DIAGNOSIS.md; the
command ``needlescope serve-probe-explain``) runs, in order:

0. **validate**: every input (the checkpoint, ``--out``, the settings) is checked before the
   filesystem is touched. ``out`` is an output folder as ``needlescope.outdir`` means it: a
   file at one of the names the pipeline writes (``OUTPUTS``) is replaced only when the
   folder's manifest records that this pipeline wrote it and it is unchanged since, else the
   run refuses naming it and deletes nothing; ``force`` (``--force``) replaces those files
   whoever wrote them. Files at other names are never touched. The files at its names are
   deleted before the run (``outdir.clear_outputs``), so both probes start afresh. The
   deployment patch is loaded (its file executed) last, once for this process;
1. **serve**: two real ``needlescope serve`` processes on loopback, each started with its
   ``ServeConfig`` as JSON: the reference (fp32, the checkpoint's ``index_topk``) and the
   deployment ``Setting`` (numerics plus an optional patch, by default the built-in
   ``fault:indexer_page_table``);
2. **probe**: ``run_probe`` with multiturn needles against each (``reference/``, ``deployment/``);
3. **rank dump**, 4. **fixes**, 5. **report**: ``needlescope.workflows.explain`` on the two
   probes (``rankdump.json``, ``fixes.json``, ``DIAGNOSIS.md``).

Every artifact is checked against its documented schema before it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.outdir import OutputSpec, check_outputs, clear_outputs, record_outputs
from needlescope.paths import check_out_dir
from needlescope.progress import Event, no_event
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import run_probe
from needlescope.serve.config import ServeConfig
from needlescope.setting import Setting
from needlescope.workflows import explain

__all__ = ["DEPLOYMENT", "OUTPUTS", "ServeProbeExplainConfig", "check_out", "prepare_out", "run"]

DEPLOYMENT = Setting(index_k="fp8_e4m3", index_topk=64, patch="fault:indexer_page_table")
"""fp8 keys as SGLang stores them, ``index_topk`` 64 (every entry at 256 tokens, 1/16 of them at
4K), and a Triton indexer that reads the paged key cache without the block table: precision and
top-k alone cost this organism at most 8 points at 4K; with the fault, recall holds only while
top-k covers every entry (docs/organism.md, "Deployment-like settings")."""

OUTPUTS = OutputSpec(
    "serve-probe-explain", ("reference/", "deployment/", "rankdump.json", "fixes.json", "DIAGNOSIS.md")
)
"""The names the pipeline writes in ``out``: what a rerun replaces (``--force``: whoever wrote them)."""


@dataclass(frozen=True)
class ServeProbeExplainConfig:
    """What the pipeline probes. ``deployment`` is the setting under suspicion."""

    model: str
    out: Path
    deployment: Setting = DEPLOYMENT
    lengths: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    trials: int = 2
    seed: int = 0
    threads: int = 1
    value_digits: int | None = None
    """None: the digits the checkpoint was trained on (training.json), else the probe's default."""
    device: str = "cpu"
    concurrency: int = 2
    fixes: tuple[Setting, ...] = field(default=())
    force: bool = False
    """Replace the files at the pipeline's names in ``out`` whoever wrote them (``OUTPUTS``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.deployment, Setting):
            raise BadInput(f"the deployment must be a Setting, got {type(self.deployment).__name__}")
        if self.deployment.index_topk is None:
            raise BadInput("the deployment setting needs an explicit index_topk")
        if not self.lengths:
            raise BadInput("give at least one probe length")
        if len(set(self.lengths)) != len(self.lengths):  # else found by the first probe, once served
            raise BadInput(
                f"--lengths {','.join(map(str, self.lengths))} names a length twice; give each once"
            )
        if self.trials < 1:
            raise BadInput(f"trials must be >= 1, got {self.trials}")
        if self.concurrency < 1:
            raise BadInput(f"concurrency must be >= 1, got {self.concurrency}")
        if self.threads < 1:
            raise BadInput(f"threads must be >= 1, got {self.threads}")

    def fix_candidates(self) -> tuple[Setting, ...]:
        return self.fixes or explain.default_fixes(self.deployment)

    def probe_config(self, url: str, value_digits: int, out: Path) -> ProbeConfig:
        return ProbeConfig(
            base_urls=(f"{url}/v1",),
            model="organism",
            kind="multiturn",
            lengths=self.lengths,
            depths=self.depths,
            trials=self.trials,
            seed=self.seed,
            out=out,
            concurrency=self.concurrency,
            timeout_s=600.0,
            value_digits=value_digits,
        )

    def serve_config(self, model: Path, setting: Setting | None) -> ServeConfig:
        """A loopback server on a free port for ``model`` under ``setting`` (None: the reference)."""
        return ServeConfig(
            model=str(model),
            served_model_name="organism",
            setting=setting,
            port=0,
            threads=self.threads,
            device=self.device,
        )


def check_out(out: Path, model: Path, force: bool = False) -> None:
    """BadInput unless ``out`` can be written without touching anything that is not the
    pipeline's (``outdir.check_outputs`` with ``OUTPUTS``), and never the checkpoint or near it,
    ``force`` or not. Creates nothing."""
    check_out_dir(out)
    out_abs, model_abs = Path(out).resolve(), Path(model).resolve()
    if out_abs == model_abs or model_abs in out_abs.parents or out_abs in model_abs.parents:
        raise BadInput(f"--out {str(out)!r} overlaps the checkpoint directory {str(model)!r}; choose another")
    check_outputs(Path(out), OUTPUTS, force=force)


def prepare_out(out: Path) -> None:
    """Delete the files at the pipeline's names in ``out`` (``check_out`` allowed them: its own
    unchanged, or ``--force``), or create ``out``: both probes then start afresh."""
    clear_outputs(out, OUTPUTS)
    out.mkdir(parents=True, exist_ok=True)


def run(cfg: ServeProbeExplainConfig, on_phase: Event, on_event: Event = no_event) -> Path:
    """Run every phase; returns the path of DIAGNOSIS.md. ``on_phase(name, info)`` marks progress."""
    from needlescope.devices import check_device
    from needlescope.dsa.checkpoint import (
        check_weights,
        require_deepseek_v4,
        resolve_model_dir,
        trained_value_digits,
    )
    from needlescope.dsa.emulate import load_patch

    check_device(cfg.device)  # before --out is touched: else found only when the first server starts
    path = resolve_model_dir(cfg.model)
    require_deepseek_v4(path)
    check_weights(path)
    check_out(cfg.out, path, cfg.force)
    digits = cfg.value_digits or trained_value_digits(path)
    fixes = cfg.fix_candidates()
    for s in (cfg.deployment, *fixes):
        if s.patch is not None:
            load_patch(s.patch)  # last check: a bad patch fails here, not inside the deployment server
    prepare_out(cfg.out)
    try:
        return _run_phases(cfg, path, digits, fixes, on_phase, on_event)
    finally:
        record_outputs(cfg.out, OUTPUTS)  # however the run ends (but SIGKILL), a rerun may replace it


def _run_phases(cfg, path, digits, fixes, on_phase, on_event) -> Path:
    from needlescope.serve.launch import ServerProcess

    on_phase("serve", {"model": str(path)})
    with (
        ServerProcess(cfg.serve_config(path, None)) as ref_srv,
        ServerProcess(cfg.serve_config(path, cfg.deployment)) as dep_srv,
    ):
        for name, srv in (("reference", ref_srv), ("deployment", dep_srv)):
            on_phase(f"probe {name}", {"url": srv.url})
            run_probe(cfg.probe_config(srv.url, digits, cfg.out / name), on_event)
            record_outputs(cfg.out, OUTPUTS)
    ecfg = explain.ExplainConfig(
        model=path,
        reference_dir=cfg.out / "reference",
        deployment_dir=cfg.out / "deployment",
        deployment=cfg.deployment,
        fixes=fixes,
        device=cfg.device,
    )
    result = explain.run(ecfg, on_phase)
    on_phase("report", {})
    return explain.write(result, cfg.out)
