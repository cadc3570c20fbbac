"""``feddg bench all``: the headline speed and memory figures in one table, each beside a yardstick measured in
the same run (or, where none can run here, the recorded figure it is compared with), the ratio, and the target.

Every row runs the benchmark module that owns it (w1, merge, memory, scale); ``quick`` shrinks them so the
table is a smoke run (minutes), and the full size is the one docs/benchmarks.md records (W1 at 2,000 images a
client, M1 on ResNet-18 with 10 stations against its GEMM bound measured here, 1,000 clients of a ResNet-18-sized
model, FEMNIST's 3,400 clients against a plain loop). Every row gives the CPU seconds behind its figure.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from feddg.aggregation.fot import Solver

RESNET18_PARAMS = 11_689_512


@dataclass
class Row:
    figure: str
    value: str
    yardstick: str
    ratio: float | None
    target: str
    met: bool | None
    cpu: str = ""  #: CPU seconds (this process and its children) behind the measured figure


def _seconds(cmd: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def w1_rows(images: int, repeats: int) -> list[Row]:
    from feddg.bench.w1 import background_load, summary, w1_table

    rows = []
    for name, lo, med, ratio, cpu in summary(w1_table(repeats, images))[1:]:
        target = "≤ 1.1×" if "workers: auto" in name else ""
        rows.append(Row(f"W1 {name} ({images} img/client)", f"{lo:.1f} / {med:.1f} s",
                        "plain PyTorch 2 × 1 thread", ratio, target, ratio <= 1.1 if target else None, f"{cpu:.1f}"))
    with background_load(1):  # "idle and under load": one core's busy loop for both, interleaved
        (_, plain, _, _, _), (name, lo, med, ratio, cpu) = summary(w1_table(repeats, images, ("plain", "auto")))
    rows.append(Row(f"W1 {name} under 1 busy loop ({images} img/client)", f"{lo:.1f} / {med:.1f} s",
                    f"plain PyTorch 2 × 1 thread, same load ({plain:.1f} s)", ratio, "≤ 1.1×", ratio <= 1.1,
                    f"{cpu:.1f}"))
    return rows


def m1_rows(stations: int, repeats: int, solvers: tuple[Solver, ...] = ("hungarian", "sinkhorn")) -> list[Row]:
    """The merge with each of ``solvers`` (one input, built once) against its exact-cost bound: its GEMM FLOPs over
    this machine's best float32 GEMM rate (:func:`~feddg.bench.merge.fastest_gemm`), both measured here, beside
    each solver's timing; the yardstick also gives the exact merge's floor here (its products as timed inside it,
    :class:`~feddg.bench.merge.GemmClock`, plus one float64 mean pass timed interleaved with it)."""
    from feddg.aggregation.merges import HFedATMParams, merge_stations
    from feddg.bench.merge import GemmClock, fastest_gemm, mean_pass, merge_gflop, resnet18_stations, time_merges

    case = resnet18_stations(stations)
    rows = []
    for solver in solvers:
        clock, cpu = GemmClock(), []

        def merge(solver: Solver = solver) -> object:
            c0 = time.process_time()
            with clock:
                merged = merge_stations(case.weights, case.grams, case.gammas, case.spec, solver=solver)
            cpu.append(time.process_time() - c0)
            return merged

        runs = {"m1": merge, "mean": mean_pass(case)}
        time_merges(runs, 1, 2)  # warm-up: imports, first allocations
        clock.laps.clear()
        cpu.clear()
        times = time_merges(runs, repeats, 2)
        products, mean, merge_cpu = clock.shortest(), min(times["mean"]), min(cpu)
        kernel, rate = fastest_gemm(2)
        flops = merge_gflop(merge)
        if flops <= 0:  # a product on a kernel FlopCounterMode does not know: no bound, rather than a wrong one
            raise RuntimeError("M1: no GEMM FLOPs counted in the merge; its cost products run on an uncounted kernel")
        bound = flops / rate
        lo = min(times["m1"])
        default = " (HFedATM's default)" if solver == HFedATMParams().solver else ""
        yardstick = (f"GEMM bound {bound:.2f} s ({rate:.0f} GFLOP/s, {kernel}); exact floor {products + mean:.2f} s = "
                     f"{(products + mean) / bound:.2f}× (its products {products:.2f} + float64 mean {mean:.2f} s)")
        rows.append(Row(f"M1 HFedATM merge, ResNet-18 × {stations} stations, {solver.capitalize()}{default}, 2 threads",
                        f"{lo:.2f} / {statistics.median(times['m1']):.2f} s", yardstick, lo / bound, "≤ 1.5×",
                        lo <= 1.5 * bound, f"{merge_cpu:.2f}"))
    return rows


def memory_rows(params: int, clients: list[int]) -> list[Row]:
    from feddg.bench.memory import memory_table
    from feddg.bench.w1 import cpu_seconds

    rows = []
    for n in clients:
        c0 = cpu_seconds()
        table = memory_table(params, [n], 0.0)
        cpu = cpu_seconds() - c0
        for r in table:  # streaming only: the all-at-once list is the old code
            if r["fold"] != "streaming":
                continue
            peak, models = float(r["peak_mb"]), float(r["models"])
            rows.append(Row(f"server peak, FedAvg round, {int(r['clients']):,} clients × {params:,} params",
                            f"{peak:,.0f} MiB", "one model", models, "≤ 1 GiB above the model", peak <= 1024,
                            f"{cpu:.1f}"))
    return rows


def methods_row(repeats: int) -> Row:
    from feddg.bench.w1 import cpu_seconds

    feddg = [sys.executable, "-m", "feddg", "methods"]
    _seconds(feddg, 1)  # fills the listing cache
    bare, times, cpus = [], [], []
    for _ in range(repeats):  # interleaved: bare python, then feddg, each repeat
        bare += _seconds([sys.executable, "-c", "pass"], 1)
        c0 = cpu_seconds()
        times += _seconds(feddg, 1)
        cpus.append(cpu_seconds() - c0)
    return Row("feddg methods (warm)", f"{min(times):.2f} / {statistics.median(times):.2f} s",
               f"bare python {min(bare):.2f} s", min(times) / min(bare), "≤ 1 s", min(times) <= 1.0,
               f"{min(cpus):.2f}")


def worker_start_row() -> Row:
    from feddg.bench.scale import worker_start_seconds
    from feddg.bench.w1 import cpu_seconds, w1_config, w1_federation

    cfg = w1_config(2, images=200)
    fed = w1_federation(cfg)
    c0 = cpu_seconds()
    forked = worker_start_seconds(cfg, fed, 2, w1_federation, fork=True)
    return Row("worker pool start (2 workers, forked)", f"{forked:.2f} s", "", None, "≤ 2 s", forked <= 2.0,
               f"{cpu_seconds() - c0:.2f}")


def scale_row(repeats: int) -> Row:
    """FEMNIST's shape with natural clients (``configs/scale/writers-scale.yaml``: 3,060 writers): its last round
    against the plain loop of the same 50 client-epochs and evaluation pass (``feddg bench scale``)."""
    from pathlib import Path

    from feddg.bench.scale import scale_run, yardstick
    from feddg.config import load_config

    over = ["federation.rounds=2"]
    cfg = load_config(Path(__file__).parents[3] / "configs" / "scale" / "writers-scale.yaml", over)
    runs, plain = [], []
    for _ in range(repeats):
        runs.append(scale_run(cfg))
        plain.append(yardstick(cfg))
    last = [r["round_s"][-1] for r in runs]
    base = min(p["train"] + p["eval"] for p in plain)
    return Row(f"writers-scale (FEMNIST's shape): last round, {plain[0]['clients']:,.0f} clients, 50 sampled + evaluation",
               f"{min(last):.2f} / {statistics.median(last):.2f} s", f"plain loop {base:.2f} s", min(last) / base,
               "≤ 1.2×", min(last) <= 1.2 * base, f"{min(r['cpu_s'] for r in runs):.1f} per run")


def summary_rows(quick: bool, repeats: int, progress: Callable[[str], None] = lambda _: None) -> list[Row]:
    """Every figure, W1 first; ``progress`` hears each one's name before it runs."""
    steps: list[tuple[str, Callable[[], list[Row]]]] = [
        ("W1", lambda: w1_rows(400 if quick else 2000, repeats)),
        ("M1", lambda: m1_rows(3 if quick else 10, repeats)),
        ("memory", lambda: memory_rows(1_000_000 if quick else RESNET18_PARAMS, [100, 1000] if quick else [1000])),
        ("feddg methods", lambda: [methods_row(repeats)]),
        ("worker start", lambda: [worker_start_row()]),
        ("scale", lambda: [scale_row(repeats)]),
    ]
    rows: list[Row] = []
    for name, step in steps:
        progress(name)
        rows += step()
    return rows


def summary_table(rows: list[Row], quick: bool, repeats: int) -> Table:
    """The rows of :func:`summary_rows` as ``feddg bench all`` prints them."""
    t = Table(title=f"feddg bench all{' --quick' if quick else ''}: {repeats} interleaved repeats; min / median")
    for col in ("figure", "measured", "CPU s", "yardstick", "× yardstick", "target", "met"):
        t.add_column(col, justify="right" if col in ("measured", "CPU s", "× yardstick") else "left")
    for r in rows:
        t.add_row(r.figure, r.value, r.cpu, r.yardstick, "" if r.ratio is None else f"{r.ratio:.2f}", r.target,
                  "" if r.met is None else ("yes" if r.met else "no"))
    return t


def summary_report(quick: bool, repeats: int, progress: Callable[[str], None] = lambda _: None) -> list[Table | str]:
    """``feddg bench all``: the table of every figure, then the load average before and after."""
    from feddg.bench.w1 import load_average

    before = load_average()
    rows = summary_rows(quick, repeats, progress)
    return [summary_table(rows, quick, repeats), f"load average before: {before}; after: {load_average()}"]
