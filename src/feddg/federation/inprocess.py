"""The in-process engine: every client runs in this process on one shared model object.

Clients differ only by their index arrays and their small persistent state, so hundreds of
simulated clients cost data memory, not model copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from feddg.algorithms import Reply
from feddg.federation.client import run_client, run_client_setup
from feddg.federation.server import Server
from feddg.federation.workers import WorkerPool, resolve_workers

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
    """Configure, run each sampled client (sequentially, or on the worker pool), aggregate."""
    t0 = time.perf_counter()
    sent = server.configure(round)
    if pool is not None:
        results = pool.run_clients(round, sent, server.client_states)
    else:
        results = {
            cid: run_client(server.fed, cid, round, msg, server.client_states.get(cid, {})) for cid, msg in sent.items()
        }
    replies = []
    for cid, (reply, state) in results.items():
        server.client_states[cid] = state
        replies.append(Reply(cid, reply))
    return server.finish_round(round, sent, replies, {"time_train_s": time.perf_counter() - t0})


def run_inprocess(server: Server, on_round: RoundCallback | None = None) -> dict[str, Any]:
    """Run the remaining rounds of ``server`` and write results.json."""
    run_setup(server)
    workers = resolve_workers(server.fed.cfg.federation.workers)
    with WorkerPool(server.fed.cfg, workers) if workers else nullcontext() as pool:
        for r in range(server.round + 1, server.rounds + 1):
            row = run_round(server, r, pool)
            if on_round is not None:
                on_round(row)
    return server.write_results()
