"""``needlescope serve-probe-explain``: serve a checkpoint twice, probe both, explain the failure.

Serves the checkpoint (``--model``, default the shipped ``organism``) twice, with reference
indexer numerics and with a deployment-like setting (by default
``needlescope.workflows.serve_probe_explain.DEPLOYMENT``: fp8 keys, ``index_topk`` 64, the
built-in ``fault:indexer_page_table``), probes both with multiturn needles, rank-dumps the
failing case, tries the fixes and writes ``DIAGNOSIS.md``
(``needlescope.workflows.serve_probe_explain``). Every input is checked before anything is
written; a file at one of its names in ``--out`` is replaced only when an earlier run of this
command wrote it, unchanged since (``--force``: whoever wrote it; files at other names are never
touched). A progress bar advances through the six phases.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from needlescope.cli.model_context import check_lengths, check_topk
from needlescope.cli.outputs import FORCE
from needlescope.cli.setting_options import PATCH_HELP, numerics_from_flags, with_patch
from needlescope.run.config import ProbeConfig
from needlescope.workflows.serve_probe_explain import DEPLOYMENT, ServeProbeExplainConfig

PHASES = ("serve", "probe reference", "probe deployment", "rank dump", "fixes", "report")


def _default(name: str):
    return ServeProbeExplainConfig.__dataclass_fields__[name].default


def serve_probe_explain_command(
    out: Path = typer.Option(
        Path("serve-probe-explain-out"),
        "--out",
        help="Output directory; a file at a name this command writes is replaced only when an earlier run of it wrote it, or with --force.",
    ),
    model: str = typer.Option("organism", "--model", help="'organism' or a DeepSeek-V4 checkpoint dir."),
    deploy_index_k: str = typer.Option(DEPLOYMENT.index_k, help="Deployment-like index-key precision."),
    deploy_index_topk: int = typer.Option(DEPLOYMENT.index_topk, help="Deployment-like index_topk."),
    deploy_patch: str = typer.Option(
        DEPLOYMENT.patch.spec, help=f"Patch of the deployment-like server, or 'none'. {PATCH_HELP}"
    ),
    lengths: str = typer.Option(
        ",".join(map(str, _default("lengths"))), help="Probe lengths (comma-separated)."
    ),
    trials: int = typer.Option(_default("trials"), help="Trials per cell."),
    device: str = typer.Option(_default("device"), help="cpu | cuda | cuda:N"),
    force: bool = FORCE,
) -> None:
    """Probe the organism under reference and deployment numerics and explain the difference."""
    from needlescope.cli.output import console
    from needlescope.cli.progress import ProgressView
    from needlescope.run.config import parse_int_list
    from needlescope.workflows import serve_probe_explain

    deployment = numerics_from_flags(deploy_index_k, None, None, deploy_index_topk)
    cfg = ServeProbeExplainConfig(
        model=model,
        out=out,
        deployment=deployment,
        lengths=tuple(parse_int_list(lengths, "--lengths")),
        trials=trials,
        device=device,
        force=force,
    )
    # Before anything loads: every probe length with its answer tokens fits the model's context.
    check_lengths(model, cfg.lengths, ProbeConfig.__dataclass_fields__["max_tokens"].default)
    check_topk(model, [deployment.index_topk], "--deploy-index-topk")
    # The patch is resolved after every other flag; serve_probe_explain.run checks the model and --out, then runs it.
    cfg = replace(cfg, deployment=with_patch(deployment, None if deploy_patch == "none" else deploy_patch))
    with ProgressView(console) as view:

        def phase(name: str, info: dict) -> None:
            done = PHASES.index(name) if name in PHASES else 0
            view(
                "serve-probe-explain",
                done,
                len(PHASES),
                f"{name} {' '.join(f'{k}={v}' for k, v in info.items())}".strip(),
            )

        path = serve_probe_explain.run(cfg, phase)
        view("serve-probe-explain", len(PHASES), len(PHASES), "done")
    console.print(path.read_text(encoding="utf-8"))
    console.print(f"wrote {out}/DIAGNOSIS.md")
