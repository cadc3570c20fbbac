"""The warm ClientApp executor of a SuperNode started with ``--isolation process`` (see docs/flower.md).

    flower-supernode --root-certificates ca.pem --isolation process --host 127.0.0.1 --port 9094 \
        --ssl-certfile server.pem --ssl-keyfile server.key --ssl-ca-certfile ca.pem ... &
    python -m feddg.engines.flower.executor --runtime-api-address 127.0.0.1:9094 --root-certificates ca.pem \
        --parent-pid $! &

(``--insecure`` instead of ``--root-certificates``: plain HTTP to the Runtime API, with a warning.)

It keeps one warm worker (:mod:`feddg.engines.flower.worker`) running the node's ClientApp tasks and
starts another if that one dies (a client killed by the OOM killer, a crash in native code), as Flower
would start a fresh process for the node's next message; it ends with the SuperNode (``--parent-pid``)
or on SIGTERM/SIGINT. This process imports only the standard library.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

WORKER = "feddg.engines.flower.worker"
#: a worker that lived this long before dying is restarted at once; one that died sooner waits longer each time
HEALTHY_S = 60.0


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs; an exited one its parent has not reaped yet (a zombie, Linux) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: the signal test is all there is
    return stat[stat.rindex(")") + 2] != "Z"


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def supervise(worker_args: list[str], parent_pid: int | None) -> None:
    """Run ``python -m feddg.engines.flower.worker *worker_args`` until ``parent_pid`` ends; restart it when it dies."""
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    pause, child = 1.0, None
    try:
        while parent_pid is None or alive(parent_pid):
            started = time.monotonic()
            child = subprocess.Popen([sys.executable, "-m", WORKER, *worker_args, "--parent-pid", str(os.getpid())])
            while child.poll() is None:
                if parent_pid is not None and not alive(parent_pid):
                    return
                time.sleep(0.5)
            pause = 1.0 if time.monotonic() - started > HEALTHY_S else min(2 * pause, 60.0)
            print(f"feddg executor: the worker exited with {child.returncode}; another starts in {pause:g} s",
                  file=sys.stderr, flush=True)
            wake = time.monotonic() + pause
            while time.monotonic() < wake and (parent_pid is None or alive(parent_pid)):
                time.sleep(0.5)
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


INSECURE_WARNING = ("feddg executor: warning: --insecure: the Runtime API is plain HTTP (messages, the node's "
                    "Context); use it on loopback only, or pass --root-certificates CA.pem")


def tls_args(root_certificates: str | None, insecure: bool) -> list[str]:
    """The worker's TLS arguments; ``insecure`` (plain HTTP) only when asked for, with a warning."""
    if insecure:
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
        return ["--insecure"]
    if root_certificates is None or not Path(root_certificates).is_file():
        raise SystemExit(f"feddg executor: --root-certificates {root_certificates}: no such file (or pass --insecure)")
    return ["--root-certificates", str(Path(root_certificates).resolve())]


def main() -> None:
    ap = argparse.ArgumentParser(description="run a SuperNode's ClientApps in one warm, supervised process")
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's --host:--port (loopback)")
    ap.add_argument("--poll-interval", type=float, default=0.1, help="seconds between task polls when idle")
    ap.add_argument("--parent-pid", type=int, help="the SuperNode's pid: end with it")
    tls = ap.add_mutually_exclusive_group(required=True)
    tls.add_argument("--root-certificates", help="CA certificate (PEM) of the SuperNode's Runtime API TLS")
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (warns; loopback only)")
    args = ap.parse_args()
    if args.parent_pid is not None and (args.parent_pid <= 0 or not alive(args.parent_pid)):
        raise SystemExit(f"feddg executor: --parent-pid {args.parent_pid}: no such process (the SuperNode's pid, "
                         "e.g. $! right after starting it)")
    supervise(["--runtime-api-address", args.runtime_api_address, "--poll-interval", str(args.poll_interval),
               *tls_args(args.root_certificates, args.insecure)], args.parent_pid)


if __name__ == "__main__":
    main()
