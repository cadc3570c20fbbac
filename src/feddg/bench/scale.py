"""The papers' client counts end to end (time per round against a plain loop of the same clients, CPU seconds,
peak RSS) and the client workers' start-up time."""

from __future__ import annotations

import math
import resource
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table
from torch import nn

from feddg.bench.memory import reset_peak_rss, rss_mb
from feddg.config import ExperimentConfig, load_config
from feddg.engines.workers import FederationFactory, WorkerPool, compute_threads, resolve_workers
from feddg.evaluation.plots import read_metrics
from feddg.federation.server import Server
from feddg.federation.setup import Federation, build_federation


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB since the last :func:`reset_peak_rss` (Linux ``VmHWM``), or
    without /proc since the process started (``ru_maxrss``, KiB)."""
    peak = rss_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if math.isnan(peak) else peak


def scale_run(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run ``cfg`` in a scratch directory: build seconds, each round's seconds (the last one evaluates), wall
    and CPU seconds, the run's peak RSS (MiB; ``peak_own``: False where it could not be reset, so it is the
    process's peak so far), and the clients of each round."""
    from feddg.bench.w1 import cpu_seconds
    from feddg.experiment import run_experiment  # the whole stack

    own_peak = reset_peak_rss()  # this run's own peak: not an earlier config's, nor a yardstick's federation
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), cpu_seconds()
        run_experiment(cfg, Path(tmp) / "run", progress=False)
        total, cpu, peak = time.perf_counter() - t0, cpu_seconds() - c0, peak_rss_mb()
        rows = read_metrics(Path(tmp) / "run")
    per_round = [float(r["time_round_s"]) for r in rows]
    return {"sampled": [int(r["clients"]) for r in rows],
            "round_s": per_round, "total_s": total, "cpu_s": cpu, "build_s": total - sum(per_round), "peak_mb": peak,
            "peak_own": own_peak}


def yardstick(cfg: ExperimentConfig) -> dict[str, float]:
    """:func:`plain_round_seconds` of the clients that ``cfg``'s last round samples, on one torch thread (as
    feddg's sequential path), with that round's learning rate; and the federation's number of clients."""
    fed = build_federation(cfg)
    with tempfile.TemporaryDirectory() as tmp, compute_threads(1):
        server = Server(fed, Path(tmp) / "run")
        last = cfg.federation.rounds
        return {**plain_round_seconds(fed, list(server.configure(last)), server.lr(last)), "clients": len(fed.clients)}


def plain_round_seconds(fed: Federation, clients: list[int], lr: float) -> dict[str, float]:
    """The pure compute of one round of ``clients`` in a plain PyTorch loop on this process's threads: each
    client's epochs of SGD from the same start (its batches read before the clock starts, batches of one
    skipped as feddg skips them for BatchNorm) and one evaluation pass over what feddg evaluates (held-out
    domains, validation domain, the clients' holdouts); seconds of
    ``train`` and ``eval``. No messages, copies of state beyond ``load_state_dict``, aggregation or files."""
    cfg, ds, model = fed.cfg, fed.dataset, fed.model
    fc, opt_cfg = cfg.federation, cfg.optim
    batches = []
    for cid in clients:
        idx = fed.clients[cid].train_idx
        for _ in range(fc.local_epochs):
            order = np.random.default_rng(cid).permutation(idx)
            batches.append([ds.get_batch(order[i:i + fc.batch_size], train=False)
                            for i in range(0, len(order), fc.batch_size) if len(order[i:i + fc.batch_size]) > 1])
    # what feddg's evaluation reads: the held-out domains, the clients' holdouts and the validation domain
    held = np.concatenate([fed.split.test_idx, fed.split.val_idx, *(c.holdout_idx for c in fed.clients)])
    evals = [ds.get_batch(held[i:i + cfg.eval.batch_size], train=False)
             for i in range(0, len(held), cfg.eval.batch_size)]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    for client_batches in batches:
        model.load_state_dict(start)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=opt_cfg.momentum, weight_decay=opt_cfg.weight_decay)
        for x, y in client_batches:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    t1 = time.perf_counter()
    model.eval()
    with torch.no_grad():
        for x, _ in evals:
            model(x)
    t2 = time.perf_counter()
    model.load_state_dict(start)
    return {"train": t1 - t0, "eval": t2 - t1}


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


def scale_report(configs: list[Path], rounds: int, overrides: list[str], repeats: int = 2
                 ) -> Iterator[Table | str]:
    """``feddg bench scale``, each line or table as soon as it is measured: per config, ``repeats`` interleaved
    pairs (feddg's run, the plain loop of its last round), then the table; the load average before and after.

    The ratio is feddg's last round (``time_round_s``: its clients, aggregation and evaluation; the metrics row and
    the checkpoint written after it are not in it) over the plain loop's
    train + eval of the same clients and held-out images: per-client overhead shows here, build time does not."""
    from feddg.bench.w1 import load_average

    yield f"load average before: {load_average()}"
    t = Table(title=f"{rounds} rounds each (the last evaluates), {repeats} interleaved repeats: min (median)")
    for col in ("config", "clients", "sampled/round", "build s", "last round s", "plain s (train + eval)",
                "× plain", "wall / CPU s per run", "peak RSS MiB", "client-state budget MiB"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for path in configs:
        cfg = load_config(path, [*overrides, f"federation.rounds={rounds}"])
        if resolve_workers(cfg.federation.workers, torch.device("cpu"), cfg.partition.num_clients):
            raise ValueError(f"{path}: the scale yardstick is sequential; set federation.workers: 1")
        runs, plain = [], []
        for _ in range(repeats):
            runs.append(scale_run(cfg))
            plain.append(yardstick(cfg))
        last = [r["round_s"][-1] for r in runs]
        base = [p["train"] + p["eval"] for p in plain]
        best = min(base)
        budget = cfg.federation.client_state_budget_mb
        peak = f"{max(r['peak_mb'] for r in runs):,.0f}" + ("" if all(r["peak_own"] for r in runs) else " (process so far)")
        t.add_row(str(path), f"{plain[0]['clients']:,.0f}", " ".join(map(str, runs[0]["sampled"])),
                  f"{min(r['build_s'] for r in runs):.1f}", f"{min(last):.2f} ({statistics.median(last):.2f})",
                  f"{best:.2f} ({min(p['train'] for p in plain):.2f} + {min(p['eval'] for p in plain):.2f})",
                  f"{min(last) / best:.2f}", " / ".join(f"{min(r[k] for r in runs):.1f}" for k in ("total_s", "cpu_s")),
                  peak, "unlimited" if budget is None else f"{budget:,.0f}")
    yield t
    yield f"load average after: {load_average()}"
