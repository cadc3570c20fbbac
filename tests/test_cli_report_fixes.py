"""Commands and the run report on input an audit found mishandled: one line naming the file or the option, and report
figures that mean what their labels say for runs that hold no domain out or have not finished."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from feddg.cli import app
from feddg.config import build_config, dump_config
from feddg.evaluation.communication import bytes_per_round
from feddg.reports.run import run_report


def _feddg(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


@pytest.mark.parametrize(("args", "said"), [
    (["datasets", "digitz", "--check", "--root", "."], "unknown dataset 'digitz'"),  # was a KeyError traceback
    (["datasets", "digitz", "--check"], "unknown dataset 'digitz'"),  # was "needs --root"
    (["export", "synthetic-mri", "{tmp}/out", "--max-per-domain", "1"], "takes no --max-per-domain or --cache-dir"),
])
def test_bad_dataset_commands_end_in_one_line(tmp_path, args, said):
    code, text = _feddg(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2 and said in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    (tmp_path / "f.txt").write_text("x")
    code, text = _feddg("datasets", "digits-dg", "--cache-dir", str(tmp_path / "f.txt"))
    assert code == 2 and "File exists" in text and "Traceback" not in text


def _run_dir(tmp_path: Path, rows: list[dict], **split: object) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    cfg = build_config({"data": {"dataset": "digits-dg"}, "split": split, "partition": {"num_clients": 4}})
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_damaged_record_is_named_with_its_line(tmp_path):
    run = _run_dir(tmp_path, [{"round": 1, "id_acc": 50.0, "bytes_up": 1, "bytes_down": 1}])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "lr": 0.0')  # a crash mid-write
    code, text = _feddg("report", str(run))
    assert code == 2 and re.search(r"metrics\.jsonl:2: not JSON", text.replace("\n", ""))
    (run / "metrics.jsonl").write_text('{"round": 1, "id_acc": 50.0, "bytes_up": 1, "bytes_down": 1}\n')
    (run / "config.yaml").write_text("data: [\n")  # hand-edited, no results.json yet: was a YAML traceback
    code, text = _feddg("report", str(run))
    assert code == 2 and "config.yaml: not YAML" in text.replace("\n", "") and "Traceback" not in text


def test_a_folder_of_no_run_is_refused_without_suggesting_resume_or_overwrite(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    code, text = _feddg("run", "configs/demo.yaml", "--run-dir", str(tmp_path / "notes"))
    assert code == 2 and "holds files of no feddg run" in text and "--resume" not in text
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"


def test_an_unfinished_federated_run_reports_its_last_evaluation_and_what_it_knows(tmp_path):
    rows = [{"round": 1, "clients": 2, "train_loss": 1.0, "bytes_up": 10, "bytes_down": 10},
            {"round": 2, "clients": 2, "train_loss": 1.0, "bytes_up": 10, "bytes_down": 10, "id_acc": 61.5, "id_acc/mnist": 61.5},
            {"round": 3, "clients": 2, "train_loss": 1.0, "bytes_up": 10, "bytes_down": 10}]  # killed before round 4's evaluation
    run = _run_dir(tmp_path, rows, protocol="federated", target=None)
    page = run_report(run)[0].read_text()
    text = re.sub(r"<[^>]+>", " ", page)
    assert "last evaluation, round 2" in text  # it read round 3, which has no figure
    assert re.search(r"61\.50\s+id_acc \(%\)", text)  # no headline figure before
    assert "clients sampled (last round)" in text and "none (every domain trains)" in text


def test_bytes_per_round_count_a_round_without_a_key_as_zero():
    rows = [{"round": 1, "bytes_down": 10}, {"round": 2, "bytes_down": 10, "hfl/bytes_station_down": 8}]
    assert bytes_per_round(rows) == {"bytes_down": 10.0, "hfl/bytes_station_down": 4.0}  # was 8: per server round
    assert bytes_per_round([]) == {}
