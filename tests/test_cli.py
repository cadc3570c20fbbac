"""End-to-end through the `feddg` command: determinism, kill-and-resume, report, datasets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from feddg.cli import app
from feddg.models import MODELS

TINY = [
    "-o", "data.max_per_domain=150",
    "-o", "partition.num_clients=3",
    "-o", "federation.rounds=3",
    "-o", "model.name=lenet",
    "-o", "split.target=uci",
    "-o", "eval.every=1",
]


@pytest.fixture
def env(tmp_path, cache_dir):
    return {**os.environ, "FEDDG_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}


def _feddg(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feddg", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def test_same_seed_twice_gives_identical_metrics(tmp_path, env):
    for name in ("a", "b"):
        res = _feddg(["run", "configs/demo.yaml", *TINY, "--run-dir", str(tmp_path / name), "--quiet"], env)
        assert res.returncode == 0, res.stderr[-2000:]
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    assert len(_metrics(tmp_path / "a")) == 3
    assert "ood" in res.stdout and "uci" in res.stdout  # the per-domain table is printed


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, env):
    args = ["run", "configs/demo.yaml", *TINY, "-o", "federation.rounds=4", "--quiet"]
    full = _feddg([*args, "--run-dir", str(tmp_path / "full")], env)
    assert full.returncode == 0, full.stderr[-2000:]

    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "feddg", *args, "--run-dir", str(killed_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = killed_dir / "metrics.jsonl"
    deadline = time.time() + 240
    workers: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            workers = _children(proc.pid)
            proc.send_signal(signal.SIGKILL)  # no chance to clean up
            break
        time.sleep(0.05)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    deadline = time.time() + 15
    while time.time() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)], "client workers outlived the killed run"
    done = len(_metrics(killed_dir))
    assert 2 <= done < 4

    resumed = _feddg(["run", "--resume", str(killed_dir), "--quiet"], env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _metrics(killed_dir) == _metrics(tmp_path / "full")
    assert (killed_dir / "curves.png").is_file() and (killed_dir / "domains.png").is_file()


def _children(pid: int) -> list[int]:
    """Child pids of ``pid`` (from /proc; empty where there is none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_report_and_datasets_commands(tmp_path, env, monkeypatch):
    res = _feddg(["run", "configs/demo.yaml", *TINY, "-o", "federation.rounds=1", "--run-dir", str(tmp_path / "r"),
                  "--quiet"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    (tmp_path / "r" / "curves.png").unlink()
    monkeypatch.setenv("FEDDG_CACHE", env["FEDDG_CACHE"])
    runner = CliRunner()
    out = runner.invoke(app, ["report", str(tmp_path / "r")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "r" / "curves.png").stat().st_size > 5000
    out = runner.invoke(app, ["datasets"], env={"COLUMNS": "250"})
    assert out.exit_code == 0 and "digits-dg" in out.output and "pacs" in out.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.output.splitlines() if line.count("│") == 7}
    assert rows["synthetic-sentiment"][:2] == ["classification", "tokens"]  # what feddg models' "takes" must match
    assert rows["amazon-bow"][1] == "features" and rows["synthetic-mri"][:2] == ["segmentation", "images"]


def test_config_errors_are_one_line_with_the_key(tmp_path, env):
    res = _feddg(["run", "configs/demo.yaml", "-o", "federation.rounds=zero"], env)
    assert res.returncode == 2
    assert "federation.rounds" in res.stdout
    assert "Traceback" not in res.stdout + res.stderr
    res = _feddg(["run", "configs/demo.yaml", "--weights", str(tmp_path / "missing.pth")], env)
    assert res.returncode == 2 and "missing.pth" in res.stdout and "Traceback" not in res.stdout + res.stderr


def test_weights_option_starts_from_a_local_state_dict(tmp_path, env):
    import torch
    import yaml

    from feddg.models import create_model

    path = tmp_path / "lenet.pth"
    torch.save(create_model("lenet", num_classes=10, in_channels=3, image_size=28).state_dict(), path)
    res = _feddg(["run", "configs/demo.yaml", *TINY, "-o", "federation.rounds=1", "-o", "federation.workers=1",
                  "--weights", str(path), "--run-dir", str(tmp_path / "r"), "--quiet"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["model"]["weights"] == str(path)
    bad = tmp_path / "bad.pth"
    torch.save(create_model("lenet", num_classes=4, in_channels=1, image_size=28).state_dict(), bad)
    res = _feddg(["run", "configs/demo.yaml", *TINY, "--weights", str(bad), "--run-dir", str(tmp_path / "b")], env)
    assert res.returncode == 2 and "bad.pth" in res.stdout and "Traceback" not in res.stdout + res.stderr


def _invoke(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res


def _one_line_error(res, *words: str) -> str:
    lines = res.stdout.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_a_finished_run_is_never_overwritten_and_resumes_change_only_safe_keys(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    run_dir = tmp_path / "r"
    args = ["run", "configs/demo.yaml", *TINY, "-o", "data.max_per_domain=60", "-o", "federation.rounds=1",
            "-o", "optim.schedule=constant", "-o", "federation.workers=1", "--run-dir", str(run_dir), "--quiet"]
    assert _invoke(*args).exit_code == 0
    _one_line_error(_invoke(*args), "not empty", "--overwrite", "--resume")
    (run_dir / "notes.txt").write_text("a user's notes")
    (run_dir / "round_0001.stale").write_text("")  # not feddg's: kept too
    res = _invoke(*args, "--overwrite")
    assert res.exit_code == 0 and (run_dir / "notes.txt").exists() and "notes.txt" in res.output, res.output
    assert (run_dir / "results.json").exists() and (run_dir / "round_0001.stale").exists()
    foreign = tmp_path / "mine"
    (foreign / "notes.txt").parent.mkdir()
    (foreign / "notes.txt").write_text("not a run")
    _one_line_error(_invoke(*args[:-3], "--run-dir", str(foreign), "--overwrite"), "holds files of no feddg run")
    assert (foreign / "notes.txt").exists()

    _one_line_error(_invoke("run", "--resume", str(run_dir), "-o", "seed=1"), "seed: cannot change on resume")
    _one_line_error(_invoke("run", "--resume", str(run_dir), "-o", "federation.rounds=0"), "federation.rounds")
    _one_line_error(_invoke("run", "--resume", str(run_dir), "configs/demo.yaml"), "drop CONFIG")
    res = _invoke("run", "--resume", str(run_dir), "-o", "federation.rounds=3", "-o", "eval.every=3", "--quiet")
    assert res.exit_code == 0, res.output
    rows = _metrics(run_dir)
    assert len(rows) == 3 and "ood_acc" not in rows[1] and "ood_acc" in rows[2]  # eval.every=3 applied
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["federation"]["rounds"] == 3 and saved["eval"]["every"] == 3


def test_a_resume_cannot_stretch_a_cosine_schedule(tmp_path):
    from feddg.config import ConfigError, build_config, dump_config
    from feddg.experiment import resume_experiment

    (tmp_path / "config.yaml").write_text(dump_config(build_config({}, ["optim.schedule=cosine"])))
    with pytest.raises(ConfigError, match="federation.rounds: cannot change on resume with optim.schedule=cosine"):
        resume_experiment(tmp_path, ["federation.rounds=20"])


def test_a_resume_cannot_shrink_a_run(tmp_path):
    from feddg.config import ConfigError, build_config, dump_config
    from feddg.experiment import resume_experiment

    (tmp_path / "config.yaml").write_text(dump_config(build_config({}, ["federation.rounds=5"])))
    with pytest.raises(ConfigError, match=r"^federation.rounds: a resumed run can only grow \(5 -> 3\)$"):
        resume_experiment(tmp_path, ["federation.rounds=3"])


def test_user_errors_are_one_line_without_a_traceback(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nfederation: {rounds: 2\n")
    _one_line_error(_invoke("run", str(bad)), f"{bad}:3:1:")
    _one_line_error(_invoke("run", "configs/demo.yaml", "-o", "device=gpu"), "device: 'gpu' is not a device")
    _one_line_error(_invoke("run", "configs/demo.yaml", "-o", "rounds"), "key.sub=value")
    _one_line_error(_invoke("run", str(tmp_path / "missing.yaml")), "not found", "missing.yaml")
    _one_line_error(_invoke("sweep", str(bad)), f"{bad}:3:1:")
    _one_line_error(_invoke("report", str(tmp_path / "nowhere")), "nowhere")

    from feddg.config import build_config, dump_config

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(build_config({}, [t for t in TINY if t != "-o"])))
    (run_dir / "checkpoint.pt").write_bytes(b"PK\x03\x04 cut short")
    (run_dir / "checkpoint.prev.pt").write_bytes(b"")
    _one_line_error(_invoke("run", "--resume", str(run_dir), "--quiet"), "no readable checkpoint",
                    str(run_dir / "checkpoint.pt"), str(run_dir / "checkpoint.prev.pt"))


def test_debug_shows_the_traceback(tmp_path, env):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    res = _feddg(["--debug", "run", str(bad)], env)
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr


def test_a_table_written_to_a_pipe_keeps_its_rows_whole_unless_columns_is_set(env):
    """rich wraps at 80 columns off a terminal; feddg's tables use 160 there, and COLUMNS still decides."""
    env = {k: v for k, v in env.items() if k != "COLUMNS"}
    piped = _feddg(["methods"], env)
    narrow = _feddg(["methods"], {**env, "COLUMNS": "80"})
    assert piped.returncode == narrow.returncode == 0, piped.stderr + narrow.stderr
    assert max(map(len, piped.stdout.splitlines())) == 160
    assert max(map(len, narrow.stdout.splitlines())) == 80
    # CCST's first line of parameters reaches decoder_weights at 160 columns, not at 80
    assert any("ccst" in line and "decoder_weights=" in line for line in piped.stdout.splitlines())
    assert not any("ccst" in line and "decoder_weights=" in line for line in narrow.stdout.splitlines())


def test_models_lists_what_each_model_takes_predicts_and_its_options():
    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in result.output.splitlines() if line.count("│") == 6 and line.split("│")[1].strip()}
    assert rows["unet"] == ["images", "dense_masks", "batchnorm, conv_stages", "depth, width"]
    assert rows["resnet18"] == ["images", "class_labels", "batchnorm, conv_stages", "normalization, small_input"]
    assert rows["tiny-roberta"] == ["tokens", "class_labels", "—", "RobertaConfig's fields"]
    assert rows["mlp"] == ["features", "class_labels", "—", "hidden"]
    assert rows["cnn4"][-1] == "none" and set(rows) == set(MODELS)
