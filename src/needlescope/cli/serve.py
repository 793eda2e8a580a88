"""``needlescope serve``: the reference server for the organism or a local checkpoint.

``--config-json`` starts it from a whole ``ServeConfig`` (``ServeConfig.to_json``), which is how
a parent process (serve-probe-explain, tests) starts a child server without rebuilding flags from values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from needlescope.cli import setting_options as opt
from needlescope.cli.output import err_console
from needlescope.errors import BadInput
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

_DEFAULTS = ServeConfig()  # every flag's default is the config's own

# The request limits (serve.middleware, serve.connections; docs/serve.md "Limits").
MaxBodyBytes = Annotated[int, typer.Option("--max-body-bytes", help="Larger request bodies get HTTP 413.")]
MaxConnections = Annotated[
    int,
    typer.Option(
        "--max-connections", help="Open connections at once; at the cap the oldest idle one is closed."
    ),
]
HeaderTimeout = Annotated[
    float, typer.Option("--header-timeout", help="Seconds to send a complete request head.")
]
BodyTimeout = Annotated[
    float, typer.Option("--body-timeout", help="Seconds to send a request body after its head.")
]
HalfCloseTimeout = Annotated[
    float,
    typer.Option(
        "--half-close-timeout", help="Seconds to answer a client that half-closed after its request."
    ),
]


def serve_command(
    ctx: typer.Context,
    model: str = typer.Option(
        _DEFAULTS.model, "--model", help="'organism' or a local transformers checkpoint dir."
    ),
    index_k: opt.IndexK = None,
    index_q: opt.IndexQ = None,
    score_dtype: opt.ScoreDtype = None,
    index_topk: opt.IndexTopk = None,
    patch: opt.Patch = None,
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
    device: str = typer.Option(
        _DEFAULTS.device,
        "--device",
        help="cpu | cuda | cuda:N | auto (layers across every GPU) | cuda:0,cuda:1",
    ),
    max_memory: str = typer.Option(
        None,
        "--max-memory",
        help="Weight bytes per device when placing: 70GiB, or one per device (70GiB,60GiB).",
    ),
    prefill_chunk: int = typer.Option(
        None, "--prefill-chunk", help="Prefill long prompts in chunks of this many tokens (docs/scale.md)."
    ),
    threads: int = typer.Option(_DEFAULTS.threads, "--threads", help="torch intra-op threads."),
    kernel: str = typer.Option(
        _DEFAULTS.kernel,
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
    disclose_patch: bool = typer.Option(
        True,
        "--disclose-patch/--undisclosed-patch",
        hidden=True,
        help="Test: run --patch without naming it in /get_server_info (an unannounced kernel bug).",
    ),
    indexer_capture: bool = typer.Option(
        True,
        "--indexer-capture/--no-indexer-capture",
        help="Answer return_indexer_topk on /generate; off plays an engine without a capture (vLLM).",
    ),
    expose_paths: bool = typer.Option(
        False, "--expose-paths", help="Show absolute paths in /get_server_info and /v1/models."
    ),
    max_body_bytes: MaxBodyBytes = DEFAULT_MAX_BODY_BYTES,
    max_connections: MaxConnections = _DEFAULTS.max_connections,
    header_timeout_s: HeaderTimeout = _DEFAULTS.header_timeout_s,
    body_timeout_s: BodyTimeout = _DEFAULTS.body_timeout_s,
    half_close_timeout_s: HalfCloseTimeout = _DEFAULTS.half_close_timeout_s,
    prefix_cache_mib: int = typer.Option(
        _DEFAULTS.prefix_cache_mib,
        "--prefix-cache-mib",
        help="Memory for the prefix cache, MiB; 0 (default) turns it off (docs/serve.md).",
    ),
    continuous_batching: bool = typer.Option(
        _DEFAULTS.continuous_batching,
        "--continuous-batching/--no-continuous-batching",
        help="New requests join the running batch at a decode step; off (default): static batches.",
    ),
    speculative_num_draft_tokens: int = typer.Option(
        _DEFAULTS.speculative_num_draft_tokens,
        "--speculative-num-draft-tokens",
        help="Prompt-lookup draft tokens verified per step; 0 (default) turns speculative decoding off.",
    ),
    config_json: str = typer.Option(
        None,
        "--config-json",
        help="The whole ServeConfig as JSON instead of every other flag (the key stays in NEEDLESCOPE_API_KEY).",
    ),
) -> None:
    """Serve a model over OpenAI-compatible and SGLang-native HTTP; prints 'READY PORT' when listening.

    Over 80 lines: one typer option per ServeConfig field, nothing else.
    """
    if config_json is not None:
        cfg = _config_from_json(ctx, config_json, api_key)
    else:
        cfg = _config_from_flags(**{k: v for k, v in ctx.params.items() if k != "config_json"})
    if cfg.exposed_without_key:
        err_console.print(
            f"WARNING: listening on {cfg.host} without an API key; anyone who can reach it can use it "
            "(set --api-key or NEEDLESCOPE_API_KEY)",
            highlight=False,
        )
    _serve(cfg)


def _config_from_json(ctx: typer.Context, config_json: str, api_key: str | None) -> ServeConfig:
    """ServeConfig from ``--config-json``; BadInput if any other flag but the key was given too."""
    given = [
        p.opts[0]
        for p in ctx.command.params
        if p.name not in ("config_json", "api_key") and ctx.get_parameter_source(p.name).name != "DEFAULT"
    ]
    if given:
        raise BadInput(f"--config-json replaces every other flag; drop {', '.join(given)}")
    return ServeConfig.from_json(config_json).with_api_key(api_key)


def _config_from_flags(*, index_k, index_q, score_dtype, index_topk, patch, **rest) -> ServeConfig:
    """ServeConfig from the flags; a setting only when a numerics flag or --patch was given."""
    wants_setting = any(v is not None for v in (index_k, index_q, score_dtype, index_topk, patch))
    cfg = ServeConfig(**rest)
    if not wants_setting:
        return cfg
    setting = opt.numerics_from_flags(index_k, index_q, score_dtype, index_topk)
    return replace(cfg, setting=opt.with_patch(setting, patch))  # the patch is resolved last


def _serve(cfg: ServeConfig) -> None:
    from needlescope.serve.connections import bind_listener

    listener = bind_listener(cfg.host, cfg.port)  # a port in use fails here, before torch and the model load

    from transformers.utils import logging as hf_logging

    from needlescope.serve.app import run_server
    from needlescope.serve.engine import Engine

    hf_logging.disable_progress_bar()
    engine = Engine(cfg)
    info = engine.info()

    def ready(bound_host: str, bound_port: int) -> None:
        err_console.say(
            "serving [bold]{}[/] ({}) at http://{}:{}/v1  index_k={} index_q={} index_topk={}{}",
            info["model"],
            info["architecture"],
            bound_host,
            bound_port,
            info["index_k"],
            info["index_q"],
            info["index_topk"],
            "" if info["patch"] is None else f"  patch={info['patch']}",
        )
        # The machine-readable line, like the scripted server's: "READY <port>".
        print(f"READY {bound_port}", flush=True)

    run_server(engine, on_ready=ready, listener=listener)
