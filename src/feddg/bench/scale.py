"""The papers' client counts end to end (time per round, peak RSS) and the client workers' start-up time."""

from __future__ import annotations

import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.table import Table

from feddg.config import ExperimentConfig, load_config
from feddg.engines.workers import FederationFactory, WorkerPool
from feddg.evaluation.plots import read_metrics
from feddg.federation.setup import Federation


def peak_rss_mb() -> dict[str, float]:
    """Peak resident memory so far of this process and of its finished children (Linux: KiB -> MiB)."""
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def scale_run(config: Path, rounds: int, overrides: list[str]) -> dict[str, Any]:
    """Run ``config`` for ``rounds`` rounds in a scratch directory: build, per-round and total seconds, peak RSS."""
    from feddg.experiment import run_experiment  # the whole stack

    cfg = load_config(config, [*overrides, f"federation.rounds={rounds}"])
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_experiment(cfg, Path(tmp) / "run", progress=False)
        total = time.perf_counter() - t0
        rows = read_metrics(Path(tmp) / "run")
    per_round = [float(r["time_round_s"]) for r in rows]
    return {"clients": cfg.partition.num_clients, "fraction": cfg.federation.client_fraction,
            "sampled": [int(r["clients"]) for r in rows], "round_s": per_round, "total_s": total,
            "build_s": total - sum(per_round), "peak_rss_mb": peak_rss_mb(), "workers": cfg.federation.workers}


def worker_start_seconds(cfg: ExperimentConfig, fed: Federation, workers: int, factory: FederationFactory,
                         fork: bool) -> float:
    """Seconds from creating a pool of ``workers`` until every worker said ``ready`` (forked with ``fed``, or
    spawned and rebuilding it with ``factory``)."""
    t0 = time.perf_counter()
    with WorkerPool(cfg, workers, factory=factory, fed=fed if fork else None) as pool:
        for w in pool.workers:
            if w.conn.recv() != ("ready",):
                raise RuntimeError("a worker could not start")
            w.ready = True
        return time.perf_counter() - t0


def scale_report(configs: list[Path], rounds: int, overrides: list[str]) -> Iterator[Table | str]:
    """``feddg bench scale``, each line or table as soon as it is measured: the load average, one row of
    :func:`scale_run` per config, the load average."""
    from feddg.bench.w1 import load_average

    yield f"load average before: {load_average()}"
    t = Table(title=f"{rounds} rounds each; peak RSS of this process / of its worker processes")
    for col in ("config", "clients", "sampled/round", "build s", "s/round", "peak RSS MiB (self / workers)"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for path in configs:
        r = scale_run(path, rounds, overrides)
        rss = r["peak_rss_mb"]
        t.add_row(str(path), f"{r['clients']:,}", " ".join(map(str, r["sampled"])), f"{r['build_s']:.1f}",
                  " ".join(f"{s:.1f}" for s in r["round_s"]), f"{rss['self']:,.0f} / {rss['children']:,.0f}")
    yield t
    yield f"load average after: {load_average()}"
