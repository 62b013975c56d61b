"""How `tlt --help` reads: metavars (CONFIG, RUN_ID, KEY=VALUE) instead of typer's Python types.

Typer's rich help panels print each option's Python type (`<list[str]>`, `<bool>`) and a required
argument as `{config}`; click's plain formatter, with a metavar on every option, prints what the
user types. Arguments need one more step (`plain_arguments`).
"""
from __future__ import annotations

import typer

HELP = {"no_args_is_help": True, "rich_markup_mode": None}  # keyword arguments of every typer.Typer


class _PlainArgument(typer.core.TyperArgument):
    """An argument shown by its metavar alone: CONFIG in the usage line (typer writes {CONFIG}), and
    no Python type beside it in the help (typer writes CONFIG <path>)."""

    def _usage_display_name(self) -> str:
        name = self.display_name_raw + ("..." if self.nargs != 1 and not self.display_name_raw.endswith("...") else "")
        return name if self.required else f"[{name}]"

    def display_type_rich(self, ctx) -> str | None:
        return None


def plain_arguments(command) -> None:
    for param in command.params:
        if type(param) is typer.core.TyperArgument:
            param.__class__ = _PlainArgument
    for sub in getattr(command, "commands", {}).values():
        plain_arguments(sub)
