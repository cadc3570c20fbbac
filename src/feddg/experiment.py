"""Run one experiment from a config: build, train on an engine, write the run directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from feddg.config import ConfigError, ExperimentConfig, build_config, dump_config, parse_overrides, read_yaml
from feddg.engines.inprocess import run_inprocess
from feddg.evaluation.plots import plot_run
from feddg.federation.provenance import record_resume
from feddg.federation.server import CONFIG, RESULTS, Server, default_run_dir
from feddg.federation.setup import build_federation
from feddg.tasks import Task, metric_key
from feddg.tracking import Tracking

console = Console(stderr=True)



def progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
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
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    if not resume:
        _fresh_run_dir(run_dir, overwrite)
    tracking = Tracking(cfg, run_dir)  # logging: tensorboard / mlflow; a missing package fails before the run
    fed = build_federation(cfg)
    server = Server(fed, run_dir, resume=resume)
    targets = ", ".join(fed.dataset.domains[d] for d in fed.split.test_domains)
    with progress_bar(progress) as bar:
        task = bar.add_task(f"{cfg.method.name} → {targets}", total=server.rounds, completed=server.round,
                            status="")

        def on_round(row: dict[str, Any]) -> None:
            bar.update(task, advance=1, status=_status(row, fed.task))
            tracking.log_round(row)

        if cfg.federation.engine == "flower":
            from feddg.engines.flower.simulation import run_flower  # needs the [flower] extra

            results = run_flower(server, on_round=on_round)
        else:
            results = run_inprocess(server, on_round=on_round)
    results["run_dir"] = str(run_dir)
    plot_run(run_dir)
    tracking.finish(results)
    return results


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (not empty, not a run directory)."""


def _fresh_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Make sure a fresh run does not mix with files of another run in ``run_dir``."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file")
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if not overwrite:
        raise RunDirError(f"run directory {run_dir} is not empty; --resume {run_dir} continues that run, "
                          "--overwrite replaces it")
    clear_run_dir(run_dir)


def clear_run_dir(run_dir: Path) -> None:
    """Delete a run directory's content; refuses a directory that is not a feddg run (no config.yaml)."""
    if not (run_dir / CONFIG).is_file():
        raise RunDirError(f"{run_dir} is not a feddg run directory (no {CONFIG}); refusing to delete its content")
    shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


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


def resume_experiment(run_dir: str | Path, overrides: list[str] | None = None, *, progress: bool = True
                      ) -> dict[str, Any]:
    """Continue a killed or finished run from its last checkpoint, with the config it was started with.

    ``overrides`` may change only :data:`RESUME_SAFE` keys; they are written to config.yaml.
    """
    run_dir = Path(run_dir)
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
    if isinstance(before, int) and cfg.federation.rounds != before:
        if cfg.federation.rounds < before:
            raise ConfigError(f"federation.rounds: a resumed run can only grow ({before} -> {cfg.federation.rounds})")
        if cfg.optim.schedule == "cosine":
            raise ConfigError(f"federation.rounds: cannot change on resume with optim.schedule=cosine (its rounds "
                              f"so far followed a cosine over {before} rounds)")
        (run_dir / RESULTS).unlink(missing_ok=True)  # it describes the shorter run; rewritten at the new end
    if overrides:
        (run_dir / CONFIG).write_text(dump_config(cfg))
    record_resume(run_dir, cfg, overrides)
    return run_experiment(cfg, run_dir, resume=True, progress=progress)
