"""``Setting``: one indexer configuration to serve, emulate or compare, as one validated value.

The product's central act is comparing a reference setting with a deployment setting. A
``Setting`` names the indexer numerics (key and query precision, score accumulation dtype,
``index_topk``, the Hadamard rotation) and an optional patch, and nothing else. It is
torch-free, immutable and validated once, so the CLI, the server and the investigation can
pass it across process boundaries without losing anything.

Text form (``str(setting)``, parsed back by ``Setting.parse``)::

    k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table

``topk=cfg`` means the checkpoint's own ``index_topk``; ``hadamard=on|off`` appears only when
the rotation is forced (by default it rotates exactly when a side is ``fp4_e2m1``); ``patch=``
appears only when there is one. Keys may come in any order when parsing; unknown keys, repeated
keys and malformed values are refused with ``BadInput``.

A patch is kept as a ``PatchRef``: the spec the user wrote (``fault:NAME`` or a file path) and
the file it resolves to. Resolving checks that the file exists; it never executes it. Patch
files run arbitrary Python with the caller's rights; they are executed only by the code that
applies a setting to a model (``needlescope.dsa.emulate``), after all other validation.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from pathlib import Path

from needlescope.errors import BadInput

__all__ = [
    "check_chunk",
    "PRECISIONS",
    "SCORE_DTYPES",
    "FAULT_PREFIX",
    "PatchRef",
    "Setting",
    "REFERENCE",
    "check_precision",
    "check_score_dtype",
    "fault_names",
    "serving_fault_names",
]

PRECISIONS: dict[str, int] = {
    "fp32": 32,
    "bf16": 16,
    "fp16": 16,
    "fp8_e4m3": 8,
    "fp8_e4m3_block128": 8,
    "fp4_e2m1": 4,
}
"""Quantiser names (``needlescope.dsa.quant.QUANTIZERS`` implements exactly these) and their bits."""

SCORE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
"""Dtypes the indexer's products and head sum may be accumulated in."""

FAULT_PREFIX = "fault:"
_FAULT_DIR = Path(__file__).parent / "dsa" / "faults"
_SERVING_FAULT_DIR = Path(__file__).parent / "serve" / "faults"
"""Faults of the serving layer (``needlescope.serve.faults``): the server never names them."""


def _faults_in(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


def fault_names() -> list[str]:
    """Names of the built-in faults (``needlescope.dsa.faults`` and ``needlescope.serve.faults``), sorted."""
    return sorted(_faults_in(_FAULT_DIR) + _faults_in(_SERVING_FAULT_DIR))


def serving_fault_names() -> list[str]:
    """Names of the built-in serving faults (scheduling, caches, speculative decoding), sorted."""
    return _faults_in(_SERVING_FAULT_DIR)


def _suggest(value: str, allowed) -> str:
    close = difflib.get_close_matches(value, list(allowed), n=3)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def check_precision(value: str, what: str = "precision") -> str:
    """``value`` if it names a quantiser; BadInput listing the allowed names otherwise."""
    if value not in PRECISIONS:
        raise BadInput(
            f"unknown {what} {value!r}.{_suggest(value, PRECISIONS)} Available: {', '.join(PRECISIONS)}"
        )
    return value


def check_score_dtype(value: str) -> str:
    """``value`` if it names a score dtype; BadInput otherwise."""
    if value not in SCORE_DTYPES:
        raise BadInput(f"unknown score dtype {value!r}; allowed values: {', '.join(SCORE_DTYPES)}")
    return value


@dataclass(frozen=True)
class PatchRef:
    """A patch named by the user and the file it resolves to (never executed here)."""

    spec: str
    """What the user wrote: ``fault:NAME`` or a path."""
    path: Path = field(compare=False)
    """The resolved, absolute file."""

    @classmethod
    def resolve(cls, spec: str | Path) -> PatchRef:
        text = str(spec)
        if text.startswith(FAULT_PREFIX):
            name = text[len(FAULT_PREFIX) :]
            if name not in fault_names():
                raise BadInput(
                    f"unknown fault {name!r}.{_suggest(name, fault_names())} "
                    f"Built-in faults: {', '.join(fault_names())}"
                )
            folder = _SERVING_FAULT_DIR if name in serving_fault_names() else _FAULT_DIR
            return cls(text, folder / f"{name}.py")
        path = Path(text).expanduser()
        if not path.is_file():
            raise BadInput(f"patch file {text!r} does not exist; pass a Python file or fault:NAME")
        return cls(str(path.resolve()), path.resolve())

    @property
    def is_fault(self) -> bool:
        return self.spec.startswith(FAULT_PREFIX)

    @property
    def is_serving_fault(self) -> bool:
        """A built-in serving fault: planted like a bug nobody announced, so never shown."""
        return self.is_fault and self.spec[len(FAULT_PREFIX) :] in serving_fault_names()

    def __str__(self) -> str:
        return self.spec


@dataclass(frozen=True)
class Setting:
    """Indexer numerics plus an optional patch. ``index_topk=None`` keeps the checkpoint's value.

    ``hadamard=None`` rotates exactly when a side is ``fp4_e2m1`` (the trained QAT numerics
    rotate before quantising; the rotation is exact, so it only changes what the quantiser sees).
    """

    index_k: str = "fp32"
    index_q: str = "fp32"
    score_dtype: str = "fp32"
    index_topk: int | None = None
    hadamard: bool | None = None
    patch: PatchRef | None = None

    def __post_init__(self) -> None:
        check_precision(self.index_k, "key precision (index_k)")
        check_precision(self.index_q, "query precision (index_q)")
        check_score_dtype(self.score_dtype)
        if self.index_topk is not None and (
            isinstance(self.index_topk, bool) or not isinstance(self.index_topk, int) or self.index_topk < 1
        ):
            raise BadInput(f"index_topk must be a positive integer, got {self.index_topk!r}")
        if self.hadamard is not None and not isinstance(self.hadamard, bool):
            raise BadInput(f"hadamard must be true, false or unset, got {self.hadamard!r}")
        if isinstance(self.patch, (str, Path)):
            object.__setattr__(self, "patch", PatchRef.resolve(self.patch))

    @property
    def rotates(self) -> bool:
        """Whether queries and keys are Hadamard-rotated before quantising."""
        if self.hadamard is not None:
            return self.hadamard
        return "fp4_e2m1" in (self.index_k, self.index_q)

    @property
    def numerics_only(self) -> Setting:
        """The same numerics without the patch."""
        return replace(self, patch=None)

    def with_(self, **changes) -> Setting:
        """A copy with fields changed (validated again); ``patch`` may be a spec string."""
        return replace(self, **changes)

    def label(self) -> str:
        """The text form; see the module docstring."""
        topk = "cfg" if self.index_topk is None else str(self.index_topk)
        parts = [f"k={self.index_k}", f"q={self.index_q}", f"acc={self.score_dtype}", f"topk={topk}"]
        if self.hadamard is not None:
            parts.append(f"hadamard={'on' if self.hadamard else 'off'}")
        if self.patch is not None:
            parts.append(f"patch={self.patch.spec}")
        return " ".join(parts)

    __str__ = label

    @classmethod
    def parse(cls, text: str) -> Setting:
        """Parse the text form back; BadInput naming the offending token otherwise."""
        keys = {"k": "index_k", "q": "index_q", "acc": "score_dtype", "topk": "index_topk"}
        keys |= {"hadamard": "hadamard", "patch": "patch"}
        fields: dict = {}
        for token in text.split():
            key, sep, value = token.partition("=")
            if not sep or key not in keys or not value:
                raise BadInput(
                    f"bad setting token {token!r} in {text!r}; expected KEY=VALUE with KEY one of "
                    f"{', '.join(keys)} (e.g. 'k=fp8_e4m3 q=fp32 acc=fp32 topk=64')"
                )
            name = keys[key]
            if name in fields:
                raise BadInput(f"setting {text!r} gives {key}= twice")
            if name == "index_topk":
                if value == "cfg":
                    value = None
                elif value.isdigit():
                    value = int(value)
                else:
                    raise BadInput(f"topk must be a positive integer or 'cfg', got {value!r} in {text!r}")
            elif name == "hadamard":
                if value not in ("on", "off"):
                    raise BadInput(f"hadamard must be 'on' or 'off', got {value!r} in {text!r}")
                value = value == "on"
            fields[name] = value
        return cls(**fields)

    def numerics_json(self) -> dict:
        """The numerics alone (``to_json`` without ``patch``), as artifacts record them."""
        return {k: v for k, v in self.to_json().items() if k != "patch"}

    def to_json(self) -> dict:
        """JSON form: every field; ``patch`` is the spec string or null."""
        return {
            "index_k": self.index_k,
            "index_q": self.index_q,
            "score_dtype": self.score_dtype,
            "index_topk": self.index_topk,
            "hadamard": self.hadamard,
            "patch": None if self.patch is None else self.patch.spec,
        }

    @classmethod
    def from_json(cls, obj: dict) -> Setting:
        """Inverse of ``to_json``; unknown keys are refused."""
        if not isinstance(obj, dict):
            raise BadInput(f"a setting must be a JSON object, got {type(obj).__name__}")
        unknown = set(obj) - {"index_k", "index_q", "score_dtype", "index_topk", "hadamard", "patch"}
        if unknown:
            raise BadInput(f"unknown setting field(s) {', '.join(sorted(unknown))}")
        return cls(**obj)


REFERENCE = Setting()
"""fp32 keys, queries and scores; the checkpoint's own ``index_topk``; no patch."""


def check_chunk(chunk: int | None) -> int | None:
    """A prefill chunk (``--prefill-chunk``, a ledger's ``prefill_chunk``) validated: None (one pass) or a positive token count; BadInput otherwise."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise BadInput(f"chunk must be a positive number of tokens (or unset for one pass), got {chunk!r}")
    return chunk
