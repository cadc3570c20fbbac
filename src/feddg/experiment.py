"""Run one experiment from a config: build, train on an engine, write the run directory."""

from __future__ import annotations

import fnmatch
import json
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from feddg.algorithms.registry import method_class
from feddg.config import (
    ROSTER_NEEDS_DEPLOYMENT,
    SECAGG_NEEDS_FLOWER,
    ConfigError,
    ExperimentConfig,
    build_config,
    dump_config,
    parse_overrides,
    read_yaml,
)
from feddg.engines.inprocess import run_inprocess
from feddg.evaluation.plots import method_name, plot_run
from feddg.federation.checkpoint import has_checkpoint
from feddg.federation.examples import write_examples
from feddg.federation.provenance import config_hash, record_resume
from feddg.federation.server import CONFIG, NODE_STATE, RESULTS, Server, default_run_dir, used_run_dir
from feddg.federation.setup import build_federation
from feddg.tasks import Task, metric_key
from feddg.tracking import Tracking

console = Console(stderr=True)

#: console columns below which a run's line has no bar (the count says as much): at 80 columns rich squeezed the
#: bar and cut both times to ``0:…``
BAR_FROM_WIDTH = 100


def progress_bar(enabled: bool) -> Progress:
    """A run's (or a sweep's) line: description, bar, rounds done, the status fields, elapsed and remaining time."""
    bar = [BarColumn()] if console.width >= BAR_FROM_WIDTH else []
    return Progress(
        TextColumn("[bold]{task.description}"),
        *bar,
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


def _status(row: dict[str, Any], task: Task) -> str:
    parts = [f"loss {row['train_loss']:.3f}"]
    for role in ("id", "val", "ood"):
        if (key := metric_key(role, task.metric)) in row:
            parts.append(f"{role} {task.metric} {row[key]:.1f}{task.unit}")
    return " · ".join(parts)


def run_experiment(
    cfg: ExperimentConfig,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``cfg`` and return results.json's content; ``resume`` continues ``run_dir``'s checkpoint.

    A fresh run refuses a non-empty ``run_dir`` unless ``overwrite`` (which clears it first).
    """
    if cfg.flower.roster:  # before the run directory is made
        raise ValueError(ROSTER_NEEDS_DEPLOYMENT)
    if cfg.flower.secure_aggregation != "none" and cfg.federation.engine != "flower":
        raise ValueError(SECAGG_NEEDS_FLOWER)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    if not resume:
        _fresh_run_dir(run_dir, overwrite)
    tracking = Tracking(cfg, run_dir)  # logging: tensorboard / mlflow; a missing package fails before the run
    fed = build_federation(cfg)
    server = Server(fed, run_dir, resume=resume)
    targets = ", ".join(fed.dataset.domains[d] for d in fed.split.test_domains)
    with progress_bar(progress) as bar, stop_signals() as stopped:
        method = method_name(cfg.method.name, cfg.hierarchy.merge if cfg.hierarchy is not None else None)
        task = bar.add_task(f"{method} → {targets}", total=server.rounds, completed=server.round,
                            status="")

        def on_round(row: dict[str, Any]) -> None:
            bar.update(task, advance=1, status=_status(row, fed.task))
            tracking.log_round(row)

        try:
            if cfg.federation.engine == "flower":
                from feddg.engines.flower.simulation import run_flower  # needs the [flower] extra

                results = run_flower(server, on_round=on_round)
            else:
                results = run_inprocess(server, on_round=on_round)
        except KeyboardInterrupt:
            raise Interrupted(stopped.get("signal", signal.SIGINT), run_dir, server.round, server.saved_round) from None
    results["run_dir"] = str(run_dir)
    plot_run(run_dir)
    write_examples(server)
    tracking.finish(results)
    return results


class Interrupted(RuntimeError):
    """A run stopped by SIGINT or SIGTERM: where it stopped and how it continues; ``code`` is the shell's exit code
    for the signal (128 + its number)."""

    def __init__(self, sig: int, run_dir: Path, round: int, saved: int | None) -> None:
        name = signal.Signals(sig).name
        kept = "nothing was checkpointed yet" if saved is None else f"the last checkpoint is round {saved}"
        super().__init__(f"{name}: the run stopped during round {round + 1} ({kept}); "
                         f"feddg run --resume {run_dir} continues it")
        self.code = 128 + sig


@contextmanager
def stop_signals() -> Iterator[dict[str, int]]:
    """SIGTERM ends the block as SIGINT does (a KeyboardInterrupt in the main thread); the dict says which came.
    Outside the main thread (a library caller's worker thread) signals are left alone."""
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(sig: int, frame: object) -> None:
        received["signal"] = sig
        raise KeyboardInterrupt

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (not empty, not a run directory)."""


def _fresh_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Make sure a fresh run does not mix with files of another run in ``run_dir``."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file")
    if not used_run_dir(run_dir):
        return
    if not (run_dir / "config.yaml").is_file():  # neither --resume nor --overwrite takes a folder of no run
        raise RunDirError(f"run directory {run_dir} holds files of no feddg run (no config.yaml): choose another "
                          "--run-dir")
    if not overwrite:
        raise RunDirError(f"run directory {run_dir} is not empty; --resume {run_dir} continues that run, "
                          "--overwrite replaces it")
    if kept := clear_run_dir(run_dir):
        console.print(f"--overwrite kept what feddg did not write in {run_dir}: {', '.join(kept)}", markup=False,
                      highlight=False)


#: ``feddg audit privacy``'s folder in a run directory (feddg.audit): it describes the model it audited
AUDIT_DIR = "audit"
#: the latest audit, earlier ones (``audit-1``, ...), and one being written
AUDIT_DIRS = (AUDIT_DIR, f"{AUDIT_DIR}-[0-9]*", f"{AUDIT_DIR}.partial")
#: what feddg writes into a run directory: ``--overwrite`` removes these, and only these
RUN_FILES = ("config.yaml", "provenance.json", "provenance.json.tmp", "metrics.jsonl", "results.json",
             "checkpoint.pt", "checkpoint.prev.pt", "checkpoint.pt.tmp", "client_store", "curves.png", "domains.png",
             "styles.png", "report.html", "mlflow_run_id", "events.out.tfevents.*", "examples",
             NODE_STATE, *AUDIT_DIRS)


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete what feddg wrote into a run directory and keep everything else (a user's notes, an analysis
    folder); returns the names kept. Refuses a directory that is not a feddg run (no config.yaml)."""
    if not (run_dir / CONFIG).is_file():
        raise RunDirError(f"{run_dir} is not a feddg run directory (no {CONFIG}); refusing to delete its content")
    kept = []
    for path in sorted(run_dir.iterdir()):
        if not any(fnmatch.fnmatchcase(path.name, pattern) for pattern in RUN_FILES):
            kept.append(path.name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return kept


def _in_schema(dotted: str) -> bool:
    """Whether ``dotted`` names a field of :class:`ExperimentConfig` (``"federation.rounds"``)."""
    model: Any = ExperimentConfig
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


RESUME_SAFE = tuple(key for key in ("federation.rounds", "eval.every", "federation.checkpoint_every",
                                    "federation.workers", "device", "federation.client_timeout_s",
                                    "federation.client_state_budget_mb") if _in_schema(key))
"""Keys a resume may change (those this config schema has): the rounds already trained stay valid."""


def _same_as_fresh(before: ExperimentConfig, after: ExperimentConfig) -> bool:
    """Whether a run of ``before`` resumed as ``after`` gives what a fresh run of ``after`` gives: the same computation,
    or more rounds whose every evaluation a fresh run makes too (the old last round was due under ``eval.every``;
    else it keeps an evaluation a fresh run would skip, and model selection sees one more round)."""
    if config_hash(before) == config_hash(after):
        return True
    same_length = before.model_copy(update={"federation": before.federation.model_copy(
        update={"rounds": after.federation.rounds})})
    return config_hash(same_length) == config_hash(after) and before.federation.rounds % after.eval.every == 0


def resume_experiment(run_dir: str | Path, overrides: list[str] | None = None, *, progress: bool = True
                      ) -> dict[str, Any]:
    """Continue a killed run from its last checkpoint (or extend a finished one), with the config it was started
    with. A finished run without a change of ``federation.rounds`` is left alone: its results come back with
    ``"resumed": False`` and nothing is recorded.

    ``overrides`` may change only :data:`RESUME_SAFE` keys; they are written to config.yaml.
    """
    run_dir = Path(run_dir)
    cfg = prepare_resume(run_dir, overrides)
    if cfg is None:
        return {**json.loads((run_dir / RESULTS).read_text()), "run_dir": str(run_dir), "resumed": False}
    return run_experiment(cfg, run_dir, resume=True, progress=progress)


def prepare_resume(run_dir: Path, overrides: list[str] | None = None, restart: str = "with --overwrite"
                   ) -> ExperimentConfig | None:
    """The config that a resume of ``run_dir`` goes on with (:func:`resume_experiment`: its checks, in one line each),
    with the run directory made ready for it (the results and audits of the shorter run removed, config.yaml
    rewritten with ``overrides``, the resume recorded in provenance.json); ``None`` for a finished run that the
    resume would not change. Any engine then resumes it (``feddg flower run --resume`` on a deployment);
    ``restart`` ends the refusal of a run with no checkpoint (how the command starts it again)."""
    if not (run_dir / CONFIG).is_file():
        raise RunDirError(f"{run_dir} is not a feddg run directory (no {CONFIG}) to resume")
    overrides = list(overrides or [])
    for key, _ in parse_overrides(overrides):
        if key not in RESUME_SAFE:
            raise ConfigError(f"{key}: cannot change on resume (the checkpoint was trained with it); "
                              f"a resume may change {', '.join(RESUME_SAFE)}")
    raw = read_yaml(run_dir / CONFIG)
    cfg = build_config(raw, overrides)
    before = raw.get("federation", {}).get("rounds")
    grows = isinstance(before, int) and cfg.federation.rounds != before
    if grows and cfg.federation.rounds < before:
        raise ConfigError(f"federation.rounds: a resumed run can only grow ({before} -> {cfg.federation.rounds})")
    if grows and cfg.optim.schedule == "cosine":
        raise ConfigError(f"federation.rounds: cannot change on resume with optim.schedule=cosine (its rounds "
                          f"so far followed a cosine over {before} rounds)")
    if grows and method_class(cfg.method.name).rounds_in_state:
        raise ConfigError(f"federation.rounds: cannot change on resume with {cfg.method.name} (its server state "
                          f"follows the run's {before} rounds)")
    if not has_checkpoint(run_dir):
        raise RunDirError(f"nothing to resume in {run_dir}: it has no checkpoint (it stopped before its first round "
                          f"ended); start it again {restart}")
    if (run_dir / RESULTS).is_file() and not grows:
        return None
    (run_dir / RESULTS).unlink(missing_ok=True)  # it describes the shorter run; rewritten at the new end
    for pattern in AUDIT_DIRS:  # so do the audits of its model: a sweep must not reuse them
        for path in run_dir.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
    if overrides:
        (run_dir / CONFIG).write_text(dump_config(cfg))
    record_resume(run_dir, cfg, overrides, same_as_fresh=_same_as_fresh(build_config(raw), cfg))
    return cfg
