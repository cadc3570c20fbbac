"""The Flower engine: records conversion, the message protocol, and equivalence with the in-process engine.

Fast tests drive the real ServerApp half (``run_on_grid``) and the real ClientApp through
``LoopbackGrid``, which calls the ClientApp in this process and passes every message and node
Context through Flower's protobuf serialisation, as a SuperNode does. The slow tests run
Flower's Simulation Runtime (Ray on 127.0.0.1).
"""

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
    recorddict_from_proto,
    recorddict_to_proto,
)
from flwr.serverapp import Grid
from support.flower_messages import pushed
from thread_counts import blas_threads
from toy import ToyDomains, ToyNet
from toy_pixels import needs_masks, pixel_config, pixel_federation, registered

from feddg.aggregation.mean import weighted_mean_messages
from feddg.algorithms import create_method
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.registry import list_methods
from feddg.config import build_config, dump_config
from feddg.engines.flower.app import run_config_toml
from feddg.engines.flower.client import config_from_text, make_client_app, node_threads, pending_prefix
from feddg.engines.flower.records import get_message, message_records, put_message
from feddg.engines.flower.server import run_on_grid
from feddg.engines.flower.simulation import run_flower
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.engines.workers import compute_threads
from feddg.experiment import run_experiment
from feddg.federation.checkpoint import load_checkpoint
from feddg.federation.server import Server
from feddg.federation.setup import Federation, build_federation, make_clients, make_split, make_topology
from feddg.federation.validation import RunStopped
from feddg.messages import array_slot, load_weights, weights_of


# --- a method with extra payloads, per-client messages, client state and a setup exchange -----
class PayloadProbe(FedAvg):
    """FedAvg plus everything else a method may send (a stand-in until HFedATM / FedFA are on Flower).

    setup: each client uploads its label histogram (int64 array); per round the server sends a
    per-client array, clients reply with a feature-mean array, an int64 0-d array, a string and
    a visit counter kept in their client state.
    """

    def setup_request(self, state):
        return {"ask": "labels", "bins": 4}

    def setup_layout(self, model, request, weights):
        return {"hist/labels": array_slot((int(request["bins"]),), np.int64)}

    def client_setup(self, model, msg, client_state, ctx):
        hist = np.bincount(ctx.dataset.labels[ctx.train_idx], minlength=int(msg["bins"])).astype(np.int64)
        return {"hist/labels": hist, "num_examples": ctx.num_examples}, {"setup_seen": 1}

    def server_setup(self, state, replies):
        return {**state, "label_hist": sum(r.message["hist/labels"] for r in replies)}

    def client_config(self, state, client_id, round):
        return {**state["weights"], "probe/offset": np.full(3, client_id, dtype=np.float32)}

    def client_update(self, model, msg, client_state, ctx):
        reply, _ = super().client_update(model, msg, client_state, ctx)
        model.eval()
        with torch.no_grad():
            feats = torch.cat([model.features(x) for x, _ in ctx.batches(shuffle=False, train=False)])
        visits = int(client_state.get("visits", 0)) + 1
        momentum = 0.5 * client_state.get("momentum", 0.0) + 0.5 * feats.mean(0).double().numpy()
        reply = {
            **reply,
            "stat/feature_mean": feats.mean(0).double().numpy() + float(msg["probe/offset"][0]),
            "stat/count": np.array(len(feats), dtype=np.int64),
            "visits": visits,
            "echo": f"client {ctx.client_id} round {msg['round']}",
        }
        new_state = {**client_state, "visits": visits, "momentum": momentum, "last": f"round {msg['round']}"}
        return reply, new_state

    def reply_layout(self, model, sent, weights):
        return {"stat/feature_mean": array_slot((model.feature_dim,), np.float64), "stat/count": array_slot((), np.int64)}

    def keep(self, reply):
        kept = ("visits", "echo", "num_examples")
        return {k: v for k, v in reply.message.items() if k.startswith("stat/") or k in kept}

    def finish(self, state, acc):
        state, metrics = super().finish(state, acc)
        replies = acc.kept
        stats = weighted_mean_messages([r.message for r in replies], [r.num_examples for r in replies], "stat/")
        visits = {**state.get("visits", {}), **{r.client_id: r.message["visits"] for r in replies}}
        echoes = [r.message["echo"] for r in replies]
        return {**state, "stats": stats, "visits": visits, "echoes": echoes}, metrics


def toy_federation_of(cfg, method=None) -> Federation:
    """The toy federation of ``cfg`` (what tests/toy.py builds), optionally with another method object."""
    ds = ToyDomains()
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    torch.manual_seed(cfg.seed)
    method = method or create_method(cfg.method.name, cfg.method.params)
    model = method.prepare_model(ToyNet())
    return Federation(cfg, ds, split, clients, method, model, torch.device("cpu"), make_topology(cfg, clients, model))


def probe_federation(cfg) -> Federation:
    return toy_federation_of(cfg, PayloadProbe())


def toy_config(*overrides):
    return build_config(
        {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
         "federation": {"rounds": 3, "batch_size": 16, "workers": 1}, "optim": {"lr": 0.1}, "device": "cpu"},
        list(overrides),
    )  # workers 1: the in-process reference trains in this process under federation.threads, as a ClientApp does


# --- a Grid that delivers through protobuf to ClientApps in this process -----------------------
class LoopbackGrid(Grid):
    """SuperNodes with partition ids 0..n-1; each message and node Context crosses protobuf, as on the wire."""

    def __init__(self, client_app, num_nodes: int, run_config=None, node_config=None) -> None:
        self.app = client_app
        self.contexts = {
            1000 + p: context_to_proto(
                Context(run_id=1, node_id=1000 + p,
                        node_config={"partition-id": p, "num-partitions": num_nodes, **(node_config or {})},
                        state=RecordDict(), run_config=dict(run_config or {}))
            )
            for p in range(num_nodes)
        }

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = pushed(msg).metadata.dst_node_id
            ctx = context_from_proto(self.contexts[node])
            try:
                reply = self.app(message_from_proto(message_to_proto(msg)), ctx)
            except Exception as err:
                reply = Message(Error(code=0, reason=repr(err)), reply_to=msg)
            self.contexts[node] = context_to_proto(ctx)
            replies.append(message_from_proto(message_to_proto(reply)))
        return replies

    def set_run(self, run):
        raise NotImplementedError

    run = create_message = get_nodes = push_messages = pull_messages = set_run


def server_config_text(server):
    return dump_config(server.fed.cfg)


def _same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a) <= atol


def _without_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


# --- records -----------------------------------------------------------------------------------
def test_message_round_trips_through_flower_records_and_protobuf():
    msg = {
        "w/conv.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1),  # non-contiguous
        "w/bn.num_batches_tracked": np.array(7, dtype=np.int64),  # 0-d
        "hist/x": np.array([1, 2], dtype=np.uint8),
        "empty": np.zeros((0, 5), dtype=np.float16),
        "num_examples": 120,
        "lr": 0.05,
        "train_loss": np.float64(0.25),
        "n32": np.int32(3),
        "tag": "hello/ü",
    }
    back = get_message(recorddict_from_proto(recorddict_to_proto(message_records(msg, "client-3/"))), "client-3/")
    assert list(back) == list(msg)  # key order kept
    for k, v in msg.items():
        if isinstance(v, np.ndarray):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v)
        else:
            assert back[k] == v
    assert type(back["num_examples"]) is int and type(back["n32"]) is int
    assert type(back["lr"]) is float and type(back["train_loss"]) is float and type(back["tag"]) is str
    assert get_message(RecordDict(), "client-3/") == {}  # a client's first round


def test_client_state_overwrites_and_survives_the_context_serialisation():
    ctx = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={})
    put_message(ctx.state, {"a": np.ones(2), "visits": 1}, "client-0/")
    put_message(ctx.state, {"visits": 2, "note": "x"}, "client-0/")  # the array is gone in the new state
    put_message(ctx.state, {"visits": 9}, "client-4/")
    restored = context_from_proto(context_to_proto(ctx)).state
    assert get_message(restored, "client-0/") == {"visits": 2, "note": "x"}
    assert get_message(restored, "client-4/") == {"visits": 9}


def test_run_config_toml_carries_the_experiment(tmp_path):
    import tomllib

    cfg = toy_config("federation.rounds=2", "method.name=fedprox", "method.params.mu=0.5", "name=a \"quoted\"\nname")
    rc = tomllib.loads(run_config_toml(cfg, tmp_path / "run"))
    assert config_from_text(rc["config"]) == cfg
    assert rc["run-dir"] == str((tmp_path / "run").resolve()) and rc["resume"] is False


# --- the protocol, fast (no Ray) ----------------------------------------------------------------
def test_flower_protocol_matches_inprocess_with_payloads_state_and_setup(tmp_path, task_identity):
    cfg = toy_config("federation.client_fraction=0.5")
    ref = Server(probe_federation(cfg), tmp_path / "ref")
    run_inprocess(ref)
    server = Server(probe_federation(cfg), tmp_path / "flower")
    grid = LoopbackGrid(make_client_app(factory=probe_federation), 4, {"config": server_config_text(server)})
    results = run_on_grid(server, grid)

    assert _same_weights(ref.state["weights"], server.state["weights"])  # bit-identical
    assert np.array_equal(ref.state["label_hist"], server.state["label_hist"])  # setup exchange
    assert ref.state["label_hist"].sum() == sum(len(c.train_idx) for c in server.fed.clients)
    for k in ref.state["stats"]:  # extra arrays, per-client messages
        assert np.array_equal(ref.state["stats"][k], server.state["stats"][k])
    assert ref.state["echoes"] == server.state["echoes"]
    # client state persisted on the nodes: visits count each client's sampled rounds
    assert server.state["visits"] == ref.state["visits"]
    assert max(server.state["visits"].values()) >= 2
    assert _without_times(ref.metrics) == _without_times(server.metrics)
    assert json.loads((tmp_path / "flower" / "results.json").read_text())["final"] == results["final"]
    assert server.client_states == {}  # client state never reaches the server on Flower


def _untimed(rows):
    return [{k: v for k, v in r.items() if not (k.startswith("time_") or k.endswith("_s"))} for r in rows]


#: methods whose model hooks need a zoo CNN (a conv-stage map ToyNet lacks)
NEEDS_CNN = {"fedfa"}


#: what a method needs of the toy config (central pools the data into one client; SCAFFOLD's option II and MTGC: plain
#: SGD; MTGC and FedRC: stations)
METHOD_OVERRIDES = {"central": ["partition.kind=iid", "partition.num_clients=1"], "scaffold": ["optim.momentum=0"],
                    "mtgc": ["optim.momentum=0", "hierarchy.stations=2", "hierarchy.station_rounds=2", "federation.rounds=1"],
                    "fedrc": ["hierarchy.stations=2"]}


@pytest.mark.parametrize("method", sorted(set(list_methods()) - NEEDS_CNN))
def test_every_method_runs_the_same_over_the_flower_protocol(tmp_path, task_identity, method):
    with registered():  # a method that needs dense masks runs on the pixel task
        dense = needs_masks(method)
        cfg = (pixel_config if dense else toy_config)(f"method.name={method}", "federation.rounds=2",
                                                      *METHOD_OVERRIDES.get(method, []))
        factory = pixel_federation if dense else toy_federation_of
        ref = Server(factory(cfg), tmp_path / "ref")
        run_inprocess(ref)
        server = Server(factory(cfg), tmp_path / "flower")
        nodes = len(server.fed.clients)
        run_on_grid(server, LoopbackGrid(make_client_app(server_config_text(server), factory=factory), nodes))
    assert _untimed(server.metrics) == _untimed(ref.metrics) and len(ref.metrics) == 2


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[f"method.name={m}"] for m in sorted(NEEDS_CNN)] + [["hierarchy.stations=2"]],
                         ids=lambda o: "-".join(o))
def test_cnn_methods_and_stations_run_the_same_over_the_flower_protocol(tmp_path, cache_dir, task_identity, overrides):
    cfg = build_config(
        {"device": "cpu", "data": {"max_per_domain": 60, "cache_dir": str(cache_dir)}, "model": {"name": "cnn"},
         "partition": {"num_clients": 3}, "federation": {"rounds": 2, "batch_size": 16, "workers": 1}},
        overrides,
    )
    ref = Server(build_federation(cfg), tmp_path / "ref")
    run_inprocess(ref)
    server = Server(build_federation(cfg), tmp_path / "flower")
    run_on_grid(server, LoopbackGrid(make_client_app(server_config_text(server)), 3))
    assert _untimed(server.metrics) == _untimed(ref.metrics) and len(ref.metrics) == 2


def test_a_resumed_run_continues_at_the_checkpointed_round(tmp_path, task_identity, caplog):
    cfg = toy_config()  # 3 rounds
    full = Server(toy_federation_of(cfg), tmp_path / "full")
    run_inprocess(full)
    crashed = Server(toy_federation_of(cfg), tmp_path / "crash")
    crashed.mark_setup_done()
    run_round(crashed, 1)
    resumed = Server(toy_federation_of(cfg), tmp_path / "crash", resume=True)
    rows = []
    run_on_grid(resumed, LoopbackGrid(make_client_app(server_config_text(resumed), factory=toy_federation_of), 4),
                on_round=rows.append)
    assert [r["round"] for r in rows] == [2, 3]  # Flower's rounds 1, 2 are feddg's 2, 3
    assert _without_times(resumed.metrics) == _without_times(full.metrics)
    # the clients' own state was in the nodes' memory, not in the checkpoint: the resume says it starts empty again
    said = [m for r in caplog.records if r.levelname == "WARNING" and "resumed after round" in (m := r.getMessage())]
    assert said == ["feddg: resumed after round 1: the nodes of clients 0-3 keep no state-dir, so what fedavg's "
                    "clients keep between rounds (e.g. SCAFFOLD's control variates, FedBN's own BN) starts empty on "
                    "them; a method that keeps none continues as an uninterrupted run would (docs/flower.md, 'Where "
                    "client state lives')"]
    assert _same_weights(full.state["weights"], resumed.state["weights"])


def test_a_node_with_another_federation_is_refused(tmp_path, task_identity):
    server = Server(toy_federation_of(toy_config()), tmp_path / "x")
    other = toy_config("seed=1")  # another partition of the data
    grid = LoopbackGrid(make_client_app(server_config_text(Server(toy_federation_of(other), tmp_path / "y")),
                                        factory=toy_federation_of), 4)
    with pytest.raises(RuntimeError, match="different federation"):
        run_on_grid(server, grid)


def test_one_supernode_per_client_is_required(tmp_path, task_identity):
    server = Server(toy_federation_of(toy_config()), tmp_path / "x")
    grid = LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation_of), 2)
    with pytest.raises(RuntimeError, match=r"partition 0 of 2; want one node per client, partitions 0\.\.3"):
        run_on_grid(server, grid)


def test_the_server_and_every_clientapp_compute_under_the_thread_policy(tmp_path, task_identity, monkeypatch):
    """``federation.threads: auto``: the ServerApp's rounds and each ClientApp's setup and updates run on one torch
    and one BLAS thread whatever the process had (SuperNodes sharing a machine never spin at one another's
    barriers); a node's ``--node-config threads=N`` sets its clients' count; the process's counts come back after."""
    from feddg.engines.flower import client as flower_client

    clients: list[tuple[int, set[int]]] = []
    rounds: list[tuple[int, set[int]]] = []

    def probed(fn):
        def run(*args, **kwargs):
            clients.append((torch.get_num_threads(), blas_threads()))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(flower_client, "run_client", probed(flower_client.run_client))
    monkeypatch.setattr(flower_client, "run_client_setup", probed(flower_client.run_client_setup))
    cfg = toy_config("federation.rounds=1")
    with compute_threads(2):  # a process with two torch and two BLAS threads (this machine's cores may be fewer)
        for name, node in (("auto", {}), ("node-threads", {"threads": 2})):
            server = Server(probe_federation(cfg), tmp_path / name)
            grid = LoopbackGrid(make_client_app(factory=probe_federation), 4, {"config": server_config_text(server)},
                                node)
            run_on_grid(server, grid, lambda row: rounds.append((torch.get_num_threads(), blas_threads())))
            expected = (1, {1}) if not node else (2, {2})
            assert len(clients) >= 4 and all(c == expected for c in clients), (name, clients)
            clients.clear()
        assert rounds == [(1, {1}), (1, {1})]
        assert torch.get_num_threads() == 2 and blas_threads() == {2}


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_a_node_thread_count_that_is_not_a_whole_number_is_refused_in_one_line(value):
    fed = toy_federation_of(toy_config())
    context = Context(run_id=1, node_id=1, node_config={"threads": value}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match=r"^--node-config threads=.*: expected a whole number of threads, at least 1$"):
        node_threads(context, fed)


def test_a_node_with_a_bad_thread_count_fails_at_identify_and_the_server_says_which(tmp_path, task_identity):
    server = Server(toy_federation_of(toy_config()), tmp_path / "x")
    grid = LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation_of), 4, None, {"threads": 0})
    with pytest.raises(RuntimeError, match=r"node 1000 failed to identify: .*--node-config threads=0"):
        run_on_grid(server, grid)
    assert load_checkpoint(tmp_path / "x") is None


def test_a_client_error_reaches_the_server_with_its_reason(tmp_path, task_identity):
    def leaky_federation(cfg):
        fed = toy_federation_of(cfg)
        original = fed.method.client_update
        fed.method.client_update = lambda m, msg, s, ctx: ({**original(m, msg, s, ctx)[0], "raw": torch.zeros(1)}, s)
        return fed

    server = Server(toy_federation_of(toy_config()), tmp_path / "x")
    grid = LoopbackGrid(make_client_app(server_config_text(server), factory=leaky_federation), 4)
    with pytest.raises(RunStopped, match=r"round 1: 0 of 4 clients .*client 0: node 1000: TypeError.*raw"):
        run_on_grid(server, grid)
    assert load_checkpoint(tmp_path / "x") is None and not (tmp_path / "x" / "results.json").exists()


def test_a_dropped_reply_leaves_the_client_state_on_its_node_as_it_was(tmp_path, task_identity):
    """A node keeps a client's new state aside until the server says it folded the reply in."""
    from support.faults import registered
    from support.faults import toy_federation_of as faulty_federation

    with registered():
        cfg = toy_config("method.name=faulty", 'method.params.faults={"1:1": nan, "2:2": raise}')
        server = Server(faulty_federation(cfg), tmp_path / "x")
        grid = LoopbackGrid(make_client_app(server_config_text(server), factory=faulty_federation), 4)
        run_on_grid(server, grid)
    assert [sorted(r.get("clients_failed_reasons", {})) for r in server.metrics] == [["1"], ["2"], []]
    states = {p: context_from_proto(grid.contexts[1000 + p]).state for p in range(4)}
    # the last round's state waits under pending/: the updates the server accepted before it, plus one
    assert {p: get_message(s, pending_prefix(p))["updates"] for p, s in states.items()} == {0: 3, 1: 2, 2: 2, 3: 3}


def test_missing_partitions_time_out(tmp_path, task_identity):
    server = Server(toy_federation_of(toy_config("flower.node_wait_s=1")), tmp_path / "x")
    grid = LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation_of), 4)
    del grid.contexts[1001]  # partition 1 of 4 never connects
    with pytest.raises(TimeoutError, match=r"clients \[1\] did not connect"):
        run_on_grid(server, grid)


# --- Flower's Simulation Runtime (Ray) ---------------------------------------------------------
def digits_config(cache_dir, *overrides):
    return build_config(
        {"name": "flower-eq", "seed": 3, "device": "cpu",
         "data": {"dataset": "digits-dg", "max_per_domain": 200, "cache_dir": str(cache_dir)},
         "split": {"target": "mnistm"}, "partition": {"kind": "by_domain", "num_clients": 3},
         "model": {"name": "cnn"}, "federation": {"rounds": 2, "batch_size": 32},
         "optim": {"lr": 0.05}, "flower": {"ray_num_cpus": 2}},
        list(overrides),
    )


@pytest.fixture
def one_thread():
    """Ray gives each ClientApp actor one CPU (OMP_NUM_THREADS=1); the reference run must use as many
    threads, since CPU convolutions sum in a thread-dependent order (2 rounds of the CNN already
    differ by ~1e-2 between 1 and 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_fedavg_on_digits_dg_gives_the_same_run_inprocess_and_on_flower_simulation(tmp_path, cache_dir, one_thread):
    runs = {}
    for engine in ("inprocess", "flower"):
        cfg = digits_config(cache_dir, f"federation.engine={engine}")
        results = run_experiment(cfg, tmp_path / engine, progress=False)
        rows = [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
        runs[engine] = (results, rows, load_checkpoint(tmp_path / engine))
    (res_a, rows_a, ck_a), (res_b, rows_b, ck_b) = runs["inprocess"], runs["flower"]
    w_a, w_b = ck_a["server_state"]["weights"], ck_b["server_state"]["weights"]
    assert _same_weights(w_a, w_b, atol=0.0)
    init = weights_of(_initial_model(digits_config(cache_dir)))
    assert not _same_weights(w_a, init, atol=1e-3)  # it trained
    assert [r["round"] for r in rows_b] == [1, 2]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra.keys() == rb.keys()
        assert ra["bytes_up"] == rb["bytes_up"] and ra["bytes_down"] == rb["bytes_down"]
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5)
        assert ra["ood_acc"] == pytest.approx(rb["ood_acc"], abs=0.5)
    assert res_a["final"].keys() == res_b["final"].keys()
    for f in ("config.yaml", "results.json", "checkpoint.pt", "curves.png", "domains.png"):
        assert (tmp_path / "flower" / f).is_file()


def _initial_model(cfg):
    return build_federation(cfg).model


@pytest.mark.slow
def test_payload_method_with_client_state_on_flower_simulation(tmp_path, one_thread):
    cfg = toy_config("federation.client_fraction=0.5", "flower.ray_num_cpus=2")
    ref = Server(probe_federation(cfg), tmp_path / "ref")
    run_inprocess(ref)
    server = Server(probe_federation(cfg), tmp_path / "flower")
    rows = []
    run_flower(server, on_round=rows.append, factory=probe_federation)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert _same_weights(ref.state["weights"], server.state["weights"], atol=1e-6)
    assert np.array_equal(ref.state["label_hist"], server.state["label_hist"])
    assert server.state["visits"] == ref.state["visits"] and ref.state["echoes"] == server.state["echoes"]
    for k in ref.state["stats"]:
        assert np.allclose(ref.state["stats"][k], server.state["stats"][k], atol=1e-6)
    fresh = probe_federation(cfg).model
    load_weights(fresh, server.state["weights"])  # the aggregated weights load into the model


def test_flower_and_ray_logs_are_warnings_only_unless_verbose(monkeypatch):
    from feddg.engines.flower.simulation import VERBOSE, backend_config

    server = SimpleNamespace(fed=SimpleNamespace(cfg=build_config({})))
    monkeypatch.delenv(VERBOSE, raising=False)
    assert backend_config(server)["init_args"]["logging_level"] == logging.WARNING
    monkeypatch.setenv(VERBOSE, "1")
    assert backend_config(server)["init_args"]["logging_level"] == logging.INFO
