"""Warm per-core worker processes for the in-process engine, that survive their clients.

Each worker is forked from the server process with its :class:`~feddg.federation.setup.Federation`
(dataset shared copy-on-write; on a CUDA run or without fork it is spawned and builds the same federation
from the config once), runs with one torch thread and one BLAS thread (:func:`use_one_thread`), and then serves client
updates over its own pipe: ``(client_id, round, message, client_state) -> Outcome``. Only messages
cross the process boundary — the same contract as Flower — so a method that cheats (keeps
client results on ``self`` for the server half) fails here as it would on a real deployment.

Faults stay with their client: an exception in a client update comes back as a failed
:class:`~feddg.federation.client.Outcome`; a worker that dies (the OS killed it, a crash in native
code) or runs a client past ``federation.client_timeout_s`` (it is SIGKILLed) fails that client and
is replaced by a fresh worker, so the pool keeps its size.

A reply is bounded before it is read (:func:`reply_limit`): ``Connection.recv_bytes(maxlength)`` reads the
length header and refuses a longer message without reading its body; that client fails and its worker (blocked
on the unread pipe) is replaced.

Each client's randomness depends only on (seed, round, client), so results do not depend on
which worker ran a client; they differ from the sequential path only by floating-point
reduction order (one thread instead of several).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Self

import torch
from threadpoolctl import threadpool_limits

from feddg.config import ExperimentConfig, config_tree
from feddg.federation.client import Outcome, describe, try_client
from feddg.federation.setup import Federation, build_federation, worker_device
from feddg.federation.validation import RunStopped
from feddg.messages import Message, message_nbytes

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, SpawnContext  # ForkContext: POSIX only

FederationFactory = Callable[[ExperimentConfig], Federation]

REPLY_MARGIN = 4  # a reply may be the model, a new client state of the same size, and payloads of that order
REPLY_SLACK = 64 * 2**20  # pickling overhead and method payloads beyond the model (a Gram matrix, statistics)


def reply_limit(model_bytes: int, msg: Message, state: Message, max_reply_mb: float | None) -> int:
    """The most bytes a worker's reply to ``(msg, state)`` may take (docs/reliability.md, "Message size"):
    ``federation.max_reply_mb`` where set, else ``REPLY_MARGIN × (model + message sent + client state) +
    REPLY_SLACK``."""
    if max_reply_mb is not None:
        return int(max_reply_mb * 2**20)
    return REPLY_MARGIN * (model_bytes + message_nbytes(msg) + message_nbytes(state)) + REPLY_SLACK


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Make this worker exit when its parent dies (a SIGKILLed run must not leave orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _serve(conn: Connection, factory: FederationFactory, cfg_tree: dict[str, Any], fed: Federation | None) -> None:
    """A worker's life: build the federation (unless it came with a fork), say ``ready``, then run client
    updates until told to stop."""
    exit_with_parent()
    use_one_thread()
    try:
        if fed is None:
            cfg = ExperimentConfig.model_validate(cfg_tree)
            fed = factory(cfg)  # on its own device: the pool sets cfg.device per worker
        importlib.import_module("torch._dynamo")  # an optimiser's first step imports it (seconds): not a client's time
    except Exception as err:
        conn.send(("init-error", describe(err)))
        return
    conn.send(("ready",))
    while (task := conn.recv()) is not None:
        client_id, round, msg, state = task
        conn.send(("done", client_id, try_client(fed, client_id, round, msg, state)))


def can_fork() -> bool:
    """Fork is available (POSIX) and safe: CUDA cannot be used across a fork, so not once it is initialised."""
    return "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_workers(requested: int | str, device: torch.device, clients: int | None = None) -> int:
    """Worker processes for the clients; 0 = the sequential path. ``auto``: one per core on the CPU, one per
    GPU on CUDA (a GPU is fed best by one process; ``cuda:k`` is one GPU), at most ``clients`` (an idle worker
    only costs its start), sequential where that is one."""
    if requested == "auto":
        if device.type == "cuda":
            n = 1 if device.index is not None else torch.cuda.device_count()
        else:
            n = usable_cores()
        n = n if clients is None else min(n, clients)
        return n if n > 1 else 0
    return int(requested) if int(requested) > 1 else 0


@contextmanager
def compute_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch threads and ``count`` BLAS threads for numpy and SciPy (both restored after).

    OpenBLAS, numpy's BLAS, keeps a thread pool of its own whose threads spin after each call: in a 2-worker W1 run
    the server's update norms (``np.dot``) kept one spinning beside the workers, 0.8–0.9 of the server's 1.2–1.5
    CPU seconds; with one BLAS thread the server took 0.16 s and the run 10.4 instead of 11.1 s (docs/benchmarks.md,
    "W1: workers").
    """
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with threadpool_limits(count, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before)


def use_one_thread() -> None:
    """For the rest of this process (a worker, a sweep's job): one torch thread and one BLAS thread."""
    torch.set_num_threads(1)
    threadpool_limits(1, user_api="blas")


def federation_threads(requested: int | str, device: torch.device) -> AbstractContextManager[None]:
    """The block under ``federation.threads`` (``requested``): :func:`compute_threads` of it on the CPU (``auto`` = 1),
    as the server process and a Flower SuperNode's clients compute; as it is on a GPU (a CUDA run computes there)."""
    if device.type != "cpu":
        return nullcontext()
    return compute_threads(1 if requested == "auto" else int(requested))


def death(exitcode: int | None) -> str:
    """How a worker process ended, for the failed client's reason."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"its worker process died ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"its worker process died (signal {-exitcode})"
    return f"its worker process died (exit code {exitcode})"


class _Worker:
    """One worker process, its pipe, and the client it is running (if any)."""

    def __init__(self, factory: FederationFactory, cfg_tree: dict[str, Any], fed: Federation | None) -> None:
        ctx: SpawnContext | ForkContext = mp.get_context("spawn") if fed is None else mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, factory, cfg_tree, fed), name="feddg-client-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.client: int | None = None
        self.deadline = float("inf")
        self.limit = REPLY_SLACK  # the longest message read from it: its client's reply_limit while it runs one

    def start(self, client_id: int, round: int, msg: Message, state: Message, timeout_s: float | None,
              limit: int) -> None:
        self.client, self.limit = client_id, limit
        self.deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
        self.conn.send((client_id, round, msg, state))

    def kill(self) -> None:
        if self.conn.closed:  # killed already
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.proc.close()
        self.conn.close()


class WorkerPool:
    """A fixed-size pool of warm client workers (context manager).

    With ``fed`` (a CPU federation) and fork available, each worker is forked from this process and uses
    ``fed`` as it is: no import, no rebuild, the dataset shared copy-on-write. Otherwise workers are
    spawned and ``factory`` rebuilds the Federation from the config in each (tests pass a toy one; it must
    be importable by module path). ``timeout_s``: the longest a client update may run.
    """

    def __init__(self, cfg: ExperimentConfig, workers: int, *, factory: FederationFactory = build_federation,
                 timeout_s: float | None = None, fed: Federation | None = None) -> None:
        inherit = fed if fed is not None and fed.device.type == "cpu" and can_fork() else None
        if inherit is not None:
            importlib.import_module("torch._dynamo")  # once here, inherited by every fork, not once per worker
        tree = config_tree(cfg)
        # worker i on GPU i mod count when CUDA is asked for (round-robin), else the CPU
        self._spawn = lambda i: _Worker(factory, {**tree, "device": worker_device(cfg.device, i)}, inherit)
        self.timeout_s = timeout_s
        self.max_reply_mb = cfg.federation.max_reply_mb
        self.model_bytes = 0 if fed is None else sum(t.nbytes for t in fed.model.state_dict().values())
        self.workers = [self._spawn(i) for i in range(workers)]

    def run_clients(self, round: int, sent: dict[int, Message], states: Mapping[int, Message]
                    ) -> Iterator[tuple[int, Outcome]]:
        """Each sampled client's outcome, in the order sent (an outcome is dropped once yielded)."""
        order, todo = list(sent), list(sent)
        done: dict[int, Outcome] = {}
        for cid in order:
            while cid not in done:
                for w in self.workers:
                    if w.ready and w.client is None and todo:
                        nxt = todo.pop(0)
                        self._start(w, nxt, round, sent[nxt], states.get(nxt, {}), done)
                self._wait(done)
            yield cid, done.pop(cid)

    def _start(self, w: _Worker, cid: int, round: int, msg: Message, state: Message, done: dict[int, Outcome]
               ) -> None:
        try:
            w.start(cid, round, msg, state, self.timeout_s,
                    reply_limit(self.model_bytes, msg, state, self.max_reply_mb))
        except OSError:  # the worker died since its last message: the pipe is broken
            self._replace(w, done, death(w.proc.exitcode))

    def _wait(self, done: dict[int, Outcome]) -> None:
        """Wait for a message, a worker's death or the nearest deadline, and handle it."""
        busy = [w.deadline for w in self.workers if w.client is not None]
        timeout = max(0.0, min(busy) - time.monotonic()) if busy and min(busy) < float("inf") else None
        by_handle: dict[Any, _Worker] = {}
        for w in self.workers:
            by_handle[w.conn] = by_handle[w.proc.sentinel] = w
        for w in {id(by_handle[h]): by_handle[h] for h in wait(list(by_handle), timeout)}.values():
            self._handle(w, done)
        now = time.monotonic()
        for w in list(self.workers):
            if w.client is not None and now >= w.deadline:
                self._replace(w, done, f"timed out after {self.timeout_s:g} s (federation.client_timeout_s)")

    def _handle(self, w: _Worker, done: dict[int, Outcome]) -> None:
        """Read what worker ``w`` sent; a closed pipe means it died."""
        try:
            while w.conn.poll():
                try:
                    msg = ForkingPickler.loads(w.conn.recv_bytes(w.limit))
                except OSError as err:
                    if str(err) != "bad message length":
                        raise
                    self._replace(w, done, f"reply longer than {w.limit / 2**20:.1f} MiB, refused unread "
                                  "(federation.max_reply_mb)")
                    return
                if msg[0] == "ready":
                    w.ready = True
                elif msg[0] == "done":
                    done[msg[1]] = msg[2]
                    w.client = None
                else:
                    raise RunStopped(f"a client worker could not build the federation: {msg[1]}")
        except (EOFError, OSError):  # the pipe closed: the worker is exiting
            w.proc.join(5.0)
            self._replace(w, done, death(w.proc.exitcode))
            return
        if not w.proc.is_alive():
            w.proc.join()
            self._replace(w, done, death(w.proc.exitcode))

    def _replace(self, w: _Worker, done: dict[int, Outcome], reason: str) -> None:
        """Kill ``w``, fail its client with ``reason`` and start a fresh worker in its place."""
        w.kill()
        if not w.ready:
            raise RunStopped(f"a client worker died while building the federation: {reason.removeprefix('its ')}")
        if w.client is not None:
            done[w.client] = Outcome(error=reason)
        i = self.workers.index(w)
        self.workers[i] = self._spawn(i)

    def close(self) -> None:
        """Stop every worker: idle ones are asked to exit, busy ones are killed."""
        live = [w for w in self.workers if not w.conn.closed]
        for w in live:
            if w.client is None and w.proc.is_alive():
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 10.0
        for w in live:
            w.proc.join(max(0.0, deadline - time.monotonic()) if w.client is None else 0)
            w.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
