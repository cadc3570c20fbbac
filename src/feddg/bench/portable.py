"""The cost of ``reproducibility: portable``: the same short run through the ``feddg`` command with this CPU's own
kernels and with the pinned ones, in fresh processes, interleaved (native, portable, native, portable, ...)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from feddg.bench.w1 import load_average
from feddg.reproducibility import PORTABLE_DEFAULTS, PORTABLE_ENV

#: a tenth of the demo: FedAvg on Digits-DG (6 clients, 600 images a domain), held out mnistm
RUN = ["-o", "data.max_per_domain=600", "-o", "split.target=mnistm", "-o", "federation.rounds=3", "--quiet"]


def one_run(config: Path, mode: str, extra: list[str]) -> float:
    """Wall seconds of ``feddg run config`` with ``reproducibility=mode`` in a fresh process (start-up included; the
    environment without any portable setting, so ``native`` runs this CPU's own kernels)."""
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV and k not in PORTABLE_DEFAULTS}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "feddg", "run", str(config), *RUN, *extra,
                              "-o", f"reproducibility={mode}", "--run-dir", str(Path(tmp) / "run")],
                             env=env, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
    if res.returncode != 0:  # feddg prints a user error on stdout, a traceback on stderr: show the last line
        last = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:] or [f"exit code {res.returncode}"]
        raise RuntimeError(f"feddg run ({mode}) failed: {last[0]}")
    return seconds


def portable_table(config: Path, repeats: int, extra: list[str]) -> Table:
    """min / median seconds of each mode over ``repeats`` interleaved runs, and portable / native."""
    before = load_average()
    times: dict[str, list[float]] = {"native": [], "portable": []}
    for _ in range(repeats):
        for mode in times:
            times[mode].append(one_run(config, mode, extra))
    t = Table(title=f"feddg run {config} {' '.join(RUN + extra)}: {repeats} interleaved repeats; "
              f"load average before {before}, after {load_average()}")
    for col in ("kernels", "min s", "median s", "× native (min)"):
        t.add_column(col, justify="left" if col == "kernels" else "right")
    native = min(times["native"])
    for mode, secs in times.items():
        t.add_row(mode, f"{min(secs):.1f}", f"{statistics.median(secs):.1f}", f"{min(secs) / native:.2f}")
    return t
