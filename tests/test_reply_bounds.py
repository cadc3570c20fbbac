"""Issue 27: a worker's reply is bounded before it is read into memory (docs/reliability.md, "Message size"):
``Connection.recv_bytes(maxlength)`` refuses a longer message from its length header; the client fails in one
line, its worker is replaced, and the round goes on with the others."""

import importlib
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest

from feddg.config import build_config
from feddg.engines.inprocess import run_round
from feddg.engines.workers import REPLY_SLACK, WorkerPool, reply_limit
from feddg.federation.server import Server

BASE = {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
        "federation": {"rounds": 2, "batch_size": 16, "workers": 2}, "optim": {"lr": 0.1}, "device": "cpu"}


@pytest.fixture
def faulty() -> Iterator[ModuleType]:
    module = importlib.import_module("support.faults")
    with module.registered():
        yield module


def test_the_bound_is_a_margin_over_the_model_the_message_and_the_state_or_the_override():
    msg = {"w/a": np.zeros(10, np.float32), "lr": 0.1}  # 40 + 3 bytes, 8 + 2
    state = {"s": np.zeros(4, np.float64)}  # 32 + 1
    assert reply_limit(1000, msg, state, None) == 4 * (1000 + 43 + 10 + 33) + 64 * 2**20
    assert reply_limit(1000, msg, state, 0.5) == 2**19


@pytest.mark.parametrize(("blob_mb", "override"), [(100.0, None), (2.0, "federation.max_reply_mb=1")])
def test_an_oversized_reply_is_refused_unread_and_the_round_goes_on(tmp_path, faulty, blob_mb, override):
    """The issue's 100 MB array under the default bound (64 MiB + 4 x a toy model), and 2 MB under an override."""
    overrides = [override] if override else []
    cfg = build_config({**BASE, "method": {"name": "faulty", "params": {"faults": {"1:2": "oversized"},
                                                                         "blob_mb": blob_mb}}}, overrides)
    server = Server(faulty.toy_federation_of(cfg), tmp_path / "run")
    server.mark_setup_done()
    with WorkerPool(cfg, 2, factory=faulty.toy_federation_of, fed=server.fed) as pool:
        limit = pool.workers[0].limit
        row = run_round(server, 1, pool)
        run_round(server, 2, pool)
        assert len(pool.workers) == 2 and all(w.proc.is_alive() for w in pool.workers)
    bound = 1.0 if override else reply_limit(pool.model_bytes, server.configure(1)[2], {}, None) / 2**20
    assert pool.model_bytes == sum(t.nbytes for t in server.fed.model.state_dict().values()) > 0
    assert limit == REPLY_SLACK
    assert row["clients"] == 3 and row["clients_failed_reasons"] == {
        "2": f"reply longer than {bound:.1f} MiB, refused unread (federation.max_reply_mb)"}
    assert "clients_failed" not in server.metrics[1]  # the replaced worker serves round 2
