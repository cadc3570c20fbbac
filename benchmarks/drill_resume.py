"""Kill-and-resume drill: runs SIGKILLed at random moments all resume to the uninterrupted result, bit for bit.

Usage: ``python benchmarks/drill_resume.py [--runs 20] [--rounds 4] [--workers 1] [--seed 0] [--out DIR]``.

One uninterrupted ``feddg run`` of a tiny Digits-DG config is the reference. Then ``--runs`` copies of
the same command are each killed with SIGKILL (no chance to clean up) and continued with
``feddg run --resume``. The kill moments cycle through three kinds:

``random``      a uniform delay after the run directory appears, within 85 % of the reference run's
                remaining time (training, aggregation, evaluation, checkpoint writes: wherever it lands)
``row k``       as soon as round k's row appears in metrics.jsonl: the server has finished the round and
                is about to write (or writing) its checkpoint
``write k``     as soon as checkpoint.pt.tmp exists from round k on (the checkpoint is being written;
                polled every 0.5 ms, so a fast write can slip through: the table says what the kill found)
``ckpt k``      right after round k's checkpoint.pt has been renamed into place

Every resumed run must end with the reference's final weights (every array equal), metrics (times
left out) and final accuracies. Prints a Markdown table; exits 1 if any run differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from feddg.federation.checkpoint import CHECKPOINT, load_checkpoint

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def overrides(rounds: int, workers: int) -> list[str]:
    tiny = {"data.max_per_domain": 150, "partition.num_clients": 3, "federation.rounds": rounds,
            "model.name": "lenet", "split.target": "uci", "eval.every": 1, "federation.workers": workers}
    return [arg for k, v in tiny.items() for arg in ("-o", f"{k}={v}")]


def start(run_dir: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "feddg", *args], env=env, stdout=log, stderr=log)


def wait_for(proc: subprocess.Popen[bytes], ready: object, poll_s: float = 0.0005) -> bool:
    """Poll ``ready()`` until it is true (True) or the process has ended (False)."""
    while proc.poll() is None:
        if ready():  # type: ignore[operator]
            return True
        time.sleep(poll_s)
    return False


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def untimed(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows(run_dir)]


def checkpoint_changes(run_dir: Path, want: int) -> object:
    """A predicate: true once checkpoint.pt has been replaced ``want`` times."""
    seen: list[int] = []

    def ready() -> bool:
        try:
            ino = (run_dir / CHECKPOINT).stat().st_ino
        except FileNotFoundError:
            return False
        if not seen or seen[-1] != ino:
            seen.append(ino)
        return len(seen) >= want

    return ready


def same_run(run_dir: Path, ref: Path) -> bool:
    a, b = load_checkpoint(run_dir), load_checkpoint(ref)
    wa, wb = a["server_state"]["weights"], b["server_state"]["weights"]
    same_weights = wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wb)
    final = [json.loads((d / "results.json").read_text())["final"] for d in (run_dir, ref)]
    return same_weights and untimed(run_dir) == untimed(ref) and final[0] == final[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1, help="federation.workers (1: the sequential path)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--out", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="drill-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_args = ["run", str(CONFIG), *overrides(args.rounds, args.workers), "--quiet"]

    ref = out / "reference"
    t0 = time.perf_counter()
    proc = start(ref, [*run_args, "--run-dir", str(ref)], env)
    wait_for(proc, lambda: (ref / "config.yaml").is_file())
    t_dir = time.perf_counter()
    if proc.wait() != 0:
        sys.exit(f"the reference run failed: see {ref}.log")
    span = time.perf_counter() - t_dir
    print(f"reference: {time.perf_counter() - t0:.1f} s ({span:.1f} s after its run directory appeared)\n")

    rng = random.Random(args.seed)
    kinds = ["random", "row", "write", "ckpt"]
    table, failed = [], 0
    for i in range(args.runs):
        run_dir = out / f"run{i:02d}"
        kind, k = kinds[i % len(kinds)], rng.randint(1, args.rounds)
        proc = start(run_dir, [*run_args, "--run-dir", str(run_dir)], env)
        wait_for(proc, lambda d=run_dir: (d / "config.yaml").is_file())
        started = time.perf_counter()
        if kind == "random":
            delay = rng.uniform(0.0, 0.85 * span)
            moment = f"random {delay:.2f} s"
            hit = wait_for(proc, lambda s=started, d=delay: time.perf_counter() - s >= d)
        elif kind == "row":
            moment = f"row {k}"
            hit = wait_for(proc, lambda d=run_dir, n=k: len(rows(d)) >= n)
        elif kind == "write":
            moment = f"write {k}"
            tmp = run_dir / (CHECKPOINT + ".tmp")
            hit = wait_for(proc, lambda d=run_dir, n=k, t=tmp: t.exists() and len(rows(d)) >= n)
        else:
            moment = f"ckpt {k}"
            hit = wait_for(proc, checkpoint_changes(run_dir, k))
        if hit:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        at = time.perf_counter() - started
        done = len(rows(run_dir))
        tmp = (run_dir / (CHECKPOINT + ".tmp")).exists()
        ckpt = load_checkpoint(run_dir)
        saved = "none" if ckpt is None else ckpt["round"]
        t1 = time.perf_counter()
        resumed = subprocess.run([sys.executable, "-m", "feddg", "run", "--resume", str(run_dir), "--quiet"],
                                 env=env, capture_output=True, text=True, check=False)
        resume_s = time.perf_counter() - t1
        ok = resumed.returncode == 0 and same_run(run_dir, ref)
        failed += not ok
        state = f"{done} rows, checkpoint {saved}" + (", .tmp left" if tmp else "")
        table.append(f"| {i + 1} | {moment} | {at:.2f} | {'killed' if hit else 'had ended'} | {state} | "
                     f"{resume_s:.1f} | {'yes' if ok else 'NO: ' + resumed.stderr.strip()[-200:]} |")
        print(table[-1], flush=True)

    print("\n| run | kill moment | killed after (s) | process | at the kill | resume (s) | identical |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(table))
    print(f"\n{args.runs - failed} of {args.runs} resumed runs identical to the uninterrupted run ({out})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
