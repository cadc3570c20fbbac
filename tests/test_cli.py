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
from typer.testing import CliRunner

from feddg.cli import app

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
                          timeout=300)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
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
    out = runner.invoke(app, ["datasets"])
    assert out.exit_code == 0 and "digits-dg" in out.output and "pacs" in out.output


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
