"""Help text reads whole (issue 54 item 18): every group's command list gives each command's first
sentence uncut (click cut it to the width with "..."), and no option's value reads as a Python
type (a repeatable option read ``<list[str]>``). Every command of the tree, rendered in-process
at 80 columns as a terminal would."""

from __future__ import annotations

import re

import typer.main
from typer.testing import CliRunner

from needlescope.cli.main import app


def _tree(command, path: tuple[str, ...] = ()):
    """(argv path, command) for ``command`` and everything under it."""
    yield path, command
    if hasattr(command, "commands"):  # a group (Typer vendors its own click)
        for name, sub in command.commands.items():
            yield from _tree(sub, (*path, name))


def _help(path: tuple[str, ...]) -> str:
    res = CliRunner().invoke(app, [*path, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert res.exit_code == 0, (path, res.output)
    return res.output


def _first_sentence(text: str) -> str:
    words = text.partition("\n\n")[0].split()
    for i, word in enumerate(words):
        if word.endswith(".") and (i == len(words) - 1 or not words[i + 1][0].islower()):
            return " ".join(words[: i + 1])
    return " ".join(words)


TREE = list(_tree(typer.main.get_command(app)))


def test_every_command_list_gives_each_first_sentence_whole():
    groups = [(p, c) for p, c in TREE if hasattr(c, "commands")]
    assert len(groups) > 5  # the top level and its sub-apps
    for path, group in groups:
        shown = _help(path)
        # joined as one line; a word broken after its hyphen ("selected-\nvalue") joined again
        listing = re.sub(r"- ", "-", " ".join(shown.partition("Commands:")[2].split()))
        assert "..." not in listing, (path, shown)
        for name, sub in group.commands.items():
            assert f"{name} {_first_sentence(sub.help or '')}" in listing, (path, name, shown)


def test_no_option_value_reads_as_a_python_type():
    odd = re.compile(r"<(list|tuple|dict|set)\[|<Path>|<PosixPath>")
    for path, _ in TREE:
        shown = _help(path)
        assert not odd.search(shown), (path, odd.search(shown).group(0), shown)
