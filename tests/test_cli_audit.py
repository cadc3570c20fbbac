"""What the commands promise beyond tests/test_cli_commands.py (found by mutating src/feddg/cli.py): the median of
many domains' counts, each list option's own usage line, the text datasets' transform line, and a resume's or a
bare run's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from support.tables import rendered, text_rows
from typer.testing import CliRunner

from feddg.cli import _counts_table, _numbers, app
from feddg.data.inspect import Summary


def test_many_domains_show_the_median_of_their_counts_not_the_mean() -> None:
    domains = [f"d{k}" for k in range(13)]  # one past MAX_DOMAIN_COLUMNS: a summary column replaces the domains
    counts = {d: {"x": 1} for d in domains[:12]} | {"d12": {"x": 40}}  # twelve 1s and a 40: median 1, mean 4
    assert text_rows(rendered(_counts_table(counts, domains, "images")))[1] == ["x", "52", "1", "1", "40"]


@pytest.mark.parametrize(("kind", "budgets", "what"), [
    (int, False, "whole numbers > 0"), (float, False, "numbers > 0"), (float, True, "sizes >= 0 or none")])
def test_a_bad_list_names_what_that_option_takes(kind: type, budgets: bool, what: str) -> None:
    with pytest.raises(typer.BadParameter, match=f"^expected comma-separated {what}, got '1,-2'$"):
        _numbers("1,-2", kind, "--x", budgets=budgets)


def test_a_text_dataset_says_it_has_no_training_augmentation(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = Summary("s", ["a"], ["neg", "pos"], {"a": {"neg": 2, "pos": 3}}, (1, 1, 8), None, 5, "texts")
    monkeypatch.setattr("feddg.data.inspect.describe_dataset", lambda *args, **kwargs: texts)
    res = CliRunner().invoke(app, ["datasets", "synthetic-sentiment"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert res.output.splitlines()[-1] == "no training augmentation (texts are tokenised once into the cache)"


def test_a_run_needs_a_config_or_a_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    res = CliRunner().invoke(app, ["run"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and res.output.strip() == "error: give a config file, or --resume RUN_DIR"


def test_a_resume_refuses_overwrite_before_touching_the_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    res = CliRunner().invoke(app, ["run", "--resume", str(tmp_path), "--overwrite"], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert res.output.strip() == ("error: --resume continues a run with its own config.yaml: drop --overwrite (-o "
                                  "changes the keys a resume may change)")
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
