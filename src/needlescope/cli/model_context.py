"""The in-process tools' context check: lengths beyond the checkpoint's context are refused in one
line before the model loads (the HTTP tools read a server's context the same way, from
``targets.limits``), and so is an ``index_topk`` no context could hold.

Without the check, ``indexer sweep --lengths 9000`` on the 8192-token organism ran for minutes
with transformers warnings and reported recall "to 9000 tokens" (issue 38, item 10).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from needlescope.errors import BadInput

__all__ = ["check_lengths", "check_topk", "model_context"]


def model_context(model: str | Path) -> tuple[int, str] | None:
    """(context in tokens, where it was read) of a checkpoint ('organism' or a directory); None
    when its config.json states none or the checkpoint is not there (the tool says so itself)."""
    from needlescope.dsa.checkpoint import ORGANISM, context_tokens, shipped_dir

    path = shipped_dir() if str(model) == ORGANISM else Path(model)
    if not (path / "config.json").is_file():
        return None
    context = context_tokens(path)
    if context is None:
        return None
    name = ORGANISM if str(model) == ORGANISM else path.name
    return context, f"{name}'s config.json max_position_embeddings"


def check_lengths(
    model: str | Path, lengths: Iterable[int], answer_tokens: int, flag: str = "--lengths"
) -> None:
    """BadInput naming the lengths that, with ``answer_tokens`` generated, exceed the context."""
    found = model_context(model)
    if found is None:
        return
    context, source = found
    room = context - answer_tokens
    too_long = [n for n in lengths if n > room]
    if too_long:
        raise BadInput(
            f"{flag} {','.join(map(str, too_long))}: the model's context is {context} tokens ({source}), so "
            f"a prompt holds at most {room} with {answer_tokens} answer tokens; pass lengths up to {room}"
        )


def check_topk(model: str | Path, topk: Iterable[int | None], flag: str = "--index-topk") -> None:
    """BadInput for an index_topk above the model's context: more entries than any prompt has."""
    found = model_context(model)
    if found is None:
        return
    context, source = found
    beyond = [k for k in topk if k is not None and k > context]
    if beyond:
        raise BadInput(
            f"{flag} {','.join(map(str, beyond))}: more entries than the model's context of {context} "
            f"tokens ({source}) can hold; pass an index_topk up to {context}"
        )
