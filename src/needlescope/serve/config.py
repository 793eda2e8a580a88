"""``ServeConfig``: everything ``needlescope serve`` runs with, validated once.

The indexer configuration is one ``needlescope.setting.Setting`` (numerics and patch), or
``None`` when none was asked for. For a DeepSeek-V4 checkpoint ``None`` means the reference
(fp32, the checkpoint's own ``index_topk``, no patch); for any other checkpoint a setting is an
error, because there is no indexer to apply it to.

A child server is started with its ``ServeConfig`` as JSON (``to_json`` / ``from_json``,
``needlescope serve --config-json``), so nothing is lost across the process boundary. The API
key is the one field JSON never carries: a command line is visible to every local user, so
``serve.launch.ServerProcess`` hands it to the child in ``NEEDLESCOPE_API_KEY`` instead.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.setting import Setting
from needlescope.targets.endpoints import check_api_key

__all__ = ["DEFAULT_PORT", "ServeConfig"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_RUNNING = 8
DEFAULT_MAX_QUEUED = 64
DEFAULT_MAX_NEW_TOKENS = 512
DEFAULT_MAX_PREFILL_TOKENS = 8192
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_DRAFT_TOKENS = 16
"""Largest speculative draft depth, per server (``--speculative-num-draft-tokens``) or request."""
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HALF_CLOSE_TIMEOUT_S = 120.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEVICES = ("cpu", "cuda")


_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),)}


def _json_type_ok(value: object, annotation: str) -> bool:
    """Whether a JSON value fits a field annotated ``int``, ``float``, ``str``, ``bool`` or a
    ``X | None`` of them (a bool is not a number here, as in the flags)."""
    allowed = tuple(
        t for name in str(annotation).split("|") for t in _JSON_TYPES.get(name.strip(), (object,))
    )
    if isinstance(value, bool) and bool not in allowed:
        return False
    return isinstance(value, allowed)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Validated server settings; every field is echoed by ``/get_server_info``."""

    model: str = "organism"
    """``organism`` (the shipped checkpoint) or a local transformers checkpoint directory."""
    served_model_name: str | None = None
    """Name in ``/v1/models`` and the ``model`` field requests must carry; default: ``model``'s name."""
    setting: Setting | None = None
    """Indexer numerics and patch, applied for the server's lifetime; ``None``: the checkpoint's own."""
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
    """cpu | cuda | cuda:N | auto (every visible GPU, layers placed across them) | a list
    ``cuda:0,cuda:1`` (``dsa.placement``)."""
    max_memory: str | None = None
    """Weight bytes per device when placing (``70GiB`` or one per device); default: each GPU's
    free memory minus the activation reserve."""
    prefill_chunk: int | None = None
    """Run prompts longer than this through the KV cache in chunks of this many tokens, so that
    a 128K-token prefill's memory is bounded by the chunk (``dsa.passes``); None: one pass."""
    kernel: str = "auto"
    """Indexer scoring: auto (Triton on CUDA where the precisions allow) | reference | triton."""
    kernel_fault: str | None = None
    """Debug: run a kernel fault of ``needlescope.kernels.KERNEL_FAULTS`` (needs kernel=triton)."""
    threads: int = 1
    """torch intra-op threads. One is fastest for the toy organism (dispatch-bound, and it leaves
    cores free for the HTTP loop and for other processes)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body accepted; a larger one gets HTTP 413 before it is read."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Open client connections at once (further clipped below the descriptor limit); at the cap
    a new connection closes the oldest one without a request in progress (``serve.connections``)."""
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    """A connection must send a complete request head within this many seconds, or is closed."""
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    """A request's body must be complete within this many seconds of its head, or is closed."""
    half_close_timeout_s: float = DEFAULT_HALF_CLOSE_TIMEOUT_S
    """A client that half-closed after its whole request is answered within this many seconds of
    its FIN, or its connection is closed and the request cancelled (``serve.connections``)."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every route but /health needs ``Authorization: Bearer KEY``. Never logged,
    never echoed (``to_dict`` says only whether one is set), never in ``to_json``."""
    disclose_patch: bool = True
    """Whether /get_server_info names the setting's patch. False plays a deployment whose kernel
    bug is not announced (issue 37's planted runs): the patch runs, every endpoint says none."""
    expose_paths: bool = False
    """Show absolute filesystem paths (the model directory) in /get_server_info and /v1/models."""
    prefix_cache_mib: int = 0
    """Memory for the prefix cache (``serve.prefix_cache``); 0, the default, turns it off, so a
    reference server answers exactly what one prefill pass answers."""
    continuous_batching: bool = False
    """New requests join the running batch at a decode step (``serve.engine``); off (the
    default): a batch runs to its end before the next starts. Answers are the same either way
    (every row runs what a static batch of its prefill group runs); off by default because on
    the CPU organism it lowers throughput (0.87x-0.94x, docs/perf.md): a request that joins
    mid-flight is at another position, so its cohort needs a forward of its own, while waiting
    requests gather into bigger static batches. On, a late request no longer waits for the
    batch in flight."""
    speculative_num_draft_tokens: int = 0
    """Draft tokens proposed by prompt lookup and verified in one forward per step
    (``serve.speculative``); 0, the default, turns speculative decoding off."""

    def __post_init__(self) -> None:
        if not self.model:
            raise BadInput("--model must be 'organism' or a checkpoint directory, got an empty string")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise BadInput("--served-model-name is empty; give a name or leave it unset")
        if self.setting is not None and not isinstance(self.setting, Setting):
            raise BadInput(f"setting must be a needlescope Setting, got {type(self.setting).__name__}")
        _check_host(self.host)
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
        listed = [d.strip() for d in self.device.split(",")]
        if self.device != "auto" and (not all(listed) or any(d.split(":")[0] not in DEVICES for d in listed)):
            raise BadInput(
                f"--device must be auto, one of {', '.join(DEVICES)} (optionally cuda:N), or a comma-separated "
                f"list of them; got {self.device!r}"
            )
        if self.max_memory is not None:
            from needlescope.dsa.placement import parse_max_memory

            n = 1 if self.device == "auto" or "," not in self.device else len(listed)
            parse_max_memory(self.max_memory.split(",")[0] if self.device == "auto" else self.max_memory, n)
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise BadInput(f"--prefill-chunk must be at least 1 token (or unset); got {self.prefill_chunk}")
        if self.threads < 1:
            raise BadInput(f"--threads must be at least 1; got {self.threads}")
        from needlescope.kernels.names import KERNEL_FAULTS, KERNELS

        if self.kernel not in KERNELS:
            raise BadInput(f"--kernel must be one of {', '.join(KERNELS)}; got {self.kernel!r}")
        if self.kernel_fault is not None and (
            self.kernel != "triton" or self.kernel_fault not in KERNEL_FAULTS
        ):
            raise BadInput(f"--kernel-fault needs --kernel triton and one of {', '.join(KERNEL_FAULTS)}")
        if not 0 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise BadInput(
                f"--speculative-num-draft-tokens must be in 0..{MAX_DRAFT_TOKENS} (0: off); "
                f"got {self.speculative_num_draft_tokens}"
            )
        if self.prefix_cache_mib < 0:
            raise BadInput(f"--prefix-cache-mib must be 0 (off) or more; got {self.prefix_cache_mib}")
        if self.max_body_bytes < 1024:
            raise BadInput(f"--max-body-bytes must be at least 1024; got {self.max_body_bytes}")
        if self.max_connections < 8:
            raise BadInput(f"--max-connections must be at least 8; got {self.max_connections}")
        for flag, value in (
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
            ("--half-close-timeout", self.half_close_timeout_s),
        ):
            if not 0 < value <= 3600:
                raise BadInput(f"{flag} must be in (0, 3600] seconds; got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise BadInput("--api-key (or NEEDLESCOPE_API_KEY) is empty; give a key or leave it unset")
        check_api_key(self.api_key)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model == "organism" else Path(self.model).resolve().name

    @property
    def exposed_without_key(self) -> bool:
        """Whether the server would listen beyond loopback with no API key."""
        return self.host not in LOOPBACK_HOSTS and self.api_key is None

    @property
    def patch_shown(self) -> str | None:
        """The patch as the server shows it (``/get_server_info``, the startup line): a built-in
        ``fault:NAME`` as is, a patch file by its name unless ``expose_paths``; None without one or
        when ``disclose_patch`` is off or it is a built-in serving fault."""
        patch = self.setting.patch if self.setting is not None and self.disclose_patch else None
        if patch is not None and patch.is_serving_fault:
            patch = None  # a planted serving bug is never announced
        if patch is None or patch.is_fault or self.expose_paths:
            return None if patch is None else patch.spec
        return patch.path.name

    def to_dict(self) -> dict:
        """Flat form echoed by ``/get_server_info`` as ``args``: the setting's fields inline
        (``None`` each when no setting was given), ``patch`` as its spec, the API key replaced by
        whether one is set, and the model directory and a patch file by their names unless
        ``expose_paths``; no patch at all when ``disclose_patch`` is off."""
        d = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("setting", "disclose_patch")
        }
        d["api_key"] = self.api_key is not None
        if not self.expose_paths and self.model != "organism":
            d["model"] = Path(self.model).name
        names = ("index_k", "index_q", "score_dtype", "index_topk", "hadamard", "patch")
        setting = self.setting.to_json() if self.setting is not None else dict.fromkeys(names)
        return {**d, **setting, "patch": self.patch_shown}

    def to_json(self) -> str:
        """Every field but ``api_key`` as JSON text; ``from_json`` gives an equal config back
        (``with_api_key`` restores the key from where the caller keeps it)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "api_key"}
        d["setting"] = None if self.setting is None else self.setting.to_json()
        return json.dumps(d)

    def with_api_key(self, api_key: str | None) -> ServeConfig:
        return replace(self, api_key=api_key)

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        """Inverse of ``to_json``; BadInput for text that is not a JSON object of known fields."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(f"--config-json is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise BadInput("--config-json must be a JSON object of ServeConfig fields")
        unknown = set(obj) - {f.name for f in fields(cls) if f.name != "api_key"}
        if unknown:
            raise BadInput(f"--config-json has unknown field(s) {', '.join(sorted(unknown))}")
        for f in fields(cls):
            if f.name in obj and f.name != "setting" and not _json_type_ok(obj[f.name], f.type):
                raise BadInput(f"--config-json field {f.name!r} = {obj[f.name]!r}; expected {f.type}")
        if obj.get("setting") is not None:
            obj["setting"] = Setting.from_json(obj["setting"])
        return cls(**obj)


def _check_host(host: str) -> None:
    """BadInput for a --host that no machine has: empty, or dotted digits that are no IPv4
    address (``999.1.1.1``). A name is left to the bind, which names what failed."""
    if not host.strip():
        raise BadInput("--host is empty; give an address such as 127.0.0.1 or 0.0.0.0")
    if all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise BadInput(f"--host {host!r} is not an IPv4 address; give one such as 127.0.0.1") from None
