"""``ServeConfig``: everything ``needlescope serve`` runs with, validated once.

Numerics fields (``index_k``, ``index_q``, ``score_dtype``, ``index_topk``, ``patch``) are
``None`` when not given. For a DeepSeek-V4 checkpoint ``None`` means the reference numerics
(fp32, the checkpoint's own ``index_topk``, no patch); for any other checkpoint setting one is
an error, because there is no indexer to apply it to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from needlescope.errors import BadInput

__all__ = ["DEFAULT_PORT", "ServeConfig"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_RUNNING = 8
DEFAULT_MAX_QUEUED = 64
DEFAULT_MAX_NEW_TOKENS = 512
DEFAULT_MAX_PREFILL_TOKENS = 8192
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Validated server settings; every field is echoed by ``/get_server_info``."""

    model: str = "organism"
    """``organism`` (the shipped checkpoint) or a local transformers checkpoint directory."""
    served_model_name: str | None = None
    """Name in ``/v1/models`` and the ``model`` field requests must carry; default: ``model``'s name."""
    index_k: str | None = None
    index_q: str | None = None
    score_dtype: str | None = None
    index_topk: int | None = None
    patch: str | None = None
    """Python file defining ``apply(model)``, applied for the server's lifetime."""
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    """0 picks a free port (the READY line says which)."""
    max_running_requests: int = DEFAULT_MAX_RUNNING
    """Largest decode batch; at most this many requests run at once."""
    max_queued_requests: int = DEFAULT_MAX_QUEUED
    """Requests admitted but not yet running; one more gets HTTP 503 at once."""
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    """Batch size x prompt length budget of one prefill (a longer single prompt still runs alone).
    Eager attention's memory grows with batch x length^2, so long prompts batch less."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    """Cap on generated tokens per request (also the default when a request gives none)."""
    device: str = "cpu"
    kernel: str = "auto"
    """Indexer scoring: auto (Triton on CUDA where the precisions allow) | reference | triton."""
    kernel_fault: str | None = None
    """Debug: run a kernel fault of ``needlescope.kernels.KERNEL_FAULTS`` (needs kernel=triton)."""
    threads: int = 1
    """torch intra-op threads. One is fastest for the toy organism (dispatch-bound, and it leaves
    cores free for the HTTP loop and for other processes)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body accepted; a larger one gets HTTP 413 before it is read."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every route but /health needs ``Authorization: Bearer KEY``. Never logged,
    never echoed (``to_dict`` says only whether one is set)."""
    expose_paths: bool = False
    """Show absolute filesystem paths (the model directory) in /get_server_info and /v1/models."""

    def __post_init__(self) -> None:
        # Imported here so that importing the CLI (which imports this module) does not import torch.
        from needlescope.dsa.emulate import SCORE_DTYPES
        from needlescope.dsa.quant import get_quantizer

        if not self.model:
            raise BadInput("--model must be 'organism' or a checkpoint directory, got an empty string")
        for name in ("index_k", "index_q"):
            value = getattr(self, name)
            if value is not None:
                get_quantizer(value)
        if self.score_dtype is not None and self.score_dtype not in SCORE_DTYPES:
            raise BadInput(
                f"--score-dtype must be one of {', '.join(SCORE_DTYPES)}; got {self.score_dtype!r}"
            )
        if self.index_topk is not None and self.index_topk < 1:
            raise BadInput(f"--index-topk must be a positive integer; got {self.index_topk}")
        if self.patch is not None:
            # needlescope.dsa's package init imports torch; this module stays importable without it.
            from needlescope.dsa.faults import resolve_patch

            try:
                resolve_patch(self.patch)
            except BadInput as exc:
                raise BadInput(f"--patch: {exc}") from None
        if not 0 <= self.port <= 65535:
            raise BadInput(f"--port must be in 0..65535; got {self.port}")
        if self.max_running_requests < 1:
            raise BadInput(f"--max-running-requests must be at least 1; got {self.max_running_requests}")
        if self.max_queued_requests < 1:
            raise BadInput(f"--max-queued-requests must be at least 1; got {self.max_queued_requests}")
        if self.max_prefill_tokens < 1:
            raise BadInput(f"--max-prefill-tokens must be at least 1; got {self.max_prefill_tokens}")
        if self.max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be at least 1; got {self.max_new_tokens}")
        if self.device.split(":")[0] not in DEVICES:
            raise BadInput(
                f"--device must be one of {', '.join(DEVICES)} (optionally cuda:N); got {self.device!r}"
            )
        if self.threads < 1:
            raise BadInput(f"--threads must be at least 1; got {self.threads}")
        from needlescope.kernels import KERNEL_FAULTS, KERNELS

        if self.kernel not in KERNELS:
            raise BadInput(f"--kernel must be one of {', '.join(KERNELS)}; got {self.kernel!r}")
        if self.kernel_fault is not None and (
            self.kernel != "triton" or self.kernel_fault not in KERNEL_FAULTS
        ):
            raise BadInput(f"--kernel-fault needs --kernel triton and one of {', '.join(KERNEL_FAULTS)}")
        if self.max_body_bytes < 1024:
            raise BadInput(f"--max-body-bytes must be at least 1024; got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise BadInput("--api-key (or NEEDLESCOPE_API_KEY) is empty; give a key or leave it unset")

    @property
    def sets_numerics(self) -> bool:
        """Whether any indexer numerics or a patch was asked for."""
        return any(
            v is not None for v in (self.index_k, self.index_q, self.score_dtype, self.index_topk, self.patch)
        )

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model == "organism" else Path(self.model).resolve().name

    @property
    def exposed_without_key(self) -> bool:
        """Whether the server would listen beyond loopback with no API key."""
        return self.host not in LOOPBACK_HOSTS and self.api_key is None

    def to_dict(self) -> dict:
        """The fields as given, the API key replaced by whether one is set, and the model
        directory by its name unless ``expose_paths``."""
        out = asdict(self)
        out["api_key"] = self.api_key is not None
        if not self.expose_paths and self.model != "organism":
            out["model"] = Path(self.model).name
        return out
