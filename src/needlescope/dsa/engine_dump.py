"""Read an engine's tensor dump in SGLang's dumper layout and merge its tensor-parallel shards.

The layout (``sglang/srt/debug_utils/dumper.py``, read in SGLang's public source): one file per
dumped value, ``DIR/EXP_NAME/STEM.pt``. The stem is ``___``-joined ``key=value`` tags, in this
order in current versions::

    step=3___rank=1___dump_index=57___name=non_intrusive__model.layers.2.self_attn.wq_b.output___recompute_status=disabled___layer_id=2

* the forward pass: ``step`` (current), ``curr_step`` (the version ``dump_loader.read_meta``
  reads) or ``forward_pass_id`` (older versions, directory ``sglang_dump_<time>``);
* ``rank``: the process's ``torch.distributed`` rank; with tensor parallelism alone it is the TP
  rank. A ``tp_rank`` tag (``DUMPER_INCLUDE_PARALLEL_RANK_IN_FILENAME=1``) takes precedence;
* ``layer_id``: the layer, from the call's keyword or the dumper's context (the non-intrusive
  hooks set it on each ``model.layers.N``); ``dump_index`` orders the files of one rank.

The file holds ``torch.save(value)`` (older versions) or ``torch.save({"value": value, "meta":
{...}})``. **These are pickles.** needlescope opens them only with ``torch.load(...,
weights_only=True)``, which restores tensors and plain containers and refuses any other object,
so a dump cannot run code; a file it refuses is reported, never loaded another way. A
``.safetensors`` file with the same stem and a tensor named ``value`` is read with safetensors.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from needlescope.errors import BadInput

__all__ = [
    "PASS_TAGS",
    "DumpFile",
    "find_dump_dir",
    "parse_stem",
    "scan_dump",
    "load_value",
    "check_tensor_parallel",
    "merge_shards",
    "SHARD_RULES",
]

PASS_TAGS = ("step", "curr_step", "forward_pass_id")
"""Tags naming the forward pass, newest dumper first."""
SUFFIXES = (".pt", ".safetensors")
SHARD_RULES = ("replicated", "sum", "concat:DIM")


@dataclass(frozen=True)
class DumpFile:
    """One dumped value: its path and the tags its file name carries."""

    path: Path
    pass_id: int
    rank: int
    name: str
    dump_index: int
    layer: int | None
    tags: dict = field(default_factory=dict)


def parse_stem(stem: str) -> dict[str, str]:
    """``'a=1___name=x.y___b=2'`` -> ``{'a': '1', 'name': 'x.y', 'b': '2'}``; ValueError if a part has no '='."""
    out: dict[str, str] = {}
    for part in stem.split("___"):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"part {part!r} is not key=value")
        out[key] = value
    return out


def _has_dump_files(d: Path) -> bool:
    return any(p.suffix in SUFFIXES and p.is_file() for p in d.iterdir())


def find_dump_dir(path: str | Path) -> Path:
    """The directory holding the dump files: ``path`` itself, or its one experiment subdirectory.

    SGLang writes under ``DUMPER_DIR/EXP_NAME/`` (``dump_<time>``; older: ``sglang_dump_<time>``),
    so either directory may be given. BadInput when there is none, or several to choose from.
    """
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"dump directory {str(p)!r} does not exist or is not a directory")
    if _has_dump_files(p):
        return p
    subs = sorted(d for d in p.iterdir() if d.is_dir() and _has_dump_files(d))
    if len(subs) == 1:
        return subs[0]
    if not subs:
        raise BadInput(
            f"{str(p)!r} holds no dump files (*.pt or *.safetensors), directly or in one subdirectory; "
            "give the directory SGLang's dumper wrote (DUMPER_DIR/EXP_NAME)"
        )
    names = ", ".join(d.name for d in subs[:5])
    raise BadInput(f"{str(p)!r} holds several dumps ({names}); give one of them")


def _int_tag(tags: dict[str, str], key: str, path: Path) -> int:
    try:
        return int(tags[key])
    except ValueError:
        raise BadInput(f"dump file {path.name!r}: tag {key}={tags[key]!r} is not an integer") from None


def _describe(path: Path) -> DumpFile:
    try:
        tags = parse_stem(path.stem)
    except ValueError as exc:
        raise BadInput(
            f"dump file {path.name!r} is not in SGLang's dumper layout (key=value tags joined by '___'): {exc}"
        ) from None
    pass_tag = next((t for t in PASS_TAGS if t in tags), None)
    missing = [k for k in ("rank", "name", "dump_index") if k not in tags]
    if pass_tag is None or missing:
        need = missing + ([] if pass_tag is not None else ["step (or forward_pass_id)"])
        raise BadInput(f"dump file {path.name!r} lacks the tag(s) {', '.join(need)}")
    rank = _int_tag(tags, "tp_rank" if "tp_rank" in tags else "rank", path)
    layer = _int_tag(tags, "layer_id", path) if "layer_id" in tags else None
    return DumpFile(
        path=path,
        pass_id=_int_tag(tags, pass_tag, path),
        rank=rank,
        name=tags["name"],
        dump_index=_int_tag(tags, "dump_index", path),
        layer=layer,
        tags=tags,
    )


def scan_dump(path: str | Path) -> list[DumpFile]:
    """Every dump file under ``path`` (see ``find_dump_dir``), ordered by (pass, rank, dump_index)."""
    d = find_dump_dir(path)
    files = [_describe(p) for p in sorted(d.iterdir()) if p.suffix in SUFFIXES and p.is_file()]
    return sorted(files, key=lambda f: (f.pass_id, f.rank, f.dump_index))


def _load_object(path: Path):
    """(value, meta) of one dump file as stored, on the CPU (module docstring: weights_only only)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                if "value" not in f.keys():
                    raise BadInput(f"dump file {path.name!r} has no tensor named 'value'")
                return f.get_tensor("value"), dict(f.metadata() or {})
        except BadInput:
            raise
        except Exception as exc:  # safetensors raises its own error types and OSError
            raise BadInput(
                f"dump file {path.name!r} is not a readable safetensors file ({type(exc).__name__}: {exc})"
            ) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise BadInput(
            f"dump file {path.name!r} cannot be read with torch.load(weights_only=True) "
            f"(needlescope never unpickles anything else): {str(exc).splitlines()[0][:200]}"
        ) from None
    if isinstance(obj, dict) and "value" in obj:
        return obj["value"], obj.get("meta") or {}
    return obj, {}


def load_value(path: Path) -> tuple[torch.Tensor, dict]:
    """(tensor, meta) of one dump file, on the CPU. BadInput if it holds no tensor or is refused.

    ``.pt``: ``torch.load(weights_only=True)`` only (see the module docstring); ``.safetensors``:
    the tensor ``value`` and the file's string metadata.
    """
    obj, meta = _load_object(path)
    if not isinstance(obj, torch.Tensor):
        raise BadInput(f"dump file {path.name!r} holds a {type(obj).__name__}, not a tensor")
    return obj, meta


_NOT_TP_ALONE = (("pp_size", "pipeline"), ("attn_dp_size", "DP-attention"), ("attn_cp_size", "context"))


def check_tensor_parallel(files: list[DumpFile]) -> None:
    """Refuse a dump whose ranks are not tensor-parallel ranks alone.

    SGLang's dumper stores ``sglang_parallel_info`` (``tp_size``, ``pp_size``, ``attn_dp_size``,
    ...) in every file's meta; the first file's is read. With pipeline, DP-attention or context
    parallelism the ranks hold different layers or tokens, which ``merge_shards`` cannot join.
    """
    if not files:
        return
    info = _load_object(files[0].path)[1].get("sglang_parallel_info")
    if not isinstance(info, dict):
        return
    for key, what in _NOT_TP_ALONE:
        try:
            size = int(info.get(key, 1) or 1)
        except (TypeError, ValueError):
            raise BadInput(
                f"dump file {files[0].path.name!r}: sglang_parallel_info {key}={info[key]!r} is not an integer"
            ) from None
        if size > 1:
            raise BadInput(
                f"the dump was written with {what} parallelism ({key}={info[key]} in {files[0].path.name!r}); "
                "compare-dump merges tensor-parallel ranks only: dump with tensor parallelism alone"
            )


def merge_shards(shards: Iterable[tuple[int, torch.Tensor]], rule: str) -> torch.Tensor:
    """One tensor from its per-rank shards, merged in rank order (numeric, never by file name).

    shards: (rank, tensor) pairs, ranks distinct. ``rule``:

    * ``"replicated"``: every rank holds the whole tensor (a row-parallel layer's reduced output,
      a replicated layer); rank 0's copy, after checking the others have its shape;
    * ``"sum"``: each rank holds a partial sum (a row-parallel layer whose all-reduce comes later);
      their sum (in float32, returned in the shards' dtype);
    * ``"concat:DIM"``: each rank holds a slice along DIM (a column-parallel layer's output, one
      rank's heads); concatenated along DIM in rank order.
    """
    ordered = sorted(shards, key=lambda s: s[0])
    ranks = [r for r, _ in ordered]
    if len(set(ranks)) != len(ranks):
        raise BadInput(f"ranks {ranks} repeat: one value per rank is expected")
    tensors = [t for _, t in ordered]
    if rule == "replicated":
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise BadInput(f"a replicated tensor has different shapes on its ranks: {sorted(shapes)}")
        return tensors[0]
    if rule == "sum":
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise BadInput(f"the partial sums have different shapes on their ranks: {sorted(shapes)}")
        # Summed in float32 and rounded once to the shards' dtype, as an all-reduce returns it.
        return torch.stack([t.float() for t in tensors]).sum(0).to(tensors[0].dtype)
    if rule.startswith("concat:"):
        try:
            dim = int(rule.split(":", 1)[1])
        except ValueError:
            raise BadInput(f"shard rule {rule!r}: DIM must be an integer") from None
        try:
            return torch.cat(tensors, dim=dim)
        except (RuntimeError, IndexError):  # torch's words for shards that do not join
            shapes = [tuple(t.shape) for t in tensors]
            raise BadInput(
                f"the shards (shapes {shapes} in rank order) do not join along dim {dim}"
            ) from None
    raise BadInput(f"unknown shard rule {rule!r}; use one of {', '.join(SHARD_RULES)}")
