"""Run one experiment from a config: build, train on an engine, write the run directory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from feddg.config import ExperimentConfig, build_config, read_yaml
from feddg.evaluation.plots import report
from feddg.federation.inprocess import run_inprocess
from feddg.federation.server import CONFIG, Server
from feddg.federation.setup import build_federation

console = Console(stderr=True)


def default_run_dir(cfg: ExperimentConfig) -> Path:
    target = cfg.split.target or "first"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.output_dir) / f"{cfg.name}-{cfg.method.name}-{target}-s{cfg.seed}-{stamp}"


def _progress(enabled: bool) -> Progress:
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


def _status(row: dict[str, Any]) -> str:
    parts = [f"loss {row['train_loss']:.3f}"]
    for key in ("id_acc", "val_acc", "ood_acc"):
        if key in row:
            parts.append(f"{key.split('_')[0]} {row[key]:.1f}%")
    return " · ".join(parts)


def run_experiment(
    cfg: ExperimentConfig, run_dir: str | Path | None = None, *, resume: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Train ``cfg`` and return results.json's content; ``resume`` continues ``run_dir``'s checkpoint."""
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    fed = build_federation(cfg)
    server = Server(fed, run_dir, resume=resume)
    targets = ", ".join(fed.dataset.domains[d] for d in fed.split.test_domains)
    with _progress(progress) as bar:
        task = bar.add_task(f"{cfg.method.name} → {targets}", total=cfg.federation.rounds, completed=server.round,
                            status="")
        on_round = lambda row: bar.update(task, advance=1, status=_status(row))  # noqa: E731
        if cfg.federation.engine == "flower":
            from feddg.federation.flower_engine import run_flower  # needs the [flower] extra

            results = run_flower(server, on_round=on_round)
        else:
            results = run_inprocess(server, on_round=on_round)
    results["run_dir"] = str(run_dir)
    report(run_dir)
    return results


def resume_experiment(run_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Continue a killed run from its last checkpoint, with the config it was started with."""
    run_dir = Path(run_dir)
    cfg = build_config(read_yaml(run_dir / CONFIG))
    return run_experiment(cfg, run_dir, resume=True, progress=progress)
