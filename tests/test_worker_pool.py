"""The in-process engine's own logic, without training: the order clients start and are handed on in, deadlines, how a
dead worker is named, a worker that dies before it is ready, the pool a run starts (engines/workers.py, inprocess.py)."""

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from feddg.config import build_config
from feddg.engines import inprocess, workers
from feddg.engines.workers import WorkerPool, death
from feddg.federation.client import Outcome
from feddg.federation.validation import RunStopped


def bare_pool(n_workers: int) -> WorkerPool:
    """A pool whose workers are plain records (no processes): for the scheduling in ``run_clients``."""
    pool = WorkerPool.__new__(WorkerPool)
    pool.workers = [SimpleNamespace(ready=True, client=None) for _ in range(n_workers)]
    return pool


def test_a_dead_worker_is_named_by_its_signal_or_its_exit_code():
    assert death(-9) == "its worker process died (SIGKILL)"
    assert death(-200) == "its worker process died (signal 200)"  # no such signal
    assert death(0) == "its worker process died (exit code 0)"  # not "signal 0"
    assert death(3) == "its worker process died (exit code 3)"
    assert death(None) == "its worker process died (exit code None)"


def test_clients_start_in_the_order_sent_and_each_outcome_is_handed_on_at_its_turn():
    """With two workers, five clients start in the order sent and the pool never holds more outcomes than it has
    workers (a round streams its replies: the first client's is not kept waiting behind the last one's)."""
    pool, started, held = bare_pool(2), [], []

    def start(w, cid, round, msg, state, done):
        started.append(cid)
        w.client = cid

    def wait(done):  # the busy worker that started first finishes
        w = min((w for w in pool.workers if w.client is not None), key=lambda w: started.index(w.client))
        done[w.client], w.client = Outcome(reply={"client": w.client}), None
        held.append(len(done))

    pool._start, pool._wait = start, wait
    sent = {3: {}, 1: {}, 4: {}, 0: {}, 2: {}}
    assert [(cid, out.reply["client"]) for cid, out in pool.run_clients(1, sent, {})] == [(c, c) for c in sent]
    assert started == list(sent)
    assert max(held) == 1  # each outcome is yielded before the next worker finishes


def test_a_client_s_deadline_is_its_start_plus_the_timeout(monkeypatch):
    w = workers._Worker.__new__(workers._Worker)
    w.conn = SimpleNamespace(send=lambda task: None)
    monkeypatch.setattr(workers.time, "monotonic", lambda: 100.0)
    w.start(7, 1, {}, {}, 2.5, limit=123)
    assert (w.client, w.deadline, w.limit) == (7, 102.5, 123)
    w.start(8, 1, {}, {}, None, limit=123)
    assert w.deadline == float("inf")


def test_a_broken_pipe_is_the_worker_s_death_not_a_refused_reply():
    """``recv_bytes`` raising any OSError but "bad message length" (a reply over the bound) means the worker died."""
    def refuse(limit):
        raise OSError("Connection reset by peer")

    w = SimpleNamespace(conn=SimpleNamespace(poll=lambda: True, recv_bytes=refuse), limit=1,
                        proc=SimpleNamespace(join=lambda timeout=None: None, exitcode=-9, is_alive=lambda: False))
    pool, reasons = bare_pool(0), []
    pool._replace = lambda worker, done, reason: reasons.append((worker, reason))
    pool._handle(w, {})
    assert reasons == [(w, "its worker process died (SIGKILL)")]


def test_a_worker_that_dies_before_it_is_ready_stops_the_run_instead_of_being_replaced(monkeypatch):
    """A forked worker exits while it sets up (here: at once, code 3): the run stops in one line; replacing it would
    start the same death again and again."""
    monkeypatch.setattr(workers, "use_one_thread", lambda: os._exit(3))  # inherited by the fork
    spawned: list[int] = []
    spawn = workers._Worker.__init__

    def counted(self, *args):
        spawned.append(1)
        if len(spawned) > 3:
            raise AssertionError("the pool keeps replacing a worker that dies before it is ready")
        spawn(self, *args)

    monkeypatch.setattr(workers._Worker, "__init__", counted)
    fed = SimpleNamespace(device=torch.device("cpu"), model=nn.Linear(2, 1))
    with pytest.raises(RunStopped, match=r"^a client worker died while building the federation: worker process "
                                         r"died \(exit code 3\)$"), WorkerPool(build_config({}), 1, fed=fed) as pool:
        list(pool.run_clients(1, {0: {}}, {}))
    assert len(spawned) == 1


def fake_server(workers: int | str, client_timeout_s: float | None, clients: int) -> SimpleNamespace:
    """What ``run_inprocess`` reads of a server that has no round left to run."""
    federation = SimpleNamespace(workers=workers, client_timeout_s=client_timeout_s, threads="auto")
    fed = SimpleNamespace(cfg=SimpleNamespace(federation=federation), device=torch.device("cpu"),
                          topology=SimpleNamespace(num_clients=clients))
    return SimpleNamespace(fed=fed, round=0, rounds=0, setup_request=lambda: None, mark_setup_done=lambda: None,
                           write_results=lambda: {})


@pytest.mark.parametrize(("asked", "timeout", "cores", "pool"), [
    ("auto", 5.0, 1, 1),  # one core, but a timeout can only be kept in a worker: one worker
    ("auto", None, 1, None),  # one core, no timeout: the sequential path
    ("auto", None, 4, 3),  # a worker per core, at most one per client
    (2, 5.0, 4, 2),
])
def test_the_in_process_engine_starts_the_pool_the_timeout_and_the_cores_call_for(monkeypatch, asked, timeout,
                                                                                   cores, pool):
    made = []

    class Pool:
        def __init__(self, cfg, n, **kw):
            made.append((n, kw["timeout_s"]))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(inprocess, "WorkerPool", Pool)
    monkeypatch.setattr(workers, "usable_cores", lambda: cores)
    inprocess.run_inprocess(fake_server(asked, timeout, clients=3))
    assert made == ([] if pool is None else [(pool, timeout)])


def test_a_round_s_training_time_is_the_clock_from_configure_to_the_last_reply(monkeypatch):
    ticks = iter([10.0, 12.5])
    monkeypatch.setattr(inprocess.time, "perf_counter", lambda: next(ticks))
    server = SimpleNamespace(fed=None, configure=lambda r: {}, start_round=lambda sent: "fold",
                             finish_round=lambda r, fold, extra: {"round": r, "fold": fold, **extra})
    assert inprocess.run_round(server, 4) == {"round": 4, "fold": "fold", "time_train_s": 2.5}
