"""The one option group that builds a ``Setting``: ``serve``, ``indexer rank-dump|sweep|diff``, ``serve-probe-explain``.

Every command that takes an indexer setting declares its flags with these annotated types and
turns them into a ``needlescope.setting.Setting`` with ``numerics_from_flags``, so the flags,
their defaults (``needlescope.setting.REFERENCE``) and the validation messages are the same
everywhere. The patch is attached last, with ``with_patch``, after every other input has been
checked: a patch file runs arbitrary Python with the caller's rights, so nothing should run
it for a command that is going to be refused anyway. Resolving it only checks that the file
exists; the file's body executes once per process, when the setting is first applied.
"""

from __future__ import annotations

from typing import Annotated

import typer

from needlescope.setting import PRECISIONS, REFERENCE, SCORE_DTYPES, Setting

__all__ = [
    "PATCH_HELP",
    "IndexK",
    "IndexQ",
    "ScoreDtype",
    "IndexTopk",
    "Patch",
    "numerics_from_flags",
    "with_patch",
]

PATCH_HELP = (
    "Python file defining apply(model) (may return an undo callable), or a built-in fault:NAME. "
    "WARNING: a patch file runs arbitrary Python with your rights; it runs once, after every "
    "other input has been checked."
)

_NAMES = ", ".join(PRECISIONS)

IndexK = Annotated[
    str | None,
    typer.Option("--index-k", help=f"Index-key precision: {_NAMES} (default {REFERENCE.index_k})."),
]
IndexQ = Annotated[
    str | None,
    typer.Option("--index-q", help=f"Index-query precision: {_NAMES} (default {REFERENCE.index_q})."),
]
ScoreDtype = Annotated[
    str | None,
    typer.Option(
        "--score-dtype",
        help=f"Indexer score accumulation: {' | '.join(SCORE_DTYPES)} (default {REFERENCE.score_dtype}).",
    ),
]
IndexTopk = Annotated[
    int | None, typer.Option("--index-topk", help="Indexer top-k (default: the checkpoint's).")
]
Patch = Annotated[str | None, typer.Option("--patch", help=PATCH_HELP)]


def numerics_from_flags(
    index_k: str | None = None,
    index_q: str | None = None,
    score_dtype: str | None = None,
    index_topk: int | None = None,
) -> Setting:
    """The setting the numeric flags name; a flag not given keeps ``REFERENCE``'s value."""
    return Setting(
        index_k=REFERENCE.index_k if index_k is None else index_k,
        index_q=REFERENCE.index_q if index_q is None else index_q,
        score_dtype=REFERENCE.score_dtype if score_dtype is None else score_dtype,
        index_topk=index_topk,
    )


def with_patch(setting: Setting, patch: str | None) -> Setting:
    """``setting`` with ``--patch`` resolved (BadInput if it names nothing); never executes it."""
    return setting if patch is None else setting.with_(patch=patch)
