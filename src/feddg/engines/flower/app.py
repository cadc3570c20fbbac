"""Flower App components for a deployment: ``flwr run flower/ <superlink>`` (see docs/flower.md).

The app directory ``flower/pyproject.toml`` points its components here. Everything the apps
need travels in the run config (``flwr run --run-config run.toml``):

``config``   the experiment YAML text (``feddg.engines.flower.app.run_config_toml`` writes it)
``run-dir``  where the ServerApp writes the run directory ("" = output_dir/name-method-...)
``resume``   continue ``run-dir`` from its checkpoint

The ServerApp builds the Federation (for evaluation and the run directory) and drives it with
``run_on_grid``; each SuperNode's ClientApp rebuilds the same Federation and serves the clients
of its ``partition-id`` (or, with ``flower.roster``, of its key). The run directory's ``status.json``
says how the ServerApp ended (:func:`mark`): ``running`` (still, or killed), ``completed`` (with
results.json), ``failed`` (with the error) or ``stopped`` (``flwr stop``, a signal).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler

from feddg.config import ExperimentConfig, dump_config, load_config, one_line
from feddg.engines.flower.client import config_from_text, make_client_app, required_config
from feddg.tasks import metric_key

server_app = ServerApp()
client_app = make_client_app()


def _round_logger(metric: str) -> Callable[[dict[str, Any]], None]:
    """A log line per round: the training loss and the means of the task's ``metric`` (id / val / ood)."""
    keys = [metric_key(role, metric) for role in ("id", "val", "ood")]

    def log_round(row: dict[str, Any]) -> None:
        means = {k: round(row[k], 2) for k in keys if k in row}
        log(INFO, "feddg round %d: train_loss %.4f %s", row["round"], row["train_loss"], means)

    return log_round


#: the run directory's mark of how the ServerApp ended (``feddg flower run`` reads it)
STATUS = "status.json"


def mark(run_dir: Path, status: str, error: str = "") -> None:
    """Write ``run_dir/status.json``: ``status`` (running, completed, failed, stopped) and the error's one line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
              **({"error": " ".join(error.split())[:500]} if error else {})}
    tmp = run_dir / f".{STATUS}.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(run_dir / STATUS)


def read_mark(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir``'s mark as :func:`mark` wrote it; ``None`` where there is none or it cannot be read."""
    try:
        record = json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def mark_stopped_if_running(run_dir: Path) -> None:
    """Flower's exit handler for ``flwr stop`` (registered to run before its force-exit timer): mark a run that is
    still ``running`` as ``stopped``. Flower's own exit work (pushing logs and the task output) may outlast the 5 s
    after which it ``os._exit``s the process, before the ``SystemExit`` reaches :func:`main`'s handler: on a loaded
    2-core machine the run was then left marked ``running``. A run that ended otherwise keeps its mark."""
    if (record := read_mark(run_dir)) is not None and record.get("status") == "running":
        mark(run_dir, "stopped", "stopped from outside (Flower's exit on a signal) before the last round")


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the experiment of the run config on the SuperNodes connected to this SuperLink; mark the run directory
    with how it ended (``status.json``), so a stopped or failed run is not mistaken for a result."""
    # the server half, imported here: a ClientApp process imports this module too
    from feddg.engines.flower.server import PollingGrid, run_on_grid
    from feddg.evaluation.plots import plot_run  # matplotlib: only where the run directory is written
    from feddg.federation.examples import write_examples
    from feddg.federation.server import Server, default_run_dir, used_run_dir
    from feddg.federation.setup import build_federation

    rc = context.run_config
    cfg = config_from_text(required_config(str(rc.get("config", ""))))
    run_dir = Path(str(rc.get("run-dir", "")) or default_run_dir(cfg))
    resume = bool(rc.get("resume", False))
    if not resume and used_run_dir(run_dir):  # Server would start the run over the files (and mark) of another
        raise ValueError(f"run directory {run_dir} is not empty: a new run needs a new or empty one (resume = true "
                         "in the run config, or feddg flower run --resume, continues the run there)")
    if not cfg.flower.roster:
        log(WARNING, "feddg: no flower.roster: each SuperNode is the client of the partition it declares, unproven "
            "(docs/flower.md, 'Insecure trial'); a deployment's nodes prove their keys with a roster")
    mark(run_dir, "running")
    add_exit_handler(lambda: mark_stopped_if_running(run_dir), run_before_force_exit=True)
    try:
        server = Server(build_federation(cfg), run_dir, resume=resume)
        results = run_on_grid(server, PollingGrid(grid), on_round=_round_logger(server.fed.task.metric))
    except (KeyboardInterrupt, SystemExit) as err:  # flwr stop: the task heartbeat raises SIGINT here
        mark(run_dir, "stopped", f"stopped from outside ({type(err).__name__}) before the last round")
        raise
    except BaseException as err:
        mark(run_dir, "failed", f"{type(err).__name__}: {err}")
        raise
    mark(run_dir, "completed")
    plot_run(run_dir)
    write_examples(server)
    log(INFO, "feddg results (%s): %s", run_dir, json.dumps(results["final"]))


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON escapes are valid TOML escapes)."""
    return json.dumps(text, ensure_ascii=False)


def run_config_toml(cfg: ExperimentConfig, run_dir: str | Path = "", resume: bool = False) -> str:
    """The ``--run-config`` TOML file of an experiment."""
    return (
        f"config = {toml_string(dump_config(cfg))}\n"
        f"run-dir = {toml_string(str(Path(run_dir).resolve()) if run_dir else '')}\n"
        f"resume = {'true' if resume else 'false'}\n"
    )


def cli() -> None:
    """``python -m feddg.engines.flower.app CONFIG [-o key=value ...] [--run-dir DIR] > run.toml``."""
    ap = argparse.ArgumentParser(description="write the Flower run config (TOML) of a feddg experiment")
    ap.add_argument("config", help="experiment YAML")
    ap.add_argument("-o", "--set", dest="overrides", action="append", default=[], help="override: key.sub=value")
    ap.add_argument("--run-dir", default="", help="run directory on the SuperLink machine")
    ap.add_argument("--resume", action="store_true", help="continue --run-dir from its checkpoint")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except (OSError, ValueError) as err:  # ConfigError is a ValueError: a missing file, an unknown key, a bad value
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        raise SystemExit(2) from None
    print(run_config_toml(cfg, args.run_dir, args.resume), end="")


if __name__ == "__main__":
    cli()
