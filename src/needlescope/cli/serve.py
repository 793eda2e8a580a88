"""``needlescope serve``: the reference server for the organism or a local checkpoint."""

from __future__ import annotations

import typer
from rich.console import Console

from needlescope.serve.config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_RUNNING,
    DEFAULT_PORT,
    ServeConfig,
)

err_console = Console(stderr=True)


def serve_command(
    model: str = typer.Option(
        "organism", "--model", help="'organism' or a local transformers checkpoint dir."
    ),
    index_k: str = typer.Option(None, "--index-k", help="Index-key precision (fp32, bf16, fp8_e4m3, ...)."),
    index_q: str = typer.Option(None, "--index-q", help="Index-query precision."),
    score_dtype: str = typer.Option(None, "--score-dtype", help="Indexer score accumulation: fp32 | bf16."),
    index_topk: int = typer.Option(None, "--index-topk", help="Indexer top-k (default: the checkpoint's)."),
    patch: str = typer.Option(
        None, "--patch", help="Python file defining apply(model), or a built-in fault:NAME."
    ),
    host: str = typer.Option(DEFAULT_HOST, "--host"),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="0 picks a free port."),
    max_queued_requests: int = typer.Option(
        DEFAULT_MAX_QUEUED, "--max-queued-requests", help="Waiting requests beyond this get HTTP 503."
    ),
    max_running_requests: int = typer.Option(
        DEFAULT_MAX_RUNNING, "--max-running-requests", help="Largest decode batch."
    ),
    max_new_tokens: int = typer.Option(
        DEFAULT_MAX_NEW_TOKENS,
        "--max-new-tokens",
        help="Cap on generated tokens per request.",
    ),
    max_prefill_tokens: int = typer.Option(
        DEFAULT_MAX_PREFILL_TOKENS,
        "--max-prefill-tokens",
        help="Budget of batch x prompt length per prefill.",
    ),
    served_model_name: str = typer.Option(None, "--served-model-name", help="Name in /v1/models."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N"),
    threads: int = typer.Option(1, "--threads", help="torch intra-op threads."),
    kernel: str = typer.Option(
        "auto",
        "--kernel",
        help="Indexer scoring: auto (Triton on CUDA where it applies) | reference | triton.",
    ),
    kernel_fault: str = typer.Option(
        None,
        "--kernel-fault",
        hidden=True,
        help="Debug: run a kernel fault (indexer_key_slot) in the Triton kernel.",
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar="NEEDLESCOPE_API_KEY",
        show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route but /health (never logged).",
    ),
    expose_paths: bool = typer.Option(
        False, "--expose-paths", help="Show absolute paths in /get_server_info and /v1/models."
    ),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", help="Larger request bodies get HTTP 413."
    ),
) -> None:
    """Serve a model over OpenAI-compatible and SGLang-native HTTP; prints 'READY PORT' when listening."""
    cfg = ServeConfig(
        model=model,
        served_model_name=served_model_name,
        index_k=index_k,
        index_q=index_q,
        score_dtype=score_dtype,
        index_topk=index_topk,
        patch=patch,
        host=host,
        port=port,
        max_queued_requests=max_queued_requests,
        max_running_requests=max_running_requests,
        max_new_tokens=max_new_tokens,
        max_prefill_tokens=max_prefill_tokens,
        device=device,
        kernel=kernel,
        kernel_fault=kernel_fault,
        threads=threads,
        api_key=api_key,
        expose_paths=expose_paths,
        max_body_bytes=max_body_bytes,
    )
    if cfg.exposed_without_key:
        err_console.print(
            f"WARNING: listening on {cfg.host} without an API key; anyone who can reach it can use it "
            "(set --api-key or NEEDLESCOPE_API_KEY)",
            highlight=False,
        )
    from transformers.utils import logging as hf_logging

    from needlescope.serve.app import run_server
    from needlescope.serve.engine import Engine

    hf_logging.disable_progress_bar()

    engine = Engine(cfg)
    info = engine.info()

    def ready(bound_host: str, bound_port: int) -> None:
        err_console.print(
            f"serving [bold]{info['model']}[/] ({info['architecture']}) at http://{bound_host}:{bound_port}/v1  "
            f"index_k={info['index_k']} index_q={info['index_q']} index_topk={info['index_topk']}",
            highlight=False,
        )
        # The machine-readable line, like the scripted server's: "READY <port>".
        print(f"READY {bound_port}", flush=True)

    run_server(engine, on_ready=ready)
