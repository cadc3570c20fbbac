"""Server memory of per-client state: Local-only with the client store at several RAM budgets.

Local-only keeps two models per client on the server — the client's own state (``Server.client_states``) and
the copy it evaluates (``state["clients"]``) — so without a budget its memory grows with the client count.
Synthetic replies (no training) go through the server half as ``Server`` drives it: rounds of
:data:`PER_ROUND` clients, each reply folded in and its model written to both stores, then the personalised
evaluation reads every client's model and the global diagnostic averages them. Measured: the store's own RAM
bytes, the tracemalloc peak and what stays allocated, and the process's peak RSS (Linux ``VmHWM``, reset
before each run, in a forked process per row), all above what was allocated before it; the bytes spilled.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table
from torch import nn

from feddg.algorithms.base import Method, Reply, ServerContext, ServerState
from feddg.algorithms.registry import create_method
from feddg.bench.memory import examples, model_bytes, reset_peak_rss, rss_mb, synthetic_reply
from feddg.engines.workers import can_fork
from feddg.federation.client_store import STORE_DIR, ClientStore, ClientStores
from feddg.messages import WEIGHT_PREFIX, Message, entries, weights_of

PER_ROUND = 20


def _round(method: Method, state: ServerState, client_states: ClientStore, template: Message,
           sampled: range) -> ServerState:
    """One round's fold of synthetic replies (the replies are dropped with it, as the server drops them)."""
    acc = method.start(examples(len(sampled)))
    for k in sampled:
        reply = synthetic_reply(template, k)
        own: Message = {key: np.array(v) for key, v in entries(reply, WEIGHT_PREFIX).items()}  # a copy, as from a worker
        client_states[k] = own  # Local-only's client state is the client's own model
        acc = method.accumulate(acc, Reply(k, reply))
    return method.finish(state, acc)[0]


def local_only_server(n_clients: int, params: int, budget_mb: float | None, root: Path) -> dict[str, Any]:
    """Every client replies once (rounds of :data:`PER_ROUND`), then every client is evaluated; the figures."""
    side = max(1, int(math.sqrt(params)))
    model = nn.Linear(side, side)  # ≈ params float32 parameters
    stores = ClientStores(root / STORE_DIR, None if budget_mb is None else int(budget_mb * 2**20))
    method = create_method("local")
    template = weights_of(model)
    rss0, was_tracing = rss_mb("VmRSS"), tracemalloc.is_tracing()
    reset_peak_rss()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    state = method.server_init(model, ServerContext(n_clients, 1, 0, stores.open))
    client_states = stores.open("client_states")
    for first in range(0, n_clients, PER_ROUND):
        state = _round(method, state, client_states, template, range(first, min(first + PER_ROUND, n_clients)))
    for k in range(n_clients):
        method.eval_weights(state, k)
    method.eval_weights(state, None)
    seconds = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    if not was_tracing:
        tracemalloc.stop()
    disk = sum(p.stat().st_size for p in (root / STORE_DIR).glob("*.npy"))
    return {"clients": n_clients, "budget_mb": budget_mb, "model_mb": model_bytes(template) / 2**20,
            "store_ram_mb": stores.ram_bytes / 2**20, "traced_peak_mb": (peak - base) / 2**20,
            "traced_kept_mb": (current - base) / 2**20, "peak_rss_mb": rss_mb("VmHWM") - rss0,
            "disk_mb": disk / 2**20, "seconds": seconds}


def _row(n_clients: int, params: int, budget_mb: float | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return local_only_server(n_clients, params, budget_mb, Path(tmp))


def store_memory_table(clients: list[int], params: int, budgets: list[float | None]) -> list[dict[str, Any]]:
    """One row per (client count, budget), each in a scratch directory and, where fork exists, in a forked
    process of its own (peak RSS is per process, and memory freed by an earlier row would hide a later one's)."""
    rows = []
    for n in clients:
        for budget in budgets:
            if not can_fork():
                rows.append(_row(n, params, budget))
                continue
            with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
                rows.append(pool.submit(_row, n, params, budget).result())
    return rows


def store_memory_report(clients: list[int], params: int, budgets: list[float | None]) -> Iterator[Table | str]:
    """``feddg bench memory --per-client``, each line or table as soon as it is measured: the load average, the
    rows of :func:`store_memory_table`, the load average."""
    from feddg.bench.w1 import load_average

    yield f"load average before: {load_average()}"
    t = Table(title=f"Local-only server, {params:,}-parameter model, rounds of {PER_ROUND} clients then every client "
              "evaluated: MiB above the start")
    for col in ("clients", "budget", "store RAM", "traced peak", "traced kept", "peak RSS", "disk", "s"):
        t.add_column(col, justify="right")
    for r in store_memory_table(clients, params, budgets):
        t.add_row(f"{r['clients']:,}", "unlimited" if r["budget_mb"] is None else f"{r['budget_mb']:g}",
                  *(f"{r[k]:,.1f}" for k in ("store_ram_mb", "traced_peak_mb", "traced_kept_mb", "peak_rss_mb",
                                             "disk_mb", "seconds")))
    yield t
    yield f"load average after: {load_average()}"
