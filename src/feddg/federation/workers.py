"""Warm per-core worker processes for the in-process engine.

Each worker builds the same :class:`~feddg.federation.setup.Federation` from the config once
(dataset from the cache, model, method), runs with one torch thread, and then serves client
updates: ``(client_id, round, message, client_state) -> (reply, client_state)``. Only messages
cross the process boundary — the same contract as Flower — so a method that cheats (keeps
client results on ``self`` for the server half) fails here as it would on a real deployment.

Each client's randomness depends only on (seed, round, client), so results do not depend on
which worker ran a client; they differ from the sequential path only by floating-point
reduction order (one thread instead of several).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from feddg.config import ExperimentConfig
from feddg.federation.client import run_client
from feddg.federation.setup import Federation, build_federation
from feddg.messages import Message

_FED: Federation | None = None


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Make this worker exit when its parent dies (a SIGKILLed run must not leave orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _init_worker(cfg_tree: dict[str, Any]) -> None:
    global _FED
    exit_with_parent()
    torch.set_num_threads(1)
    cfg = ExperimentConfig.model_validate(cfg_tree)
    _FED = build_federation(cfg.model_copy(update={"device": "cpu"}))


def _client_task(client_id: int, round: int, msg: Message, state: Message) -> tuple[Message, Message]:
    assert _FED is not None, "worker not initialised"
    return run_client(_FED, client_id, round, msg, state)


def resolve_workers(requested: int | str) -> int:
    """``auto`` = one worker per core when there is more than one core, else sequential (0)."""
    if requested == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cores if cores > 1 else 0
    return int(requested) if int(requested) > 1 else 0


class WorkerPool:
    """A pool of spawned, warm client workers (context manager)."""

    def __init__(self, cfg: ExperimentConfig, workers: int) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=mp.get_context("spawn"),
            initializer=_init_worker,
            initargs=(cfg.model_dump(mode="json"),),
        )

    def run_clients(
        self, round: int, sent: dict[int, Message], states: dict[int, Message]
    ) -> dict[int, tuple[Message, Message]]:
        futures = {cid: self._pool.submit(_client_task, cid, round, msg, states.get(cid, {})) for cid, msg in sent.items()}
        return {cid: f.result() for cid, f in futures.items()}

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
