"""Group a scanned dump by tensor and pass, and recover the token ids and positions it ran on.

``group_dump(files, mapping)`` sorts every dumped name into: the token fields (``input_ids``,
``positions``), entries the mapping names (one per (name, layer), with its shards per pass and
rank), names the mapping ignores on purpose, names it does not know, and names whose rule needs
a layer the file does not give. ``token_layout`` turns the per-pass ids and positions into one
sequence of ids (the reference's input) and, per pass, the positions its rows stand for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from needlescope.dsa.dump_mapping import DumpMapping, TensorRule
from needlescope.dsa.engine_dump import DumpFile, load_value, merge_shards
from needlescope.errors import BadInput

__all__ = ["DumpEntry", "GroupedDump", "group_dump", "token_layout", "merged"]


@dataclass
class DumpEntry:
    """One mapped tensor of the dump: a (name, layer) and its files per pass and rank."""

    name: str
    layer: int | None
    rule: TensorRule
    reference: str
    files: dict[int, list[DumpFile]] = field(default_factory=dict)  # pass -> files (one per rank)

    @property
    def ranks(self) -> list[int]:
        return sorted({f.rank for fs in self.files.values() for f in fs})


@dataclass
class GroupedDump:
    passes: list[int]
    entries: list[DumpEntry]
    tokens: dict[str, dict[int, list[DumpFile]]]  # "input_ids" | "positions" -> pass -> files
    unknown: list[str]
    ignored: list[str]
    no_layer: list[str]
    ranks: list[int]


def _add(pass_files: list[DumpFile], f: DumpFile) -> None:
    """Append ``f`` to one pass's files of a compared name; a second value of one rank is refused."""
    if any(g.rank == f.rank for g in pass_files):
        raise BadInput(
            f"the dump holds {f.name!r} twice for pass {f.pass_id}, layer {f.layer}, rank {f.rank} "
            "(a module called twice per pass); give a dump with one value per (pass, name, layer, rank)"
        )
    pass_files.append(f)


def _token_copy(pass_files: list[DumpFile], f: DumpFile) -> None:
    """Keep, per rank, one file of a token field in a pass: the ForwardBatch's (no ``layer_id``;
    SGLang's hooks also dump ``positions`` and ``input_ids`` again for every module that takes them
    as keywords, tagged with the layer), else the first by ``dump_index``."""
    for i, g in enumerate(pass_files):
        if g.rank == f.rank:
            if (f.layer is not None, f.dump_index) < (g.layer is not None, g.dump_index):
                pass_files[i] = f
            return
    pass_files.append(f)


def group_dump(files: list[DumpFile], mapping: DumpMapping) -> GroupedDump:
    """Sort the dump's files (see the module docstring). A compared name with two values for one
    (pass, layer, rank) is refused; a token field's copies are reduced to one (``_token_copy``);
    names compared with nothing may repeat."""
    entries: dict[tuple[str, int | None], DumpEntry] = {}
    tokens: dict[str, dict[int, list[DumpFile]]] = {"input_ids": {}, "positions": {}}
    unknown, ignored, no_layer = set(), set(), set()
    for f in files:
        field_name = {mapping.input_ids: "input_ids", mapping.positions: "positions"}.get(f.name)
        if field_name is not None:
            _token_copy(tokens[field_name].setdefault(f.pass_id, []), f)
            continue
        hit = mapping.match(f.name, f.layer)
        if hit is None:
            (ignored if mapping.ignored(f.name) else unknown).add(f.name)
            continue
        rule, layer = hit
        reference = rule.reference_name(layer)
        if reference is None:
            no_layer.add(f.name)
            continue
        entry = entries.setdefault((f.name, layer), DumpEntry(f.name, layer, rule, reference))
        _add(entry.files.setdefault(f.pass_id, []), f)
    return GroupedDump(
        passes=sorted({f.pass_id for f in files}),
        entries=list(entries.values()),
        tokens=tokens,
        unknown=sorted(unknown),
        ignored=sorted(ignored),
        no_layer=sorted(no_layer),
        ranks=sorted({f.rank for f in files}),
    )


def merged(files: list[DumpFile], rule: str) -> torch.Tensor:
    """One pass's tensor from its per-rank files (``engine_dump.merge_shards``)."""
    return merge_shards([(f.rank, load_value(f.path)[0]) for f in files], rule)


def _field(files: dict[int, list[DumpFile]], p: int, what: str, context: int | None) -> torch.Tensor | None:
    """One pass's ``input_ids`` or ``positions``, the same on every rank; BadInput for more values
    than the model's ``context`` (checked before they are read out: a file of a few hundred bytes
    may hold a zero-stride tensor of a billion values)."""
    if p not in files:
        return None
    values = []
    for f in sorted(files[p], key=lambda f: f.rank):
        t = load_value(f.path)[0]
        if context is not None and t.numel() > context:
            raise BadInput(
                f"dump file {f.path.name!r}: {t.numel()} {what} in pass {p}, more than the model's context of "
                f"{context} tokens: a dump of another request or a corrupt file"
            )
        values.append(t.reshape(-1).long())
    if any(not torch.equal(v, values[0]) for v in values[1:]):
        raise BadInput(f"the ranks dumped different {what} in pass {p}")
    return values[0]


def token_layout(
    grouped: GroupedDump,
    prompt_ids: list[int] | None,
    *,
    context: int | None = None,
    vocab: int | None = None,
) -> tuple[list[int], dict[int, torch.Tensor]]:
    """(the sequence's token ids, per pass the absolute positions of its rows).

    Ids come from the dump's ``input_ids`` (checked against ``prompt_ids`` where both exist) or
    from ``prompt_ids``. Positions come from the dump's ``positions``; without them passes are
    taken to follow one another (the first starting at 0). One request per dump: a position
    given two different ids, or a gap, is refused. ``context`` (the model's positions) bounds
    every position and ``vocab`` (its vocabulary size) every id: a position past the context
    (one shifted by 2e8 would build a sequence of 2e8 tokens) or an id outside the vocabulary is
    BadInput, before anything is built from it.
    """
    ids_of, pos_of = grouped.tokens["input_ids"], grouped.tokens["positions"]
    if not ids_of and prompt_ids is None:
        raise BadInput("the dump carries no input_ids; give the prompt it ran on (--prompt)")
    passes = sorted(set(ids_of) | set(pos_of)) if (ids_of or pos_of) else grouped.passes
    positions: dict[int, torch.Tensor] = {}
    by_pos: dict[int, int] = {}
    offset = 0
    for p in passes:
        ids, pos = _field(ids_of, p, "input_ids", context), _field(pos_of, p, "positions", context)
        if pos is None:
            n = len(ids) if ids is not None else (len(prompt_ids) if len(passes) == 1 else None)
            if n is None:
                raise BadInput(
                    f"pass {p} has neither input_ids nor positions; the dump must carry one of them"
                )
            pos = torch.arange(offset, offset + n)
        if len(pos) and int(pos.min()) < 0:
            # A negative position would index the reference's rows from the end: wrong rows compared.
            raise BadInput(f"pass {p}: the dump's positions include {int(pos.min())}; positions count from 0")
        if context is not None and len(pos) and int(pos.max()) >= context:
            raise BadInput(
                f"pass {p}: the dump's positions reach {int(pos.max())}, beyond the model's context of {context} "
                "tokens (max_position_embeddings); positions count from 0 within one request"
            )
        if (
            vocab is not None
            and ids is not None
            and len(ids)
            and not (0 <= int(ids.min()) and int(ids.max()) < vocab)
        ):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise BadInput(
                f"pass {p}: the dump's input_ids include {bad}, outside the model's vocabulary 0..{vocab - 1}: "
                "a dump of another model's tokenizer, or a corrupt file"
            )
        if ids is not None and len(ids) != len(pos):
            raise BadInput(f"pass {p}: {len(ids)} input_ids but {len(pos)} positions (one request per dump)")
        for j, t in enumerate(pos.tolist()):
            token = int(ids[j]) if ids is not None else None
            if token is not None and by_pos.setdefault(t, token) != token:
                raise BadInput(f"position {t} has two different token ids in the dump (one request per dump)")
        positions[p] = pos
        offset = int(pos.max()) + 1 if len(pos) else offset
    length = offset if not by_pos else max(by_pos) + 1
    if prompt_ids is not None:
        length = max(length, len(prompt_ids))
        for t, token in by_pos.items():
            if t < len(prompt_ids) and prompt_ids[t] != token:
                raise BadInput(
                    f"the dump's token at position {t} ({token}) differs from the prompt's ({prompt_ids[t]}); "
                    "give the prompt the engine ran on"
                )
    seq = [by_pos.get(t, prompt_ids[t] if prompt_ids is not None and t < len(prompt_ids) else None)
           for t in range(length)]  # fmt: skip
    gaps = [t for t, x in enumerate(seq) if x is None]
    if gaps:
        raise BadInput(f"the dump gives no token id for position(s) {gaps[:5]}; give the prompt (--prompt)")
    return [int(x) for x in seq], positions
