"""M1: HFedATM's station → server merge of 10 ResNet-18 stations, this tree against a baseline commit.

The baseline is the same merge (``feddg/aggregation/merges.py`` of this tree) running the
baseline's ``fot.py``, ``regmean.py`` and ``permutation.py``, loaded with ``git show REV:...`` into a
temporary package; both run interleaved in one process on the same inputs, and their merged
models are compared.

    python benchmarks/bench_merge.py                      # --baseline ececa71 --repeats 5 --threads 2
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
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from feddg.aggregation import merges
from feddg.bench.merge import MergeCase, resnet18_stations, summary, time_merges
from feddg.models import create_model

ROOT = Path(__file__).resolve().parents[1]
#: the last commit before the fast merge (issue #13)
BEFORE = "ececa71"
#: baseline module name -> path in the repository; imports of the originals are redirected to the copies
FILES = {
    "permutation": "src/feddg/models/permutation.py",
    "fot": "src/feddg/aggregation/fot.py",
    "regmean": "src/feddg/aggregation/regmean.py",
    "merges": "src/feddg/aggregation/merges.py",
}
REDIRECT = {
    "feddg.models.permutation": "permutation",
    "feddg.aggregation.fot": "fot",
    "feddg.aggregation.regmean": "regmean",
}


def load_baseline(rev: str, into: Path) -> dict[str, ModuleType]:
    """The baseline's modules (and this tree's merges.py wired to them) as package ``merge_baseline``."""
    package = into / "merge_baseline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, path in FILES.items():
        source = (ROOT / path).read_text() if name == "merges" else subprocess.run(
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

    def runner(name: str) -> Callable[[], None]:
        fn, spec = merges_by_name[name]

        def run() -> None:
            merged[name], m = fn(case.weights, case.grams, case.gammas, spec, solver=solver)
            metrics[name].append(m)

        return run

    runs = {name: runner(name) for name in merges_by_name}
    time_merges(runs, 1, threads)  # warm-up: imports, first allocations
    for ms in metrics.values():
        ms.clear()
    times = time_merges(runs, repeats, threads)
    base = min(next(iter(times.values())))
    for name, ts in times.items():
        lo, med = summary(ts)
        fot = statistics.median(m["hfl/time_fot_s"] for m in metrics[name])
        reg = statistics.median(m["hfl/time_regmean_s"] for m in metrics[name])
        passes = metrics[name][-1]["fot/passes"]
        print(f"{solver:<10} {name:<18} {lo:7.3f} {med:9.3f} {fot:7.3f} {reg:10.3f} {passes:6.0f} {base / lo:6.2f}")
    a, b = merged.values()
    diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    moved = metrics[name][-1]["fot/moved"]
    print(f"{solver:<10} merged models: max |yardstick − this tree| = {diff:.2e}; filters moved {moved:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BEFORE, help=f"git revision of the yardstick (default {BEFORE})")
    parser.add_argument("--stations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    case = resnet18_stations(args.stations)
    with tempfile.TemporaryDirectory() as tmp:
        old = load_baseline(args.baseline, Path(tmp))
        old_spec = old["permutation"].permutation_spec(create_model("resnet18", num_classes=10, image_size=224))
        print(f"M1: merge of {args.stations} ResNet-18 stations (FOT + RegMean), {args.threads} torch threads, "
              f"{args.repeats} interleaved repeats; load average {os.getloadavg()[0]:.2f} at the start")
        print(f"{'solver':<10} {'implementation':<18} {'min s':>7} {'median s':>9} {'FOT s':>7} {'RegMean s':>10} "
              f"{'passes':>6} {'ratio':>6}   (FOT, RegMean: medians of the merge's own timers; ratio: min vs min)")
        for solver in ("hungarian", "sinkhorn"):
            compare(solver, {f"baseline {rev}": (old["merges"].merge_stations, old_spec),
                             "this tree": (merges.merge_stations, case.spec)}, case, args.repeats, args.threads)
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
