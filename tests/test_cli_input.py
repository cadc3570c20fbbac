"""Bad command-line input ends in one line naming the option or key, never a traceback or a run that cannot mean
anything (a certificate valid for 0 days, a benchmark of 0 repeats)."""

from __future__ import annotations

import math
from pathlib import Path

import click
import pytest
import typer
from pydantic import ValidationError
from test_cli_help import COMMANDS
from typer.testing import CliRunner

from feddg.cli import _numbers, _user_errors, app
from feddg.config import AuditConfig


def _numeric(param: click.Parameter) -> bool:
    return isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType))


def test_every_numeric_option_declares_its_range():
    found, unbounded = 0, []
    for path, cmd in COMMANDS:
        for param in cmd.params:
            if _numeric(param):
                found += 1
                if not isinstance(param.type, (click.IntRange, click.FloatRange)):
                    unbounded.append(f"feddg {' '.join(path)} {param.opts[0]}")
    assert found >= 25  # the walk sees the options (bench, audit, sweep, ...)
    assert unbounded == []


CASES = [
    (["bench", "w1", "--repeats", "0"], "--repeats"),
    (["bench", "models", "--seconds", "0"], "--seconds"),
    (["bench", "models", "--threads", "0"], "--threads"),
    (["bench", "memory", "--clients", "5,abc"], "--clients"),
    (["bench", "memory", "--clients", "0"], "--clients"),
    (["bench", "memory", "--per-client", "3", "--budgets-mb", "none,x"], "--budgets-mb"),
    (["flower", "certs", "unused", "--host", "127.0.0.1", "--days", "0"], "--days"),
    (["eval", "unused", "--dataset", "digits-dg", "--max-per-domain", "0"], "--max-per-domain"),
    (["audit", "privacy", "unused", "--per-client", "0"], "--per-client"),
    (["audit", "privacy", "unused", "--noise", "-1"], "--noise"),
    (["run", "configs/demo.yaml", "-o", "seed=-1"], "seed:"),
    (["sweep", "configs/demo.yaml", "-o", "sweep.seeds=[0,-2]"], "sweep.seeds.1:"),
    (["bench", "models", "--names", "cnn@x"], "'cnn@x': the size after @"),
    (["bench", "models", "--names", "cnn@2\u00b2"], "'cnn@2\u00b2': the size after @"),  # '²'.isdigit() is true
]


@pytest.mark.parametrize(("args", "named"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_refused_in_one_line_naming_it(args, named):
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit)  # typer's usage error or feddg's error line: no traceback
    assert named in res.output
    assert "Traceback" not in res.output
    assert not Path("unused").exists()  # the cases' relative output path, in the working directory


def test_a_settings_model_built_from_options_is_reported_by_its_keys(capsys):
    with pytest.raises(typer.Exit) as stop, _user_errors():
        AuditConfig.model_validate({"per_client": 0, "seed": -1})
    assert stop.value.exit_code == 2
    text = capsys.readouterr().out
    assert text.count("\n") == 1  # one line
    assert "error: per_client: Input should be greater than or equal to 1; seed: Input should be" in text
    assert "pydantic" not in text and "validation error" not in text


def test_a_validation_error_is_still_a_value_error():  # so library callers catching ValueError keep working
    assert issubclass(ValidationError, ValueError)


def test_numbers_keep_their_order_and_budgets_take_none_and_zero():
    assert _numbers("100, 200,3400", int, "--clients") == [100, 200, 3400]
    assert _numbers("16,none,0", float, "--budgets-mb", budgets=True) == [16.0, None, 0.0]
    for text, kind, budgets in (("0", int, False), ("1.5", int, False), ("nan", float, True), ("-1", float, True),
                                ("none", int, False), ("", int, False)):
        with pytest.raises(click.BadParameter):
            _numbers(text, kind, "--x", budgets=budgets)
    assert math.isinf(_numbers("inf", float, "--x", budgets=True)[0])
