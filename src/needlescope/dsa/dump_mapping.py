"""The mapping file: which engine tensor is which reference module's output, and how it was sharded.

A TOML file (the one shipped for SGLang's DeepSeek-V4 is ``mappings/sglang_deepseek_v4.toml``)::

    engine = "sglang"                 # informational
    model_type = "deepseek_v4"        # the reference checkpoint's model_type
    input_ids = "input_ids"           # the dumped name of each pass's token ids
    positions = "positions"           # ... and of their absolute positions (optional in a dump)
    ignore = ["non_intrusive__*.inputs.*"]   # names compared with nothing (fnmatch), counted

    [[tensor]]
    engine = "non_intrusive__model.layers.{layer}.self_attn.wq_b.output"
    reference = "model.layers.{layer}.self_attn.q_b_proj"
    shard = "concat:-1"               # "replicated" (default) | "sum" | "concat:DIM"
    take = "output"                   # "output" (default) | "input": the module's first floating input
    rows = "tokens"                   # "tokens" (default): one row per token of the pass;
                                      # "last": one row per pass, its last token
    kind = "tensor"                   # "tensor" (default) | "topk": indexer entry ids, compared as sets
    precision = "bf16"                # optional: the precision the engine computed it in
                                      # (bf16 | fp16 | fp8_e4m3 | fp32); else detected from the dump

``{layer}`` in ``engine`` matches the layer number in the dumped name; an ``engine`` without it
takes the layer from the file's ``layer_id`` tag (as ``dumper.dump(name, x, layer_id=i)`` writes).
The first ``[[tensor]]`` whose ``engine`` matches a name wins.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from needlescope.dsa.engine_dump import SHARD_RULES
from needlescope.errors import BadInput

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["TensorRule", "DumpMapping", "PRECISIONS", "load_mapping", "SGLANG_DEEPSEEK_V4"]

PRECISIONS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp32")
SGLANG_DEEPSEEK_V4 = "sglang_deepseek_v4"
_LAYER = "{layer}"


@dataclass(frozen=True)
class TensorRule:
    """One ``[[tensor]]`` entry."""

    engine: str
    reference: str
    shard: str = "replicated"
    take: str = "output"
    rows: str = "tokens"
    kind: str = "tensor"
    precision: str | None = None

    @property
    def pattern(self) -> re.Pattern:
        body = re.escape(self.engine).replace(re.escape(_LAYER), r"(?P<layer>\d+)")
        return re.compile(body + r"\Z")

    def reference_name(self, layer: int | None) -> str | None:
        """The reference module's name for ``layer``; None when it needs a layer and has none."""
        if _LAYER not in self.reference:
            return self.reference
        return None if layer is None else self.reference.replace(_LAYER, str(layer))


@dataclass(frozen=True)
class DumpMapping:
    """A parsed mapping file."""

    source: str
    model_type: str
    input_ids: str
    positions: str
    rules: tuple[TensorRule, ...]
    ignore: tuple[str, ...] = ()

    def match(self, name: str, layer_tag: int | None) -> tuple[TensorRule, int | None] | None:
        """(rule, layer) for a dumped name, or None when no rule names it."""
        for rule in self.rules:
            m = rule.pattern.match(name)
            if m is not None:
                layer = int(m.group("layer")) if "layer" in m.groupdict() else layer_tag
                return rule, layer
        return None

    def ignored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.ignore)


def _rule(raw: object, i: int, where: str) -> TensorRule:
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("engine"), str)
        or not isinstance(raw.get("reference"), str)
    ):
        raise BadInput(f"{where}: [[tensor]] {i + 1} needs string keys 'engine' and 'reference'")
    unknown = set(raw) - {"engine", "reference", "shard", "take", "rows", "kind", "precision"}
    if unknown:
        raise BadInput(f"{where}: [[tensor]] {i + 1} has unknown key(s) {sorted(unknown)}")
    rule = TensorRule(**raw)
    shard_ok = rule.shard in ("replicated", "sum") or re.fullmatch(r"concat:-?\d+", rule.shard)
    checks = [
        (shard_ok, f"shard {rule.shard!r} is not one of {', '.join(SHARD_RULES)}"),
        (rule.take in ("output", "input"), f"take {rule.take!r} is not 'output' or 'input'"),
        (rule.rows in ("tokens", "last"), f"rows {rule.rows!r} is not 'tokens' or 'last'"),
        (rule.kind in ("tensor", "topk"), f"kind {rule.kind!r} is not 'tensor' or 'topk'"),
        (rule.precision in (None, *PRECISIONS), f"precision {rule.precision!r} is not one of {PRECISIONS}"),
        (_LAYER not in rule.engine or rule.engine.count(_LAYER) == 1, "engine names {layer} twice"),
    ]
    for ok, msg in checks:
        if not ok:
            raise BadInput(f"{where}: [[tensor]] {i + 1} ({rule.engine!r}): {msg}")
    return rule


def parse_mapping(text: str, where: str) -> DumpMapping:
    """A DumpMapping from the file's text; BadInput naming ``where`` on any problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{where} is not valid TOML: {exc}") from None
    tensors = raw.get("tensor")
    if not isinstance(tensors, list) or not tensors:
        raise BadInput(f"{where} has no [[tensor]] entries")
    ignore = raw.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise BadInput(f"{where}: 'ignore' must be a list of name patterns")
    return DumpMapping(
        source=where,
        model_type=str(raw.get("model_type", "deepseek_v4")),
        input_ids=str(raw.get("input_ids", "input_ids")),
        positions=str(raw.get("positions", "positions")),
        rules=tuple(_rule(t, i, where) for i, t in enumerate(tensors)),
        ignore=tuple(ignore),
    )


def load_mapping(path: str | Path | None = None) -> DumpMapping:
    """The mapping at ``path``, or the shipped SGLang DeepSeek-V4 one (None or its name)."""
    if path is None or str(path) == SGLANG_DEEPSEEK_V4:
        res = resources.files("needlescope.dsa") / "mappings" / f"{SGLANG_DEEPSEEK_V4}.toml"
        return parse_mapping(res.read_text(encoding="utf-8"), SGLANG_DEEPSEEK_V4)
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read the mapping file {str(p)!r}: {exc.strerror or exc}") from None
    return parse_mapping(text, str(p))
