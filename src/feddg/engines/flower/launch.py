"""``feddg flower run``: submit an experiment to a SuperLink with ``flwr run --stream`` and report how it ended.

``flwr run --stream`` exits 0 whatever became of the run (Flower 1.41 streams the logs and returns), so
the outcome is read from the run directory's ``status.json``, written by the ServerApp
(:func:`feddg.engines.flower.app.mark`): only ``completed`` with a results.json is a success.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from flwr.supercore.utils import get_flwr_home

from feddg.config import ExperimentConfig
from feddg.engines.flower.app import STATUS, read_mark, run_config_toml
from feddg.federation.server import used_run_dir

#: how long to wait, after ``flwr run`` returned, for a ServerApp still marked ``running`` to write its end: on
#: ``flwr stop`` the stream ends before the ServerApp has handled its SIGINT (measured on a loaded 2-core machine)
MARK_WAIT_S = 30.0


def outcome(run_dir: Path) -> str | None:
    """``None`` if the run in ``run_dir`` completed; otherwise one line saying how it ended."""
    if (status := read_mark(run_dir)) is None:
        if (run_dir / STATUS).exists():
            return f"{run_dir}: {STATUS} is not a status mark (unreadable, or not a JSON object): see `flwr log`"
        return f"{run_dir}: no {STATUS}: the ServerApp did not start (see `flwr log`), or the run directory is elsewhere"
    state = status.get("status")
    if state == "completed" and (run_dir / "results.json").is_file():
        return None
    if state == "running":
        return f"{run_dir}: the ServerApp ended without a mark (killed?); rounds in metrics.jsonl are incomplete"
    return f"{run_dir}: run {state}: {status.get('error', '')}".rstrip(": ")


def superlink_connections() -> tuple[Path, dict[str, dict[str, object]]] | None:
    """``$FLWR_HOME/config.toml`` and its SuperLink connections by name; ``None`` when it is absent or does not
    parse (``flwr`` makes or reports it)."""
    path = get_flwr_home() / "config.toml"
    try:
        table = tomllib.loads(path.read_text()).get("superlink", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if not isinstance(table, dict):  # `superlink = 1`: no connections (flwr says what is wrong)
        table = {}
    return path, {name: value for name, value in table.items() if isinstance(value, dict)}  # not `default = NAME`


def unknown_connection(connection: str, app_dir: Path) -> str | None:
    """Why ``connection`` is not one of ``$FLWR_HOME/config.toml``'s, in one line naming those it has; ``None``
    when it is, or there is no readable file to ask, or the app's pyproject.toml has legacy
    ``[tool.flwr.federations]`` (``flwr run`` first moves those into config.toml)."""
    try:
        legacy = "federations" in tomllib.loads((app_dir / "pyproject.toml").read_text()).get("tool", {}).get("flwr", {})
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        legacy = False
    if legacy or (found := superlink_connections()) is None or connection in found[1]:
        return None
    path, connections = found
    return (f"--connection {connection}: {path} has no SuperLink connection of that name (it has: "
            f"{', '.join(connections) or 'none'}); nothing was submitted")


def insecure_warning(connection: str) -> str | None:
    """A warning when ``connection`` in ``$FLWR_HOME/config.toml`` says ``insecure = true`` (no TLS to the
    SuperLink, so no node authentication either), else ``None``."""
    if (found := superlink_connections()) is None:
        return None
    if found[1].get(connection, {}).get("insecure") is True:
        return (f"feddg: warning: connection {connection!r} is insecure (no TLS): any process that reaches the "
                "SuperLink may join as a client; use it on one trusted machine only (docs/flower.md, "
                "\"Insecure trial\")")
    return None


def flwr_command() -> str | None:
    """The ``flwr`` command of this Python's environment (beside ``sys.executable``: a virtual environment's own,
    activated or not), else the first on PATH."""
    return shutil.which("flwr", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def submit(cfg: ExperimentConfig, run_dir: Path, connection: str, app_dir: Path, resume: bool = False) -> str | None:
    """``flwr run app_dir connection --run-config <cfg> --stream`` (its output goes to this terminal); returns
    :func:`outcome` of ``run_dir``, or why ``flwr run`` itself failed. What is refused before submitting (no
    ``flwr``, no app, a used run directory unless ``resume``: a user's mistake) raises ValueError. ``resume``: the
    ServerApp continues ``run_dir`` from its checkpoint (``experiment.prepare_resume`` checked it)."""
    flwr = flwr_command()
    if flwr is None:
        raise ValueError(f"no `flwr` command beside {sys.executable} or on PATH: reinstall feddg with the [flower] extra")
    if not (app_dir / "pyproject.toml").is_file():
        raise ValueError(f"--app-dir {app_dir}: no Flower App there (no pyproject.toml); feddg's is the checkout's "
                         "flower/ (docs/flower.md)")
    if not resume and used_run_dir(run_dir):  # where the run directory is readable here (else the ServerApp refuses it)
        raise ValueError(f"--run-dir {run_dir} is not empty: a new run needs a new or empty directory (nothing was "
                         "submitted)")
    if (why := unknown_connection(connection, app_dir)) is not None:
        raise ValueError(why)
    if (warning := insecure_warning(connection)) is not None:
        print(warning, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        toml = Path(tmp) / "run.toml"
        toml.write_text(run_config_toml(cfg, run_dir, resume))
        code = subprocess.run([flwr, "run", str(app_dir), connection, "--run-config", str(toml), "--stream"]).returncode
    if code != 0:
        return f"`flwr run` exited with {code}"
    return settled_outcome(run_dir.resolve())


def settled_outcome(run_dir: Path, wait_s: float = MARK_WAIT_S) -> str | None:
    """:func:`outcome` once the run directory's mark has left ``running`` (or after ``wait_s`` seconds)."""
    deadline = time.monotonic() + wait_s
    while (why := outcome(run_dir)) is not None and "without a mark" in why and time.monotonic() < deadline:
        time.sleep(0.5)
    return why
