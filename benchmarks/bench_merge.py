"""M1: HFedATM's station → server merge of 10 ResNet-18 stations, this tree against a baseline commit.

The baseline is the merge of a git revision: its ``merges.py``, ``mean.py``, ``fot.py``, ``regmean.py``
and ``permutation.py``, loaded with ``git show REV:...`` into a temporary package; both run interleaved in
one process on the same inputs, and their merged models are compared (they must be the same bits). Each
merge is also set against its exact-cost bound measured in the run (its GEMM FLOPs, ``merge_gflop``, over this
machine's best float32 GEMM rate, ``fastest_gemm``) and to the exact merge's floor here: its own cost products as
timed inside this tree's merges (``GemmClock``) plus, timed interleaved with the merges, one pass of the float64
mean over the station weights (``mean_pass``).

    python benchmarks/bench_merge.py                      # --baseline 49e00c0 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from feddg.aggregation import merges
from feddg.bench.merge import (
    GemmClock,
    MergeCase,
    fastest_gemm,
    mean_pass,
    merge_gflop,
    resnet18_stations,
    summary,
    time_merges,
)
from feddg.models import create_model

ROOT = Path(__file__).resolve().parents[1]
#: the row of the floor: one float64 mean pass over the unpermuted station weights, timed with the merges
FLOOR = "floor: mean pass"
#: the rows of this tree's cost products as timed inside its merges, and of the exact merge's floor (the two summed)
PRODUCTS, EXACT = "floor: products", "floor: both"
#: the last commit before the permutation was fused into the mean (issue 29, M1)
BEFORE = "49e00c0"
#: baseline module name -> path in the repository; imports of the originals are redirected to the copies
FILES = {
    "permutation": "src/feddg/models/permutation.py",
    "mean": "src/feddg/aggregation/mean.py",
    "fot": "src/feddg/aggregation/fot.py",
    "regmean": "src/feddg/aggregation/regmean.py",
    "merges": "src/feddg/aggregation/merges.py",
}
REDIRECT = {
    "feddg.models.permutation": "permutation",
    "feddg.aggregation.mean": "mean",
    "feddg.aggregation.fot": "fot",
    "feddg.aggregation.regmean": "regmean",
    "feddg.aggregation.merges": "merges",
}


def load_baseline(rev: str, into: Path) -> dict[str, ModuleType]:
    """The baseline's modules, importing each other, as package ``merge_baseline``."""
    package = into / "merge_baseline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, path in FILES.items():
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        for original, copy in REDIRECT.items():
            source = source.replace(f"from {original} import", f"from merge_baseline.{copy} import")
        (package / f"{name}.py").write_text(source)
    sys.path.insert(0, str(into))
    return {name: importlib.import_module(f"merge_baseline.{name}") for name in FILES}


def compare(solver: str, merges_by_name: dict[str, tuple[Callable[..., Any], Any]], case: MergeCase, repeats: int,
            threads: int) -> None:
    """Time each merge interleaved and print a table row per implementation (the first is the yardstick)."""
    metrics: dict[str, list[dict[str, float]]] = {name: [] for name in merges_by_name}
    merged: dict[str, dict[str, np.ndarray]] = {}
    clock = GemmClock()  # around the last merge (this tree's; a baseline's products run on its own copies)

    def runner(name: str) -> Callable[[], None]:
        fn, spec = merges_by_name[name]
        timer = clock if name == list(merges_by_name)[-1] else nullcontext()

        def run() -> None:
            with timer:
                merged[name], m = fn(case.weights, case.grams, case.gammas, spec, solver=solver)
            metrics[name].append(m)

        return run

    runs: dict[str, Callable[[], object]] = {name: runner(name) for name in merges_by_name}
    runs[FLOOR] = mean_pass(case)
    time_merges(runs, 1, threads)  # warm-up: imports, first allocations
    for ms in metrics.values():
        ms.clear()
    clock.laps.clear()
    times = time_merges(runs, repeats, threads)
    times[PRODUCTS] = list(clock.laps)
    times[EXACT] = [clock.shortest() + min(times[FLOOR])]
    kernel, rate = fastest_gemm(threads)
    bound = merge_gflop(runs[next(iter(merges_by_name))]) / rate
    base = min(next(iter(times.values())))
    for name, ts in times.items():
        lo, med = summary(ts)
        if name in (FLOOR, PRODUCTS, EXACT):
            print(f"{solver:<10} {name:<18} {lo:7.3f} {med:9.3f} {'':>7} {'':>10} {'':>6} {'':>6} {lo / bound:8.2f}")
            continue
        fot = statistics.median(m["hfl/time_fot_s"] for m in metrics[name])
        reg = statistics.median(m["hfl/time_regmean_s"] for m in metrics[name])
        passes = metrics[name][-1]["fot/passes"]
        print(f"{solver:<10} {name:<18} {lo:7.3f} {med:9.3f} {fot:7.3f} {reg:10.3f} {passes:6.0f} {base / lo:6.2f} "
              f"{lo / bound:8.2f}")
    print(f"{solver:<10} {'GEMM bound':<18} {bound:7.3f} ({rate:.0f} GFLOP/s, {kernel}, at 512 × 4608 × 512, {threads} threads)")
    a, b = merged.values()
    same = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    moved = metrics[list(metrics)[-1]][-1]["fot/moved"]
    print(f"{solver:<10} merged models: same bits {same}, max |yardstick − this tree| = {diff:.2e}; "
          f"filters moved {moved:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BEFORE, help=f"git revision of the yardstick (default {BEFORE})")
    parser.add_argument("--stations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--solvers", default="hungarian,sinkhorn", help="comma-separated (M1's target: hungarian)")
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    case = resnet18_stations(args.stations)
    with tempfile.TemporaryDirectory() as tmp:
        old = load_baseline(args.baseline, Path(tmp))
        old_spec = old["permutation"].permutation_spec(create_model("resnet18", num_classes=10, image_size=224))
        print(f"M1: merge of {args.stations} ResNet-18 stations (FOT + RegMean), {args.threads} torch threads, "
              f"{args.repeats} interleaved repeats; load average {os.getloadavg()} at the start")
        print(f"{'solver':<10} {'implementation':<18} {'min s':>7} {'median s':>9} {'FOT s':>7} {'RegMean s':>10} "
              f"{'passes':>6} {'ratio':>6} {'× bound':>8}   (FOT, RegMean: medians of the merge's own timers; "
              "ratio: baseline min / min; × bound: min / GEMM bound)")
        for solver in args.solvers.split(","):
            compare(solver, {f"baseline {rev}": (old["merges"].merge_stations, old_spec),
                             "this tree": (merges.merge_stations, case.spec)}, case, args.repeats, args.threads)
        print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
