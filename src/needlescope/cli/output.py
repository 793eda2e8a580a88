"""The one place the CLI prints through: rich consoles with markup off unless the caller says
the text is our own template.

rich reads ``[...]`` as markup: a path, URL, server message or model answer holding ``[/x]``
crashed a command with a traceback, and ``[symptom]`` or ``needlescope[watch]`` vanished from
messages. Every command prints through ``console`` / ``err_console`` from here, which treat every string
as plain text (markup and highlighting off, table cells included; style with ``style=`` or a
``rich.text.Text``). Styled lines go through ``say``: the
template is ours (markup allowed), every value is escaped before it is put in:

    console.say("root cause: [bold]{}[/]", verdict)      # verdict printed as written

Help text is plain too: every Typer app is built by ``typer_app`` (``rich_markup_mode=None``).
Printed to a pipe or a file, a line is never wrapped (``soft_wrap``); ``clip`` shortens a line
for a terminal's progress column at a word boundary, never inside a setting string.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

__all__ = ["SafeConsole", "clip", "console", "err_console", "typer_app"]


class SafeConsole(Console):
    """A rich console that shows strings as written: markup, highlighting and emoji codes off for
    ``print`` and for every string it renders (table cells included; ``ours:zzz:`` in a message
    is not a sleeping face); ``say`` fills our own markup template with escaped values."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(markup=False, highlight=False, emoji=False, **kw)
        if not self.is_terminal:
            # A log or a pipe has no width: a line is never broken (rich would cut at 80 columns,
            # splitting a `next:` command in two); tables keep their own layout.
            self.soft_wrap = True

    def say(self, template: str, *values: Any, **kw: Any) -> None:
        """``template.format(*values)`` with markup read from ``template`` only."""
        self.print(template.format(*(escape(str(v)) for v in values)), markup=True, **kw)


console = SafeConsole()
err_console = SafeConsole(stderr=True)


def clip(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters at a space (a whole word dropped, never half of
    ``patch=fault:indexer_page_table``), with ``…`` where it was cut."""
    if len(text) <= width:
        return text
    head = text[: width - 1]
    cut = head.rfind(" ")
    return (head[:cut] if cut > 0 else head).rstrip() + "…"


HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
"""``-h`` as well as ``--help``, on every command (no option of ours takes ``-h``)."""


class WholeSentenceGroup(TyperGroup):
    """A command group whose command list gives each command's first sentence whole, wrapped
    under its name: click cuts it to the terminal's width with "...", so a new user read
    "Measure needle recall across lengths and depths and find..." for every command."""

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1 << 16)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def typer_app(**kw: Any) -> typer.Typer:
    """A Typer app whose help text is shown as written (no rich markup: ``[watch]`` stays), whose
    command list is never cut (``WholeSentenceGroup``); its commands and sub-apps answer ``-h``
    too (``HELP_OPTIONS``). A repeatable option names its value with ``metavar`` (``<path>``):
    Typer would print the Python type, ``<list[str]>``."""
    return typer.Typer(rich_markup_mode=None, context_settings=HELP_OPTIONS, cls=WholeSentenceGroup, **kw)
