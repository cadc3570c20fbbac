"""Issue 27: SecAgg+ on Flower (docs/flower.md, "Secure aggregation"). Flower 1.41's own SecAggPlusWorkflow and
secaggplus_mod run inside feddg's ServerApp and ClientApp (through ``LoopbackGrid``: every message and node Context
crosses protobuf, as on the wire); the model equals the plain run's within the quantisation error, and the server
side receives only the aggregate."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key
from flwr.serverapp import Grid
from test_flower import LoopbackGrid, server_config_text, toy_config, toy_federation_of

from feddg.config import ConfigError, SecAggPlusConfig, build_config
from feddg.engines.flower import secagg_server
from feddg.engines.flower.client import make_client_app
from feddg.engines.flower.secagg import fitres_content, from_fitins, summed_keys, to_fitins
from feddg.engines.flower.server import run_on_grid
from feddg.federation.server import AGGREGATE, Server
from feddg.federation.validation import RunStopped
from feddg.messages import Message as FeddgMessage

SECURE = ("federation.engine=flower", "flower.secure_aggregation=secaggplus")


#: the bound on one round's error (docs/flower.md, "Secure aggregation"): stochastic rounding moves each client's
#: share by < 1 quantum 2c/Q (c = 8, Q = 2^22), the mean by < K quanta x max_weight / sum(n) = 4 x 3.8e-6 x 54/216
#: (4 clients of 54 examples) = 3.8e-6; plus float32 rounding of both results (weights below 4: 2.4e-7 each)
ROUND_ERROR = 4 * 16 / 2**22 * 54 / 216 + 5e-7


def run(tmp_path, name: str, *overrides: str, first: dict | None = None) -> Server:
    """A toy run over ``LoopbackGrid``; ``first`` receives the round-1 weights."""
    server = Server(toy_federation_of(toy_config(*overrides)), tmp_path / name)

    def keep_round_1(row: dict) -> None:
        if row["round"] == 1 and first is not None:
            first.update(server.state["weights"])

    run_on_grid(server, LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation_of), 4),
                keep_round_1)
    return server


def max_error(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a if a[k].dtype.kind == "f")


def test_a_message_crosses_as_fitins_and_back():
    msg = {"w/a": np.arange(3, dtype=np.float32), "w/n": np.array(4), "lr": 0.5, "round": 2, "tag": "x"}
    back, route = from_fitins(compat.fitins_to_recorddict(to_fitins(msg, {"client-id": 3, "commit-round": 1}), True))
    assert route == {"client-id": 3, "commit-round": 1} and back.keys() == msg.keys()
    assert all(np.array_equal(back[k], v) for k, v in msg.items())


def test_an_aggregate_is_folded_as_the_round_mean_of_its_clients(tmp_path):
    server = Server(toy_federation_of(toy_config(*SECURE)), tmp_path / "run")
    sent = server.configure(1)
    fold = server.start_round(sent)
    mean = {k: (v + 0.5 if v.dtype.kind == "f" else v) for k, v in sent[0].items() if k.startswith("w/")}
    server.receive_aggregate(fold, mean, {0: 54, 1: 54, 2: 27, 3: 54}, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
    row = server.finish_round(1, fold, {})
    for k, v in mean.items():  # FedAvg's new model is the aggregate
        np.testing.assert_array_equal(server.state["weights"][k], v, err_msg=k)
    assert row["clients"] == 4 and row["train_loss"] == pytest.approx((54 + 108 + 81 + 216) / 189)
    assert "clients_failed" not in row and fold.accepted == [0, 1, 2, 3]


def test_a_secure_aggregates_update_norm_becomes_the_next_rounds_norm_reference(tmp_path):
    # the aggregate's norm stands for each of its clients: the median of the accepted norms is that norm
    server = Server(toy_federation_of(toy_config(*SECURE, "federation.update_norm_factor=100")), tmp_path / "run")
    sent = server.configure(1)
    fold = server.start_round(sent)
    mean = {k: (v + 0.5 if v.dtype.kind == "f" else v) for k, v in sent[0].items() if k.startswith("w/")}
    server.receive_aggregate(fold, mean, {0: 54, 1: 54, 2: 27, 3: 54}, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
    server.finish_round(1, fold, {})
    floats = sum(v.size for v in mean.values() if v.dtype.kind == "f")
    assert fold.norms == dict.fromkeys([0, 1, 2, 3], fold.norms[0])
    assert server.norm_bound is not None and server.norm_bound.reference == pytest.approx(0.5 * floats**0.5, rel=1e-5)


@pytest.mark.parametrize(("counts", "losses", "why"), [
    ({0: 54, 1: -1}, {0: 1.0, 1: 1.0}, "client 1 claimed num_examples=-1, not a positive int"),
    ({0: 54, 1: 0}, {0: 1.0, 1: 1.0}, "client 1 claimed num_examples=0, not a positive int"),
    ({0: 54, 1: 54}, {0: 1.0, 1: float("nan")}, "client 1 sent train_loss=nan, not a finite number"),
    ({0: 54, 1: 54}, {0: 1.0}, "client 1 sent train_loss=None, not a finite number"),
    ({0: 54, 1: 54}, {0: 1.0, 1: [0.5]}, "client 1 sent train_loss=[0.5], not a finite number"),
])
def test_a_secure_aggregates_clear_text_counts_and_losses_are_checked(tmp_path, counts, losses, why):
    # the weights are secret, these are not: a bad one refuses the aggregate in one line (it raised or was recorded)
    server = Server(toy_federation_of(toy_config(*SECURE)), tmp_path / "run")
    sent = server.configure(1)
    fold = server.start_round(sent)
    mean = {k: v for k, v in sent[0].items() if k.startswith("w/")}
    server.receive_aggregate(fold, mean, counts, losses)
    assert fold.accepted == [] and fold.failed == {AGGREGATE: why}


@pytest.mark.usefixtures("task_identity")
def test_secaggplus_fedavg_gives_the_plain_model_and_the_server_sees_only_the_aggregate(tmp_path, monkeypatch):
    seen: list = []
    aggregate_fit = secagg_server.SecureRound.aggregate_fit

    def spy(self, server_round, results, failures):
        seen.append([r.parameters for _, r in results])
        return aggregate_fit(self, server_round, results, failures)

    monkeypatch.setattr(secagg_server.SecureRound, "aggregate_fit", spy)
    received: list[int] = []
    receive = Server.receive
    monkeypatch.setattr(Server, "receive", lambda self, fold, reply, state=None: (
        received.append(reply.client_id), receive(self, fold, reply, state)))
    plain_first: dict = {}
    secure_first: dict = {}
    plain = run(tmp_path, "plain", "federation.engine=flower", first=plain_first)
    received.clear()
    secure = run(tmp_path, "secure", *SECURE, first=secure_first)
    # the strategy's input: 4 results per round, every one the same parameters object (the aggregate) ...
    assert len(seen) == 3 and all(len(p) == 4 and all(x is p[0] for x in p) for p in seen)
    # ... and the server folded one reply per round, the aggregate, never a client's
    assert received == [AGGREGATE] * 3
    # round 1 within the quantisation error; later rounds train on the perturbed model (measured: 1.8e-4 at most)
    assert 0 < max_error(plain_first, secure_first) < ROUND_ERROR
    assert max_error(plain.state["weights"], secure.state["weights"]) < 1e-3
    rows = secure.metrics
    assert [r["clients"] for r in rows] == [4, 4, 4]
    assert rows[-1]["train_loss"] == pytest.approx(plain.metrics[-1]["train_loss"], rel=1e-3)
    assert rows[-1]["ood_acc"] == pytest.approx(plain.metrics[-1]["ood_acc"], abs=2)


@pytest.mark.usefixtures("task_identity")
def test_a_claim_beyond_a_clients_data_refuses_the_secure_aggregate(tmp_path, monkeypatch):
    from feddg.engines.flower import secagg

    fitres = secagg.fitres_content
    monkeypatch.setattr(secagg, "fitres_content", lambda sent, answer: fitres(sent, {**answer, "num_examples": 10**6}))
    monkeypatch.setattr("feddg.engines.flower.client.fitres_content", secagg.fitres_content)
    with pytest.raises(RunStopped, match=r"client -1: client 0 claimed num_examples=1000000 > its \d+ training "
                                         r"examples: a secure aggregate cannot be re-weighted"):
        run(tmp_path, "claim", *SECURE)


@pytest.mark.parametrize(("method", "why"), [
    ("scaffold", "scaffold, whose server uses more of a reply than its weights (accumulate, client_config)"),
    ("local", "local, which does not average weights"),
])
def test_secaggplus_is_refused_for_methods_whose_replies_are_more_than_weights(method, why):
    params = {"control": "option1"} if method == "scaffold" else {}
    with pytest.raises((ConfigError, ValueError), match="flower.secure_aggregation: secaggplus is for Flower runs of "
                       "methods whose replies are weights \\+ num_examples, averaged by the mean, not "
                       + why.replace("(", r"\(").replace(")", r"\)")):
        build_config({"method": {"name": method, "params": params}, "federation": {"engine": "flower"},
                      "flower": {"secure_aggregation": "secaggplus"}})


@pytest.mark.slow
def test_secaggplus_fedavg_on_the_simulation_runtime_gives_the_in_process_model(tmp_path):
    """The same on Flower's Simulation Runtime (Ray on 127.0.0.1, one virtual SuperNode per client)."""
    import torch

    from feddg.engines.flower.simulation import run_flower
    from feddg.engines.inprocess import run_inprocess

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray actor: CPU sums then follow the same order
    try:
        plain = Server(toy_federation_of(toy_config("federation.rounds=1")), tmp_path / "plain")
        run_inprocess(plain)
        secure = Server(toy_federation_of(toy_config(*SECURE, "flower.ray_num_cpus=2", "federation.rounds=1")),
                        tmp_path / "secure")
        run_flower(secure, factory=toy_federation_of)
    finally:
        torch.set_num_threads(before)
    assert 0 < max_error(plain.state["weights"], secure.state["weights"]) < ROUND_ERROR
    assert [r["clients"] for r in secure.metrics] == [4]


# --- the codec and the server side, by hand ----------------------------------------------------------
def test_secaggplus_sums_only_the_float_weight_arrays_in_the_order_sent() -> None:
    msg: FeddgMessage = {"w/b": np.ones(2, np.float32), "w/n": np.array(3), "gram/g": np.ones(2, np.float32),
                         "w/a": np.zeros(1, np.float64), "lr": 0.5}
    assert summed_keys(msg) == ["w/b", "w/a"]  # not the integer buffer, not another prefix's float array


def test_a_clients_fitres_carries_its_weights_count_and_loss_and_refuses_anything_else() -> None:
    sent: FeddgMessage = {"w/b": np.ones(2, np.float32), "w/n": np.array(3), "w/a": np.zeros(1, np.float32),
                          "lr": 0.5}
    answer: FeddgMessage = {"w/a": np.array([2.0], np.float32), "w/b": np.array([3.0, 4.0], np.float32),
                            "w/n": np.array(5), "num_examples": 7}
    res = compat.recorddict_to_fitres(fitres_content(sent, answer), keep_input=True)
    got = parameters_to_ndarrays(res.parameters)  # the summed arrays in the order sent, the integer buffer not
    assert len(got) == 2 and np.array_equal(got[0], [3.0, 4.0]) and np.array_equal(got[1], [2.0])
    assert res.num_examples == 7 and np.isnan(res.metrics["train_loss"])  # no loss: NaN, which the server refuses
    with pytest.raises(ValueError, match="the reply holds 'gram/g' beyond weights"):
        fitres_content(sent, {**answer, "gram/g": np.ones(2, np.float32)})


def test_the_workflow_takes_the_configured_secaggplus_settings_and_else_the_largest_clients_examples() -> None:
    cfg = SecAggPlusConfig(num_shares=3, reconstruction_threshold=2, clipping_range=4.0, quantization_range=2**10,
                           modulus_range=2**20)
    got = secagg_server.workflow(cfg, 54.0, 30.0)
    assert (got.num_shares, got.reconstruction_threshold, got.clipping_range, got.quantization_range,
            got.modulus_range, got.max_weight, got.timeout) == (3, 2, 4.0, 2**10, 2**20, 54.0, 30.0)
    assert secagg_server.workflow(cfg.model_copy(update={"max_weight": 100.0}), 54.0, 30.0).max_weight == 100.0


def test_the_secure_mean_is_the_sent_weight_arrays_in_their_dtypes_and_integer_buffers_as_sent() -> None:
    sent: FeddgMessage = {"w/b": np.ones(2, np.float32), "w/n": np.array(3), "w/a": np.zeros(1, np.float16),
                          "lr": 0.5, "round": 1}
    mean = secagg_server.aggregate_message(sent, ndarrays_to_parameters([np.array([0.25, 1.5]), np.array([-2.0])]))
    assert list(mean) == ["w/b", "w/n", "w/a"]  # the config scalars are no weights
    b, a = np.asarray(mean["w/b"]), np.asarray(mean["w/a"])
    assert b.dtype == np.float32 and np.array_equal(b, [0.25, 1.5])
    assert a.dtype == np.float16 and np.array_equal(a, [-2.0])
    assert mean["w/n"] is sent["w/n"]


#: the node ids of the toy's 4 clients
NODES = {0: 1000, 1: 1001, 2: 1002, 3: 1003}


def test_a_secure_round_folds_the_workflows_mean_and_fails_the_client_without_a_masked_reply(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a stand-in for Flower's workflow: it sends FitIns through the strategy and returns the mean (half the sent
    # weights) for clients 0, 1, 2 only, with their counts and losses in the clear
    server = Server(toy_federation_of(toy_config(*SECURE, "federation.rounds=1", "flower.round_timeout_s=7")),
                    tmp_path / "run")
    clients = server.fed.clients
    clients[1] = replace(clients[1], train_idx=clients[1].train_idx[:20])  # the largest client holds 54, not all
    settings: list[tuple[SecAggPlusConfig, float, float]] = []

    def fake_workflow(grid: Grid, context: LegacyContext) -> None:
        strategy = cast(secagg_server.SecureRound, context.strategy)
        fitins = strategy.configure_fit(1, Parameters([], ""), SimpleClientManager())
        sent = strategy.sent[0]
        mean = ndarrays_to_parameters([np.asarray(sent[k]) * 0.5 for k in summed_keys(sent)])
        results = [(proxy, FitRes(Status(Code.OK, ""), mean, n, {"train_loss": loss}))
                   for (proxy, _), n, loss in zip(fitins[:3], (10, 20, 30), (1.0, 2.0, 3.0))]
        strategy.aggregate_fit(1, results, [])

    def workflow(cfg: SecAggPlusConfig, max_weight: float, timeout: float) -> Callable[[Grid, LegacyContext], None]:
        settings.append((cfg, max_weight, timeout))
        return fake_workflow

    monkeypatch.setattr(secagg_server, "workflow", workflow)
    sent = {k: v.copy() for k, v in server.state["weights"].items()}
    rows: list[dict] = []
    secagg_server.run_secure_rounds(server, cast(Grid, None), NODES, rows.append)
    (cfg, max_weight, timeout), = settings  # one workflow for the run: the run's flower.* settings
    assert cfg is server.fed.cfg.flower.secaggplus and (max_weight, timeout) == (54.0, 7.0)
    assert rows[0]["clients"] == 3 and rows[0]["clients_failed_reasons"] == {
        "3": "no masked reply (secure aggregation)"}
    assert rows[0]["train_loss"] == pytest.approx((10 * 1.0 + 20 * 2.0 + 30 * 3.0) / 60)
    for k, v in sent.items():
        np.testing.assert_array_equal(server.state["weights"][k], v * 0.5 if v.dtype.kind == "f" else v, err_msg=k)


def scaled_workflow(scales: dict[int, float], replied: dict[int, int], seen: list[tuple[int, dict[int, int]]]
                    ) -> Callable[[Grid, LegacyContext], None]:
    """A stand-in for Flower's workflow: in round r, the mean ``scales[r]`` x the sent weights for the first
    ``replied[r]`` clients (10 examples, loss 1 each; none: the workflow halted); ``seen`` gets each round's number
    and the commit round each client's FitIns routes."""

    def fake_workflow(grid: Grid, context: LegacyContext) -> None:
        strategy = cast(secagg_server.SecureRound, context.strategy)
        round = int(cast(int, context.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND]))
        fitins = strategy.configure_fit(round, Parameters([], ""), SimpleClientManager())
        routes = [from_fitins(compat.fitins_to_recorddict(ins, True))[1] for _, ins in fitins]
        seen.append((round, {r["client-id"]: r["commit-round"] for r in routes}))
        if replied.get(round, 0) == 0:
            return
        sent = strategy.sent[0]
        mean = ndarrays_to_parameters([np.asarray(sent[k]) * scales[round] for k in summed_keys(sent)])
        strategy.aggregate_fit(round, [(proxy, FitRes(Status(Code.OK, ""), mean, 10, {"train_loss": 1.0}))
                                       for proxy, _ in fitins[:replied[round]]], [])

    return fake_workflow


def test_a_secure_round_routes_each_client_the_last_round_it_committed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # round 1: client 3 sends no masked reply; round 2: the mean x 8 explodes the holdout loss (within the update
    # norm bound, 10 x round 1's), so the round is rolled back; round 3: all four reply
    server = Server(toy_federation_of(toy_config(*SECURE, "federation.rollback_loss_factor=2")), tmp_path / "run")
    seen: list[tuple[int, dict[int, int]]] = []
    fake = scaled_workflow({1: 0.5, 2: 8.0, 3: 0.5}, {1: 3, 2: 4, 3: 4}, seen)
    monkeypatch.setattr(secagg_server, "workflow", lambda cfg, max_weight, timeout: fake)
    rows: list[dict] = []
    secagg_server.run_secure_rounds(server, cast(Grid, None), NODES, rows.append)
    assert [r.get("rolled_back", False) for r in rows] == [False, True, False]
    # nothing committed before round 1; client 3's dropped round-1 reply and round 2's rolled-back replies never are
    assert seen == [(1, {0: 0, 1: 0, 2: 0, 3: 0}), (2, {0: 1, 1: 1, 2: 1, 3: 0}), (3, {0: 1, 1: 1, 2: 1, 3: 0})]


def test_a_resumed_secure_run_goes_on_from_the_round_after_its_checkpoint(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = toy_config(*SECURE, "federation.checkpoint_every=1")
    seen: list[tuple[int, dict[int, int]]] = []
    fake = scaled_workflow(dict.fromkeys([1, 2, 3], 0.5), dict.fromkeys([1, 2, 3], 4), seen)
    monkeypatch.setattr(secagg_server, "workflow", lambda cfg, max_weight, timeout: fake)

    def stop_after_1(row: dict) -> None:
        if row["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        secagg_server.run_secure_rounds(Server(toy_federation_of(cfg), tmp_path / "run"), cast(Grid, None), NODES,
                                        stop_after_1)
    resumed = Server(toy_federation_of(cfg), tmp_path / "run", resume=True)
    secagg_server.run_secure_rounds(resumed, cast(Grid, None), NODES)
    assert [r for r, _ in seen] == [1, 2, 3] and [r["round"] for r in resumed.metrics] == [1, 2, 3]


def test_a_secure_round_whose_workflow_halts_stops_the_run_in_one_line(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # round 1 aggregates; round 2's workflow halts: round 1's results do not stand for round 2's
    server = Server(toy_federation_of(toy_config(*SECURE, "flower.round_timeout_s=5")), tmp_path / "run")
    fake = scaled_workflow({1: 0.5}, {1: 4}, [])
    monkeypatch.setattr(secagg_server, "workflow", lambda cfg, max_weight, timeout: fake)
    with pytest.raises(RunStopped, match=r"^round 2: secure aggregation halted \(fewer than 2 clients, .* within 5 s\)"):
        secagg_server.run_secure_rounds(server, cast(Grid, None), NODES)
    assert server.round == 1
