"""Issue 27: a deployed run stopped from outside (`flwr stop`, through the Control API) is marked ``stopped`` in its
run directory, holds no results.json, and ``feddg flower run`` exits 1 with one line (docs/flower.md, "Failures are
reported as failures"). One loopback deployment (tests/support/flower_local.py), two SuperNodes, bounded in time."""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from support.flower_local import APP_DIR, CONNECTION, LocalDeployment

from feddg.config import build_config, dump_config
from feddg.engines.flower.app import main as server_main
from feddg.engines.flower.app import mark, mark_stopped_if_running
from feddg.engines.flower.launch import flwr_command, insecure_warning, settled_outcome, submit
from feddg.federation.server import used_run_dir

BIN = Path(sys.executable).parent


def wait_until(what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:g} s")
        time.sleep(0.5)


def test_the_launcher_waits_for_a_running_mark_to_settle(tmp_path):
    """`flwr run --stream` returns on `flwr stop` before the ServerApp has marked its run directory."""
    mark(tmp_path, "running")
    threading.Timer(0.3, mark, (tmp_path, "stopped", "stopped from outside (KeyboardInterrupt)")).start()
    assert settled_outcome(tmp_path, wait_s=20).endswith("run stopped: stopped from outside (KeyboardInterrupt)")
    mark(tmp_path, "running")  # a ServerApp killed without a word: reported once the wait is over
    t0 = time.monotonic()
    assert "without a mark" in settled_outcome(tmp_path, wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5


def test_flower_s_exit_marks_a_running_run_stopped_and_leaves_any_other_mark(tmp_path):
    """The handler the ServerApp gives Flower's exit (before its force-exit timer, which may end the process before
    the SystemExit reaches main): only a run still marked running becomes stopped."""
    mark_stopped_if_running(tmp_path / "none")  # no mark: nothing written
    assert not (tmp_path / "none").exists()
    for status, after in [("running", "stopped"), ("completed", "completed"), ("failed", "failed")]:
        mark(tmp_path / status, status)
        mark_stopped_if_running(tmp_path / status)
        assert json.loads((tmp_path / status / "status.json").read_text())["status"] == after
    assert settled_outcome(tmp_path / "running", wait_s=0) == (
        f"{tmp_path / 'running'}: run stopped: stopped from outside (Flower's exit on a signal) before the last round")


@pytest.mark.skipif(not (BIN / "flwr").is_file(), reason="no flwr beside this python (not a virtual environment)")
def test_the_launcher_finds_its_environments_flwr_without_it_on_path(tmp_path, monkeypatch):
    """`.venv/bin/feddg flower run` with the environment not activated: its own flwr, not "no flwr on PATH"."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert flwr_command() == str(BIN / "flwr")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert flwr_command() is None  # neither beside the interpreter nor on PATH


@pytest.mark.skipif(flwr_command() is None, reason="no flwr command here")
def test_a_missing_flower_app_is_refused_before_flwr_runs(tmp_path):
    cfg = build_config({})
    with pytest.raises(ValueError) as err:  # a user's mistake: the CLI exits 2 (a run that fails: 1)
        submit(cfg, tmp_path / "run", "local", tmp_path / "nowhere")
    assert str(err.value) == f"--app-dir {tmp_path / 'nowhere'}: no Flower App there (no pyproject.toml); feddg's " \
                             "is the checkout's flower/ (docs/flower.md)"


@pytest.mark.skipif(flwr_command() is None, reason="no flwr command here")
def test_a_used_run_directory_is_refused_by_the_launcher_and_the_server_app_before_either_touches_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    earlier = {"status.json": '{"status": "completed"}\n', "metrics.jsonl": '{"round": 1}\n'}
    for name, text in earlier.items():
        (run / name).write_text(text)
    cfg = build_config({})
    with pytest.raises(ValueError) as err:
        submit(cfg, run, "local", APP_DIR)
    assert str(err.value) == f"--run-dir {run} is not empty: a new run needs a new or empty directory (nothing was submitted)"
    context = SimpleNamespace(run_config={"config": dump_config(cfg), "run-dir": str(run), "resume": False})
    with pytest.raises(ValueError, match=r"is not empty: a new run needs a new or empty one \(resume = true"):
        server_main(None, context)  # as `flwr run` with a hand-written run config would start it
    assert {p.name: p.read_text() for p in run.iterdir()} == earlier  # the earlier run and its mark, untouched
    assert not used_run_dir(tmp_path / "absent") and not used_run_dir(tmp_path / "absent2" / "x")
    (tmp_path / "empty").mkdir()
    assert not used_run_dir(tmp_path / "empty")


def test_an_insecure_connection_is_warned_about(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    assert insecure_warning("local") is None  # no config.toml
    (tmp_path / "config.toml").write_text('[superlink.local]\naddress = "127.0.0.1:9093"\ninsecure = true\n'
                                          '[superlink.tls]\naddress = "h:9093"\nroot-certificates = "ca.pem"\n')
    assert insecure_warning("local").startswith("feddg: warning: connection 'local' is insecure (no TLS)")
    assert insecure_warning("tls") is None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalDeployment reads /proc")
def test_a_run_stopped_with_flwr_stop_is_marked_stopped_and_the_launcher_fails(tmp_path, cache_dir):
    if not all((BIN / b).exists() for b in ("flower-superlink", "flower-supernode", "flwr", "feddg")):
        pytest.skip("Flower's binaries (or feddg's) are not installed beside this Python")
    cfg = build_config(
        {"name": "stopped", "seed": 1, "device": "cpu",
         "data": {"dataset": "digits-dg", "max_per_domain": 20, "cache_dir": str(cache_dir)},
         "split": {"target": "synth"}, "partition": {"kind": "iid", "num_clients": 2},
         "model": {"name": "cnn"}, "federation": {"rounds": 500, "batch_size": 32}})  # far more than it will run
    config = tmp_path / "stopped.yaml"
    config.write_text(dump_config(cfg))
    dep = LocalDeployment(tmp_path / "deployment", 2, env={"OMP_NUM_THREADS": "1"})
    dep.start(timeout=60)  # a deployment that does not start fails the test (after stopping what started)
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [str(BIN / "feddg"), "flower", "run", str(config), "--run-dir", str(run_dir), "--connection", CONNECTION,
         "--app-dir", str(APP_DIR)], cwd=dep.workdir, env=dep.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout or []), daemon=True)
    reader.start()
    try:
        status = run_dir / "status.json"
        wait_until("the ServerApp did not start", lambda: status.is_file(), 120)
        run_id = next(m[1] for line in lines if (m := re.search(r"Successfully started run (\d+)", line)))
        subprocess.run([str(BIN / "flwr"), "stop", run_id, CONNECTION], cwd=dep.workdir, env=dep.env,
                       capture_output=True, text=True, timeout=60, check=True)
        launcher.wait(timeout=90)
        reader.join(10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        left = dep.stop()
    output = "".join(lines)
    assert launcher.returncode == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: {run_dir}: run stopped: stopped from outside"), output[-3000:]
    assert yaml.safe_load((run_dir / "status.json").read_text())["status"] == "stopped"
    assert not (run_dir / "results.json").exists()
    metrics = run_dir / "metrics.jsonl"  # none where the stop came before the first round ended (a loaded machine)
    assert not metrics.exists() or len(metrics.read_text().splitlines()) < cfg.federation.rounds
    assert left == set(), f"processes outlived the deployment: {left}"
