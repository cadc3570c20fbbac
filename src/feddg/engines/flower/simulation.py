"""The Flower simulation engine: the same Server and client half, moved by Flower's Message API.

``run_flower(server)`` starts Flower's Simulation Runtime (Ray, on 127.0.0.1 only) with one
virtual SuperNode per client (partition-id k is client k). The ServerApp runs in
a thread of this process and drives ``server`` itself, so metrics.jsonl, checkpoint.pt and
results.json land in the run directory exactly as with the in-process engine; the clients' state lands in its
``node-state/`` (what a deployed node keeps in its ``state-dir``), so ``--resume`` continues with it. Each Ray actor
rebuilds the Federation from the experiment's YAML text (see ``flower_client``).

For a real deployment (SuperLink + SuperNodes) see ``flower_app`` and docs/flower.md.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray._private.ray_constants as ray_constants
import ray._private.utils as ray_utils
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation
from flwr.supercore.logger import update_console_handler

from feddg.config import ROSTER_NEEDS_DEPLOYMENT, dump_config
from feddg.engines.flower.client import FederationFactory, client_federation, make_client_app
from feddg.engines.flower.server import PollingGrid, RoundCallback, run_on_grid
from feddg.federation.server import NODE_STATE, Server
from feddg.federation.validation import RunStopped

LOOPBACK = "127.0.0.1"
VERBOSE = "FEDDG_VERBOSE"  # "1": Flower's and Ray's own INFO logs (``feddg --verbose``); else warnings only
PLAIN = "FEDDG_PLAIN_LOGS"  # "1": Flower's log lines without colour codes (set when stderr is not a terminal)


def verbose() -> bool:
    return os.environ.get(VERBOSE) == "1"


class _NotRunSimulationDeprecation(logging.Filter):
    """feddg drives the Simulation Runtime through ``run_simulation`` on purpose: its deprecation notice, printed on
    every run, is not the user's to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation" not in record.getMessage()


def plain_logs() -> None:
    """Flower's and Ray's log lines without colour codes where stderr is redirected (a file, CI), here and in the
    ClientApp actors (which read ``FEDDG_PLAIN_LOGS``)."""
    if sys.stderr.isatty():
        return
    os.environ[PLAIN] = "1"
    os.environ["RAY_COLOR_PREFIX"] = "0"
    update_console_handler(colored=False)


def backend_config(server: Server) -> dict[str, Any]:
    """Ray settings: loopback only, no dashboard, Ray's logs at warning level unless verbose, client
    resources from ``flower.*``."""
    fc = server.fed.cfg.flower
    init_args: dict[str, Any] = {"_node_ip_address": LOOPBACK, "include_dashboard": False,
                                 "logging_level": logging.INFO if verbose() else logging.WARNING}
    if fc.ray_num_cpus is not None:
        init_args["num_cpus"] = fc.ray_num_cpus
    return {
        "init_args": init_args,
        "client_resources": {"num_cpus": fc.client_num_cpus, "num_gpus": fc.client_num_gpus},
    }


@contextmanager
def deferred_stop_signals(interrupted: threading.Event) -> Iterator[list[int]]:
    """In the block, SIGINT and SIGTERM set ``interrupted`` (the ServerApp's thread stops at its next poll, and the
    simulation ends as a finished one would) and are listed, for the caller to raise again after the block; a second
    one raises KeyboardInterrupt at once. Raised in the main thread, Flower's run_simulation answered a signal by
    shutting Ray down under its worker threads' pending ``ray.get``: the process then hung, or Ray's core worker ended
    it before feddg's line. Ray's own SIGTERM handlers stay off meanwhile: ``ray.init`` would install
    ``sys.exit(15)`` (``ray._private.utils.set_sigterm_handler``) and its core worker a stack dump that aborts the
    process (``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when the driver connects). Outside the main thread
    (a library caller's worker thread) signals are left alone."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def defer(sig: int, frame: object) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(sig)
        interrupted.set()

    previous = {s: signal.signal(s, defer) for s in (signal.SIGINT, signal.SIGTERM)}
    install, dump = ray_utils.set_sigterm_handler, ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_utils.set_sigterm_handler = lambda handler: None
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True  # the driver's only: the actors keep their crash dumps
    try:
        yield received
    finally:
        ray_utils.set_sigterm_handler, ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = install, dump
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_flower(
    server: Server, on_round: RoundCallback | None = None, *, factory: FederationFactory = client_federation
) -> dict[str, Any]:
    """Run the remaining rounds of ``server`` on Flower's simulation engine; returns results.json's content.

    ``factory`` rebuilds the Federation from the config inside each ClientApp (tests pass a toy one).
    """
    if server.fed.cfg.flower.roster:
        raise ValueError(ROSTER_NEEDS_DEPLOYMENT)
    results: dict[str, Any] = {}
    stopped: list[RunStopped] = []
    interrupted = threading.Event()
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            results.update(run_on_grid(server, PollingGrid(grid, stop=interrupted), on_round))
        except RunStopped as err:  # raised again below, outside Flower's thread
            stopped.append(err)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's future default; silences its notice
    cfg = server.fed.cfg
    flwr_log = logging.getLogger("flwr")
    flwr_log.setLevel(logging.INFO if verbose() else logging.WARNING)  # keeps the progress bar readable
    if not any(isinstance(f, _NotRunSimulationDeprecation) for f in flwr_log.filters):
        flwr_log.addFilter(_NotRunSimulationDeprecation())
    plain_logs()
    with deferred_stop_signals(interrupted) as received:
        try:
            run_simulation(
                server_app=server_app,
                client_app=make_client_app(dump_config(cfg), factory, state_dir=server.run_dir / NODE_STATE,
                                           quiet=not verbose()),
                num_supernodes=len(server.fed.clients),
                backend_config=backend_config(server),
                verbose_logging=verbose(),
            )
        except BaseException:  # a second signal: the ServerApp's thread stops at its next poll, the process can end
            interrupted.set()
            raise
    if received and not results:  # the simulation ended as a finished one would: now the caller's handler
        signal.raise_signal(received[0])  # (feddg run's: one line, exit 130 or 143)
    if stopped:
        raise stopped[0]
    if not results:
        raise RuntimeError("the Flower ServerApp ended without results (see the log above)")
    return results
