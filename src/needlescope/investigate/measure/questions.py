"""Cheap questions: one value each, read without running the model, asked before any check.

``answer(question, ctx)`` returns an ``Answer``: the value as text (or ``None`` when the question
could not be asked, with the reason in ``blocked``). Nothing here raises for a missing file,
an unreadable process or an unreachable server: those answers are ``blocked``.

* ``env``: ``name`` in a process's environment (``process = PID`` reads ``/proc/PID/environ``)
  or in an env file (``env_file``, else the target's); ``<unset>`` when absent.
* ``server_info``: the dotted ``field`` of ``/get_server_info`` (then ``/v1/models``) of the
  target's endpoint; a bare name is searched anywhere in the JSON.
* ``checkpoint_dtype``: the dtypes (``F32``, ``BF16``, ...) of the tensors whose names match
  the glob ``pattern``, read from the safetensors headers only (no tensor data is loaded);
  the answer is the sorted set joined by ``,``, or ``<none>`` when nothing matches.
* ``config``: the dotted ``key`` of the checkpoint's ``config.json``.
* ``source``: how many times the regex ``pattern`` occurs in the file(s) ``path`` (a glob,
  relative to the ledger).
"""

from __future__ import annotations

import fnmatch
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import regex

from needlescope.investigate.ledger.differences import env_lines, read_env_file
from needlescope.investigate.ledger.ledger import Question

__all__ = ["Answer", "QuestionContext", "ASKERS", "answer", "safetensors_dtypes"]


# A source question's pattern gets this long per file before its answer is blocked.
SOURCE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class QuestionContext:
    base: Path
    """The ledger's directory (relative paths resolve here)."""
    checkpoint: Path | None
    endpoint: str | None = None
    env_file: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    """Bearer key for ``endpoint`` (sent, never written)."""


@dataclass(frozen=True)
class Answer:
    value: str | None
    blocked: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.blocked is None


def _dotted(obj, key: str):
    cur = obj
    for part in key.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _text(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else str(v)


def _env(q: Question, ctx: QuestionContext) -> Answer:
    name = q.params["name"]
    proc = q.params.get("process")
    if proc is not None:
        path = Path(f"/proc/{proc}/environ")
        try:
            env = env_lines(path.read_bytes().decode("utf-8", "replace"), "\0")
        except OSError as exc:
            return Answer(None, f"cannot read the environment of process {proc}: {exc.strerror or exc}")
        where = f"process {proc}"
    else:
        f = q.params.get("env_file")
        path = (ctx.base / f) if f else ctx.env_file
        if path is None:
            return Answer(None, "no process and no env file to read; set process = PID or env_file")
        try:
            env = read_env_file(path)
        except OSError as exc:
            return Answer(None, f"cannot read env file {str(path)!r}: {exc.strerror or exc}")
        where = str(path)
    return Answer(env.get(name, "<unset>"), detail=f"{name} in {where}")


def _server_info(q: Question, ctx: QuestionContext) -> Answer:
    from needlescope.targets.endpoints import normalize_base_url
    from needlescope.targets.provenance import collect_provenance
    from needlescope.targets.sglang import find_key

    if not ctx.endpoint:
        return Answer(None, 'no endpoint in [target]; set endpoint = "http://127.0.0.1:PORT"')
    root, v1 = normalize_base_url(ctx.endpoint)
    info = collect_provenance(root, v1, timeout=5.0, api_key=ctx.api_key)
    field = q.params["field"]
    for key in ("/get_server_info", "/v1/models"):
        body = info.get(key)
        if body is None:
            continue
        value = _dotted(body, field) if "." in field else find_key(body, field)
        if value is not None:
            return Answer(_text(value), detail=f"{field} of {root}{key}")
    statuses = ", ".join(
        f"{k}: {v}" for k, v in info["status"].items() if k in ("/get_server_info", "/v1/models")
    )
    if not any(isinstance(v, int) and v == 200 for v in info["status"].values()):
        return Answer(None, f"endpoint {root} unreachable ({statuses})")
    return Answer("<absent>", detail=f"{field} not in {root}'s server info ({statuses})")


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """{tensor name: dtype} from a ``.safetensors`` file's JSON header (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError(f"{path}: header length {n} is not plausible")
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _checkpoint_dtype(q: Question, ctx: QuestionContext) -> Answer:
    if ctx.checkpoint is None or not ctx.checkpoint.is_dir():
        return Answer(None, f"checkpoint {str(ctx.checkpoint)!r} not found")
    files = sorted(ctx.checkpoint.glob("*.safetensors"))
    if not files:
        return Answer(None, f"no .safetensors files in {ctx.checkpoint}")
    pattern = q.params["pattern"]
    found: dict[str, str] = {}
    for f in files:
        try:
            dtypes = safetensors_dtypes(f)
        except (OSError, ValueError) as exc:
            return Answer(None, f"cannot read the safetensors header of {f}: {exc}")
        found.update({k: v for k, v in dtypes.items() if fnmatch.fnmatchcase(k, pattern)})
    value = ",".join(sorted(set(found.values()))) or "<none>"
    return Answer(value, detail=f"{len(found)} tensors match {pattern!r}")


def _config(q: Question, ctx: QuestionContext) -> Answer:
    path = None if ctx.checkpoint is None else ctx.checkpoint / "config.json"
    if path is None or not path.is_file():
        return Answer(None, f"no config.json at {str(path)!r}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return Answer(None, f"cannot read {path}: {exc}")
    value = _dotted(cfg, q.params["key"])
    return Answer("<absent>" if value is None else _text(value), detail=f"{q.params['key']} of {path}")


def _source(q: Question, ctx: QuestionContext) -> Answer:
    pattern = q.params["path"]
    files = (
        sorted(p for p in ctx.base.glob(pattern) if p.is_file())
        if not Path(pattern).is_absolute()
        else [Path(pattern)]
    )
    files = [f for f in files if f.is_file()]
    if not files:
        return Answer(None, f"no file matches {pattern!r} (relative to {ctx.base})")
    try:
        rx = regex.compile(q.params["pattern"])
    except regex.error as exc:
        return Answer(None, f"pattern {q.params['pattern']!r} is not a regular expression: {exc}")
    count = 0
    for f in files:
        try:
            # A ledger's pattern may backtrack catastrophically ("(a+)+$"): `regex` bounds its time.
            count += len(
                rx.findall(f.read_text(encoding="utf-8", errors="replace"), timeout=SOURCE_TIMEOUT_S)
            )
        except TimeoutError:  # before OSError, of which it is a subclass
            return Answer(
                None,
                f"pattern {q.params['pattern']!r} ran over {SOURCE_TIMEOUT_S:g} s on {f} (catastrophic "
                "backtracking?): simplify it",
            )
        except OSError as exc:
            return Answer(None, f"cannot read {f}: {exc.strerror or exc}")
    return Answer(
        str(count), detail=f"occurrences of {q.params['pattern']!r} in {len(files)} file(s) {pattern!r}"
    )


ASKERS = {  # exactly the types of ledger.QUESTION_TYPES (tests/test_name_lists.py)
    "env": _env,
    "server_info": _server_info,
    "checkpoint_dtype": _checkpoint_dtype,
    "config": _config,
    "source": _source,
}


def answer(q: Question, ctx: QuestionContext) -> Answer:
    """Ask ``q``; never raises for an unavailable source (the answer is ``blocked`` instead)."""
    return ASKERS[q.type](q, ctx)
