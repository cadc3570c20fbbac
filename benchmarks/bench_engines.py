"""Wall time per round of one config on the three engines: in-process, Flower simulation, Flower deployment.

Usage: ``python benchmarks/bench_engines.py [--rounds 3] [--clients 3] [--max-per-domain 300]
[--engines inprocess simulation deployment] [--out DIR]``.

Every engine runs FedAvg on the same Digits-DG config (cnn, by-domain partition, one local
epoch) with one CPU thread per client process (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).
Per round: ``time_round_s`` from metrics.jsonl (configure -> replies -> aggregate -> evaluate, as
the server sees it). Total: wall time from the start of the engine (Ray start-up, or SuperLink and
SuperNode start-up) to results.json. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from feddg.config import ExperimentConfig, build_config
from feddg.experiment import run_experiment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.flower_local import LocalDeployment


def bench_config(rounds: int, clients: int, max_per_domain: int, engine: str) -> ExperimentConfig:
    return build_config(
        {"name": "bench-engines", "seed": 0, "device": "cpu",
         "data": {"dataset": "digits-dg", "max_per_domain": max_per_domain},
         "split": {"target": "mnistm"}, "partition": {"kind": "by_domain", "num_clients": clients},
         "model": {"name": "cnn"}, "method": {"name": "fedavg"},
         "federation": {"engine": "flower" if engine == "simulation" else "inprocess", "rounds": rounds,
                        "batch_size": 32, "local_epochs": 1},
         "optim": {"lr": 0.05}, "flower": {"client_num_cpus": 1.0}}
    )


def run_engine(engine: str, cfg: ExperimentConfig, out: Path) -> tuple[float, list[dict]]:
    """(total wall seconds, metrics rows) of one engine."""
    run_dir = out / engine
    t0 = time.perf_counter()
    if engine == "deployment":
        with LocalDeployment(out / "deployment-procs", cfg.partition.num_clients, env={"OMP_NUM_THREADS": "1"}) as dep:
            proc = dep.run(cfg, run_dir)
            if proc.returncode != 0:
                raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    else:
        run_experiment(cfg, run_dir, progress=False)
    total = time.perf_counter() - t0
    return total, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-per-domain", type=int, default=300)
    ap.add_argument("--engines", nargs="+", default=["inprocess", "simulation", "deployment"])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-engines"))
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by Ray actors and Flower processes
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    print("| engine | rounds | time/round (s), median | min | max | total wall (s) | ood acc (%) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for engine in args.engines:
        cfg = bench_config(args.rounds, args.clients, args.max_per_domain, engine)
        total, rows = run_engine(engine, cfg, args.out / time.strftime("%H%M%S"))
        per = [r["time_round_s"] for r in rows]
        print(f"| {engine} | {len(rows)} | {statistics.median(per):.2f} | {min(per):.2f} | {max(per):.2f} "
              f"| {total:.1f} | {rows[-1]['ood_acc']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
