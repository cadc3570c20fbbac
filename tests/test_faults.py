"""Fault-tolerant rounds (issue 12): a client that raises, returns NaN, hangs, loses its worker or sends an
outlier is dropped and logged, and the run ends as a run without that client in those rounds would.

The faulty runs and their references differ in one way only: the reference's server never sends to the
dropped clients. Its fold is normalised by the example total of the clients it sampled; the faulty run's
by the total it expected, rescaled by ``expected / arrived`` at the end (``WeightedSum.mean``) — the same
sum with one more float64 multiplication, so the weights agree to rounding, not bit for bit. With
``reject_outliers`` the replies are held and folded at the round's end over the survivors only: bit for bit.
"""

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from feddg.config import ConfigError, build_config
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.engines.workers import WorkerPool
from feddg.federation.checkpoint import load_checkpoint
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped, check_reply, outliers, shapes_of, update_norm

BASE = {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
        "federation": {"rounds": 3, "batch_size": 16}, "optim": {"lr": 0.1}, "device": "cpu"}


@pytest.fixture(autouse=True)
def faulty() -> Iterator[ModuleType]:
    """``tests/support/faults.py``, its method registered for this test only (other test modules enumerate the
    registry at collection, so it is imported here, not at the top)."""
    module = importlib.import_module("support.faults")
    with module.registered():
        yield module


def faulty_config(faults: dict[str, str], *overrides: str, **params: float):
    return build_config({**BASE, "method": {"name": "faulty", "params": {"faults": faults, **params}}}, list(overrides))


def dropped(faults: dict[str, str]) -> dict[int, set[int]]:
    """round -> the clients a fault removes from it."""
    out: dict[int, set[int]] = {}
    for key in faults:
        r, c = (int(x) for x in key.split(":"))
        out.setdefault(r, set()).add(c)
    return out


def reference(faulty: ModuleType, tmp_path, drops: dict[int, set[int]], *overrides: str) -> Server:
    """The same run without faults, whose server never sends to the ``drops`` clients of each round."""
    server = Server(faulty.toy_federation_of(faulty_config({}, *overrides)), tmp_path / "reference")
    configure = server.configure
    server.configure = lambda r: {c: m for c, m in configure(r).items() if c not in drops.get(r, set())}
    run_inprocess(server)
    return server


def assert_close_weights(got: dict, want: dict, rtol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=rtol, atol=1e-7, err_msg=k)


def failures(server: Server) -> dict[int, dict[str, str]]:
    """round -> clients_failed_reasons, from metrics.jsonl (absent: none failed)."""
    rows = [json.loads(line) for line in (server.run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row.get("clients_failed", 0) == len(row.get("clients_failed_reasons", {}))
        assert row["clients"] == 4 - row.get("clients_failed", 0)
    return {row["round"]: row["clients_failed_reasons"] for row in rows if "clients_failed" in row}


@pytest.fixture
def one_thread():
    """Workers and Ray actors use one torch thread; so does the sequential reference they are compared with."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- validation --------------------------------------------------------------------------------
SENT = {"w/a": np.zeros((2, 3), np.float32), "w/n": np.array(0, np.int64), "lr": 0.1}
GOOD = {"w/a": np.ones((2, 3), np.float32), "w/n": np.array(4, np.int64), "num_examples": 10, "train_loss": 0.5}


@pytest.mark.parametrize(("change", "reason"), [
    ({"w/a": np.array([[1, np.nan, 0], [0, 0, 0]], np.float32)}, "NaN in w/a"),
    ({"stat/x": np.array([np.inf])}, "Inf in stat/x"),
    ({"train_loss": float("nan")}, "train_loss is nan"),
    ({"train_loss": np.float32("nan")}, "train_loss is nan"),  # a numpy float32 is no Python float
    ({"stat/z": np.array([complex(0, np.nan)])}, "NaN in stat/z"),  # complex: its NaN is found too
    ({"w/a": np.ones((3, 2), np.float32)}, "w/a has shape (3, 2), expected (2, 3)"),
    ({"w/b": np.ones(2, np.float32)}, "unexpected weight w/b"),
    ({"num_examples": 0}, "num_examples is 0, not a positive int"),
    ({"num_examples": 2.5}, "num_examples is 2.5, not a positive int"),
    ({"num_examples": True}, "num_examples is True, not a positive int"),
    # an integer or complex array in a float's place escaped the finite check and the update-norm bound
    ({"w/a": np.full((2, 3), 10**15, np.int64)}, "w/a is int64, expected float32"),
    ({"w/a": np.ones((2, 3), np.complex64)}, "w/a is complex64, expected float32"),
    ({"w/a": np.ones((2, 3), np.float64)}, "w/a is float64, expected float32"),  # a float, but not the one sent
    ({"w/n": np.array(4, np.float64)}, "w/n is float64, expected int64"),
    ({"train_loss": [0.5, 0.5]}, "train_loss is a list, not an array, a number or a string"),
])
def test_check_reply_names_what_is_wrong(change, reason):
    assert check_reply({**GOOD, **change}, SENT, shapes_of(SENT), all_weights=True) == reason


def test_check_reply_accepts_a_good_reply_and_knows_which_weights_must_come_back():
    declared = shapes_of(SENT)
    assert check_reply(GOOD, SENT, declared, all_weights=True) is None
    partial = {k: v for k, v in GOOD.items() if k != "w/n"}
    assert check_reply(partial, SENT, declared, all_weights=True) == "missing w/n"
    assert check_reply(partial, SENT, declared, all_weights=False) is None  # hFedF replies buffers only
    assert check_reply(partial, {}, declared, all_weights=True) == "missing w/n"  # nothing sent: the model's keys
    assert check_reply({"num_examples": 3}, {}, declared, all_weights=False) is None
    no_count = "num_examples is None, not a positive int"
    assert check_reply({"w/b": np.ones(2)}, {}, declared, all_weights=False) == no_count


def test_update_norm_is_the_distance_from_the_sent_float_weights() -> None:
    # ‖[4, 5, 6] − [1, 1, 6]‖ = ‖[3, 4, 0]‖ = 5; the int buffer and a weight that was not sent do not count
    sent = {"w/a": np.array([1, 1, 6], np.float32), "w/n": np.array(0, np.int64), "lr": 0.1}
    reply = {"w/a": np.array([4, 5, 6], np.float32), "w/n": np.array(100, np.int64), "w/extra": np.ones(3),
             "num_examples": 10}
    assert update_norm(reply, sent) == 5.0
    assert update_norm(sent, sent) == 0.0


def test_outliers_compare_with_the_median():
    assert outliers({0: 1.0, 1: 1.2, 2: 0.9, 3: 5.0}, 3.0) == {3: "update norm 5 > 3 x median 1.1"}
    assert outliers({0: 1.0, 1: 1.5}, 2.0) == {}
    assert outliers({0: 1.0, 1: 1.0, 2: 2.0}, 2.0) == {}  # exactly factor x median is still inside the bound


def test_a_timeout_needs_workers_and_is_not_for_flower():
    with pytest.raises(ConfigError, match="client_timeout_s needs workers >= 2"):
        build_config(BASE, ["federation.client_timeout_s=5", "federation.workers=1"])
    with pytest.raises(ConfigError, match="flower.round_timeout_s"):
        build_config(BASE, ["federation.client_timeout_s=5", "federation.engine=flower", "federation.workers=2"])
    assert build_config(BASE, ["federation.client_timeout_s=5"]).federation.workers == "auto"  # the default


# --- the in-process engine, sequential -----------------------------------------------------------
def test_a_raising_and_a_nan_client_are_dropped_and_the_rest_trains_on(tmp_path, faulty):
    faults = {"1:1": "raise", "2:2": "nan"}
    server = Server(faulty.toy_federation_of(faulty_config(faults)), tmp_path / "faulty")
    run_inprocess(server)
    assert failures(server) == {1: {"1": "RuntimeError: injected failure of client 1"},
                                2: {"2": "NaN in w/conv.weight"}}
    ref = reference(faulty, tmp_path, dropped(faults))
    assert_close_weights(server.state["weights"], ref.state["weights"])
    # a failed client's state is not advanced: 3 rounds, one of them failed
    assert {c: s["updates"] for c, s in server.client_states.items()} == {0: 3, 1: 2, 2: 2, 3: 3}
    assert server.client_states == ref.client_states


def test_an_outlier_update_is_rejected_and_the_rest_folds_bit_for_bit(tmp_path, faulty):
    faults = {"2:3": "scale"}
    cfg = faulty_config(faults, "federation.reject_outliers=3")
    server = Server(faulty.toy_federation_of(cfg), tmp_path / "faulty")
    run_inprocess(server)
    reasons = failures(server)
    assert list(reasons) == [2] and list(reasons[2]) == ["3"] and reasons[2]["3"].startswith("update norm")
    ref = reference(faulty, tmp_path, dropped(faults))
    for k, v in ref.state["weights"].items():
        np.testing.assert_array_equal(server.state["weights"][k], v, err_msg=k)


def test_too_few_clients_stop_the_run_with_the_last_checkpoint_intact(tmp_path, faulty):
    faults = {"2:0": "raise", "2:1": "nan", "2:2": "raise"}
    run_dir = tmp_path / "run"
    server = Server(faulty.toy_federation_of(faulty_config(faults, "federation.min_clients=2")), run_dir)
    with pytest.raises(RunStopped) as err:
        run_inprocess(server)
    message = str(err.value)
    assert "\n" not in message and message.startswith("round 2: 1 of 4 clients replied usably")
    assert "client 1: NaN in w/conv.weight" in message and "last checkpoint (round 1) is intact" in message
    assert load_checkpoint(run_dir)["round"] == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1 and not (run_dir / "results.json").exists()
    # the cause fixed, the run resumes from round 1 and ends as a run that never failed
    resumed = Server(faulty.toy_federation_of(faulty_config({}, "federation.min_clients=2")), run_dir, resume=True)
    run_inprocess(resumed)
    clean = Server(faulty.toy_federation_of(faulty_config({})), tmp_path / "clean")
    run_inprocess(clean)
    for k, v in clean.state["weights"].items():
        np.testing.assert_array_equal(resumed.state["weights"][k], v, err_msg=k)


def test_a_round_that_samples_fewer_than_min_clients_stops_before_it_starts(tmp_path, faulty):
    cfg = faulty_config({}, "federation.client_fraction=0.25", "federation.min_clients=2")
    with pytest.raises(RunStopped, match="samples 1 clients, fewer than federation.min_clients=2"):
        run_inprocess(Server(faulty.toy_federation_of(cfg), tmp_path / "run"))


def test_a_round_that_samples_exactly_min_clients_starts(tmp_path: Path, faulty: ModuleType) -> None:
    server = Server(faulty.toy_federation_of(faulty_config({}, "federation.min_clients=4")), tmp_path / "run")
    fold = server.start_round(server.configure(1))  # 4 of 4 sampled: not fewer than min_clients
    assert fold.expected == {c: len(client.train_idx) for c, client in enumerate(server.fed.clients)}


# --- the in-process engine, worker processes -----------------------------------------------------
@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_workers_survive_a_raise_a_nan_a_hang_and_a_killed_worker(tmp_path, one_thread, start, faulty):
    faults = {"1:1": "raise", "2:2": "nan", "3:0": "sleep", "4:3": "kill"}
    over = ("federation.rounds=4", "federation.workers=2", "federation.client_timeout_s=5")
    cfg = faulty_config(faults, *over)
    server = Server(faulty.toy_federation_of(cfg), tmp_path / "faulty")
    server.mark_setup_done()
    fed = server.fed if start == "fork" else None  # fork: workers inherit the federation, replacements too
    with WorkerPool(cfg, 2, factory=faulty.toy_federation_of, timeout_s=5, fed=fed) as pool:
        started = {w.proc.pid for w in pool.workers}
        for r in range(1, 5):
            run_round(server, r, pool)
        assert len(pool.workers) == 2 and all(w.proc.is_alive() for w in pool.workers)
        assert started - {w.proc.pid for w in pool.workers}, "the hung and the killed worker were replaced"
    assert failures(server) == {
        1: {"1": "RuntimeError: injected failure of client 1"},
        2: {"2": "NaN in w/conv.weight"},
        3: {"0": "timed out after 5 s (federation.client_timeout_s)"},
        4: {"3": "its worker process died (SIGKILL)"},
    }
    ref = reference(faulty, tmp_path, dropped(faults), "federation.rounds=4")
    assert_close_weights(server.state["weights"], ref.state["weights"])
    assert {c: s["updates"] for c, s in server.client_states.items()} == {0: 3, 1: 3, 2: 3, 3: 3}


def test_a_worker_that_cannot_build_the_federation_stops_the_run_in_one_line(tmp_path, faulty):
    cfg = faulty_config({}, "federation.workers=2")
    server = Server(faulty.toy_federation_of(cfg), tmp_path / "run")
    server.mark_setup_done()
    with pytest.raises(RunStopped, match=r"^a client worker could not build the federation: FileNotFoundError: "
                                         r"no dataset for experiment on this worker$"), \
            WorkerPool(cfg, 2, factory=faulty.broken_federation) as pool:  # spawned: the worker runs the factory
        run_round(server, 1, pool)


# --- Flower's Simulation Runtime -----------------------------------------------------------------
@pytest.mark.slow
def test_flower_simulation_drops_a_raise_a_nan_and_a_late_reply(tmp_path, one_thread, faulty):
    from feddg.engines.flower.simulation import run_flower

    faults = {"1:1": "raise", "1:3": "sleep", "2:2": "nan"}
    # two actors: one sleeps, the other builds its federation (cold, slow on a loaded machine) and runs 3 clients
    over = ("federation.rounds=2", "flower.ray_num_cpus=2", "flower.round_timeout_s=30")
    server = Server(faulty.toy_federation_of(faulty_config(faults, *over, sleep_s=40)), tmp_path / "faulty")
    run_flower(server, factory=faulty.toy_federation_of)
    reasons = failures(server)
    assert reasons[1]["1"].startswith("node ")
    assert reasons[1]["1"].endswith(": RuntimeError: injected failure of client 1")
    assert reasons[1]["3"] == "no reply within 30 s (flower.round_timeout_s)"
    assert reasons[2] == {"2": "NaN in w/conv.weight"} and len(reasons[1]) == 2
    ref = reference(faulty, tmp_path, dropped(faults), "federation.rounds=2")
    assert_close_weights(server.state["weights"], ref.state["weights"])


@pytest.mark.parametrize("method", ["fedavg", "fedsr", "fedbn", "fedsam"])
def test_a_client_that_batchnorm_leaves_nothing_to_train_is_dropped_not_reported_trained(tmp_path, method):
    # one example: its only batch holds one sample, which training skips under BatchNorm; the client replied with
    # the untouched global model and train_loss 0.0, averaged in as trained (batch_size 1 did so for every client)
    import dataclasses

    from toy import toy_federation

    with pytest.raises(ValueError, match=r"^federation\.batch_size=1: model cnn has BatchNorm, which cannot train on "
                                         r"one-sample batches \(they are skipped, so no client would train\): use 2 or"):
        toy_federation(f"method.name={method}", "federation.batch_size=1")
    fed = toy_federation(f"method.name={method}", "federation.rounds=1")
    fed.clients[0] = dataclasses.replace(fed.clients[0], train_idx=fed.clients[0].train_idx[:1])
    server = Server(fed, tmp_path / "run")
    run_inprocess(server)
    row = server.metrics[-1]
    assert row["clients"] == 3 and row["train_loss"] > 0.1
    assert row["clients_failed_reasons"] == {"0": "ValueError: client 0 has nothing to train on: its 1 example(s) "
                                             "make only one-sample batches (batch size 16), which a BatchNorm model "
                                             "skips"}
