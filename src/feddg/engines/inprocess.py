"""The in-process engine: every client runs in this process on one shared model object.

Clients differ only by their index arrays and their small persistent state, so hundreds of
simulated clients cost data memory, not model copies.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from feddg.algorithms.base import Reply
from feddg.engines.workers import FederationFactory, WorkerPool, federation_threads, resolve_workers
from feddg.federation.client import run_client_setup, try_client
from feddg.federation.server import Server
from feddg.federation.setup import build_federation

RoundCallback = Callable[[dict[str, Any]], None]


def run_setup(server: Server) -> None:
    """The one-time setup exchange with *every* client, if the method asks for one."""
    request = server.setup_request()
    if request is None:
        server.mark_setup_done()
        return
    replies = []
    for cid in range(len(server.fed.clients)):
        reply, server.client_states[cid] = run_client_setup(server.fed, cid, request, server.client_states.get(cid, {}))
        replies.append(Reply(cid, reply))
    server.finish_setup(replies)


def run_round(server: Server, round: int, pool: WorkerPool | None = None) -> dict[str, Any]:
    """Configure, run each sampled client (sequentially, or on the worker pool), check and fold each reply in
    as it comes back (in the order sent, so the fold is the same on every engine), finish the round.

    A client that raises, times out, loses its worker or sends an unusable reply is dropped (the server
    logs it); the round completes if ``federation.min_clients`` replies are left, else :class:`RunStopped`."""
    t0 = time.perf_counter()
    fed = server.fed
    sent = server.configure(round)
    fold = server.start_round(sent)
    if pool is not None:
        outcomes = pool.run_clients(round, sent, server.client_states)
    else:
        outcomes = ((cid, try_client(fed, cid, round, msg, server.client_states.get(cid, {})))
                    for cid, msg in sent.items())
    for cid, out in outcomes:
        if out.reply is None:
            server.fail(fold, cid, out.error or "no reply")
        else:
            server.receive(fold, Reply(cid, out.reply), out.state)
    return server.finish_round(round, fold, {"time_train_s": time.perf_counter() - t0})


def run_inprocess(server: Server, on_round: RoundCallback | None = None, *,
                  factory: FederationFactory = build_federation) -> dict[str, Any]:
    """Run the remaining rounds of ``server`` and write results.json.

    ``factory`` rebuilds the Federation in each worker process (``federation.workers``); with
    ``federation.client_timeout_s`` clients always run in workers (one, where ``auto`` finds one core).
    On the CPU this process runs with ``federation.threads`` torch and BLAS threads (``auto``: one, as each worker),
    so that every worker count gives the same bits and no default spins under load."""
    importlib.import_module("torch._dynamo")  # the first optimiser imports it (seconds): the run's, not round 1's
    run_setup(server)
    fc, device = server.fed.cfg.federation, server.fed.device
    clients = server.fed.topology.num_clients
    workers = resolve_workers(fc.workers, device, clients) or (1 if fc.client_timeout_s is not None else 0)
    pool = WorkerPool(server.fed.cfg, workers, factory=factory, timeout_s=fc.client_timeout_s,
                      fed=server.fed) if workers else None
    with pool if pool is not None else nullcontext(), federation_threads(fc.threads, device):
        for r in range(server.round + 1, server.rounds + 1):
            row = run_round(server, r, pool)
            if on_round is not None:
                on_round(row)
    return server.write_results()
