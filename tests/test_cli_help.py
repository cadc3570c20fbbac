"""A CLI that explains itself: every command, argument and option of `feddg` has help text, shown by --help."""

from __future__ import annotations

import re
from collections.abc import Iterator

import click
import pytest
import typer
from typer.testing import CliRunner

from feddg.cli import app


def _walk(cmd: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(typer.main.get_command(app)))


def _help_page(path: tuple[str, ...]) -> str:
    """``feddg ... --help`` with the box drawing removed and white space folded (wrapped lines rejoin)."""
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "160", "TERMINAL_WIDTH": "160"})
    assert res.exit_code == 0, res.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.output).split())


def test_the_walk_finds_every_command():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"run", "sweep", "report", "datasets", "methods", "models", "bench", "bench models"} <= names


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) or "feddg" for p, _ in COMMANDS])
def test_every_command_argument_and_option_has_help(path, cmd):
    page = _help_page(path)
    where = f"feddg {' '.join(path)}".strip()
    assert (cmd.help or "").strip(), f"{where} has no description"
    assert " ".join(cmd.help.split()[:4]) in page
    for param in cmd.params:
        text = " ".join((getattr(param, "help", None) or "").split())
        assert text, f"{where}: {param.human_readable_name} has no help text"
        assert " ".join(text.split()[:4]) in page, f"{where}: help of {param.human_readable_name} not shown"
        if isinstance(param.type, click.Choice):  # the allowed values are listed ([a|b] options, {a|b} arguments)
            choices = "|".join(map(str, param.type.choices))
            assert f"[{choices}]" in page or f"{{{choices}}}" in page, param.name
    for name, sub in getattr(cmd, "commands", {}).items():  # a group lists its commands with a summary
        assert name in page and (sub.short_help or sub.help or "").split()[0] in page


def test_run_lists_the_engines():
    page = _help_page(("run",))
    assert "--engine [inprocess|flower]" in page
