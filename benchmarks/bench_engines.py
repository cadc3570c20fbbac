"""Wall time per round of one config on the three engines: in-process, Flower simulation, Flower deployment.

Usage: ``python benchmarks/bench_engines.py [--rounds 3] [--clients 3] [--max-per-domain 300]
[--engines inprocess simulation deployment] [--out DIR]``.

Every engine runs FedAvg on the same Digits-DG config (cnn, by-domain partition, one local
epoch) with one CPU thread per client process (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).
Per round: ``time_round_s`` from metrics.jsonl (configure -> replies -> aggregate -> evaluate, as
the server sees it). Total: wall time from the start of the engine (Ray start-up, or SuperLink and
SuperNode start-up) to results.json. Prints a Markdown table.

``--overhead [--repeats 2] [--variants head new]``: per-round overhead of a Flower deployment, the code of
git ``HEAD`` (exported with ``git archive`` and put first on ``PYTHONPATH``, Flower's default
``--isolation subprocess``) against this tree (feddg's warm executor, ``--isolation process``;
``new-subprocess``: this tree in Flower's default mode), interleaved: per repeat the in-process engine,
then each variant in turn. Overhead of a round = its ``time_round_s`` minus the same round's on the
in-process engine in the same repeat (which runs the clients one after another in one process: the
client compute, aggregation and evaluation; the bench process builds one optimizer first, as the warm
worker does, so that round 1 does not carry torch's lazy imports). Prints min/median per variant and
the load averages; the rows go to ``OUT/overhead.json``. ``head-process``: git ``HEAD`` with the warm executor too.

``--default-threads``: no ``OMP_NUM_THREADS=1`` for this process or the deployment's: every process keeps the
thread count its code chooses (a SuperNode sharing the machine with others, as in a trial or a rehearsal).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
import yaml

from feddg.config import ExperimentConfig, build_config
from feddg.engines.flower.worker import warm_up
from feddg.experiment import run_experiment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.flower_local import LocalDeployment

#: added to every deployment process's environment (``--default-threads`` empties it)
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def bench_dict(rounds: int, clients: int, max_per_domain: int, engine: str) -> dict:
    return {"name": "bench-engines", "seed": 0, "device": "cpu",
            "data": {"dataset": "digits-dg", "max_per_domain": max_per_domain},
            "split": {"target": "mnistm"}, "partition": {"kind": "by_domain", "num_clients": clients},
            "model": {"name": "cnn"}, "method": {"name": "fedavg"},
            "federation": {"engine": "flower" if engine == "simulation" else "inprocess", "rounds": rounds,
                           "batch_size": 32, "local_epochs": 1},
            "optim": {"lr": 0.05}, "flower": {"client_num_cpus": 1.0}}


def bench_config(rounds: int, clients: int, max_per_domain: int, engine: str) -> ExperimentConfig:
    return build_config(bench_dict(rounds, clients, max_per_domain, engine))


def variant_run_config(config_yaml: Path, run_dir: Path, env: dict[str, str]) -> str:
    """The run config TOML of ``config_yaml`` as the feddg on ``env``'s PYTHONPATH writes it (its own config schema)."""
    return subprocess.run([sys.executable, "-m", "feddg.engines.flower.app", str(config_yaml), "--run-dir",
                           str(run_dir.resolve())], env={**os.environ, **env}, check=True, capture_output=True,
                          text=True).stdout


def run_engine(engine: str, cfg: ExperimentConfig, out: Path, isolation: str = "process",
               env: dict[str, str] | None = None, config_yaml: Path | None = None) -> tuple[float, list[dict]]:
    """(total wall seconds, metrics rows) of one engine. For the deployment: ``isolation``, ``env`` (added to
    the environment of every deployment process) and ``config_yaml`` (the experiment, read by that feddg)."""
    run_dir = out / engine
    t0 = time.perf_counter()
    if engine == "deployment":
        run_config = variant_run_config(config_yaml, run_dir, env or {}) if config_yaml else cfg
        with LocalDeployment(out / "deployment-procs", cfg.partition.num_clients,
                             env={**THREAD_ENV, **(env or {})}, isolation=isolation) as dep:
            proc = dep.run(run_config, run_dir)
            if proc.returncode != 0:
                raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    else:
        run_experiment(cfg, run_dir, progress=False)
    total = time.perf_counter() - t0
    return total, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def export_head(out: Path) -> Path:
    """``git archive HEAD`` of this checkout extracted into ``out/head-<commit>``; returns its ``src`` folder."""
    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, check=True, capture_output=True,
                            text=True).stdout.strip()
    dest = out / f"head-{commit}"
    if not (dest / "src").is_dir():
        tar = subprocess.run(["git", "archive", "HEAD"], cwd=repo, check=True, capture_output=True).stdout
        tarfile.open(fileobj=io.BytesIO(tar)).extractall(dest, filter="data")
    return dest / "src"


def overhead(args: argparse.Namespace) -> None:
    """Per-round deployment overhead of each variant against the in-process engine, interleaved (see the docstring)."""
    warm_up()  # the in-process reference pays torch's first-optimizer imports before round 1, as the warm worker does
    head = {"PYTHONPATH": str(export_head(args.out).resolve())}
    variants = {"head": ("subprocess", head), "head-process": ("process", head),
                "new": ("process", {}), "new-subprocess": ("subprocess", {})}
    spec = bench_dict(args.rounds, args.clients, args.max_per_domain, "deployment")
    cfg, config_yaml = build_config(spec), args.out / "bench.yaml"
    config_yaml.write_text(yaml.safe_dump(spec))
    rows: dict[str, list[dict]] = {v: [] for v in args.variants}  # per round: time, overhead, load
    walls: dict[str, list[float]] = {v: [] for v in args.variants}
    for rep in range(args.repeats):
        out = args.out / f"{time.strftime('%H%M%S')}-{rep}"
        _, ref = run_engine("inprocess", cfg, out)
        for v in args.variants:
            isolation, env = variants[v]
            load = os.getloadavg()[0]
            wall, got = run_engine("deployment", cfg, out / v, isolation, env, config_yaml)
            walls[v].append(wall)
            rows[v] += [{"time": r["time_round_s"], "overhead": r["time_round_s"] - i["time_round_s"], "load": load}
                        for r, i in zip(got, ref, strict=True)]
            print(f"repeat {rep} {v}: rounds {[round(r['time_round_s'], 2) for r in got]} "
                  f"(in-process {[round(r['time_round_s'], 2) for r in ref]}), load {load:.1f}", flush=True)
    (args.out / "overhead.json").write_text(json.dumps({"rows": rows, "walls": walls}, indent=1))
    print("| variant | rounds | time/round (s) min / median | overhead/round (s) min / median "
          "| total wall (s) median | load average (1 min) |")
    print("|---|---:|---:|---:|---:|---:|")
    for v in args.variants:
        t, o, load = ([r[k] for r in rows[v]] for k in ("time", "overhead", "load"))
        print(f"| {v} | {len(t)} | {min(t):.2f} / {statistics.median(t):.2f} | {min(o):.2f} / {statistics.median(o):.2f} "
              f"| {statistics.median(walls[v]):.1f} | {min(load):.1f}-{max(load):.1f} |")
    if {"head", "new"} <= set(args.variants):
        ratio = statistics.median(r["overhead"] for r in rows["head"]) / statistics.median(
            r["overhead"] for r in rows["new"])
        print(f"\nmedian overhead head / new: {ratio:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-per-domain", type=int, default=300)
    ap.add_argument("--engines", nargs="+", default=["inprocess", "simulation", "deployment"])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-engines"))
    ap.add_argument("--overhead", action="store_true", help="deployment overhead: git HEAD against this tree")
    ap.add_argument("--repeats", type=int, default=2, help="--overhead: interleaved repeats")
    ap.add_argument("--variants", nargs="+", default=["head", "new"],
                    choices=["head", "head-process", "new", "new-subprocess"])
    ap.add_argument("--default-threads", action="store_true", help="no OMP_NUM_THREADS=1: each process's own thread count")
    args = ap.parse_args()
    if args.default_threads:
        THREAD_ENV.clear()
    else:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by Ray actors and Flower processes
        torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.overhead:
        overhead(args)
        return
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
