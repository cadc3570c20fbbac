"""FedRC (reconstructed): Bhattacharyya distances and mixtures against closed forms, the edge and cloud weights
through the station topology, the data-volume limit (HFedAvg), and runs end to end."""

import math

import numpy as np
import pytest
import torch
from toy import toy_federation

from feddg.algorithms import ServerContext
from feddg.algorithms.base import Reply
from feddg.algorithms.fedrc import (
    MEAN,
    N_EFF,
    VAR,
    WEIGHT,
    FedRC,
    FedRCParams,
    N,
    bhattacharyya,
    image_gaussians,
    mixture,
)
from feddg.engines.inprocess import run_inprocess
from feddg.federation.client import client_context
from feddg.federation.server import Server

HIER = ("method.name=fedrc", "hierarchy.stations=2", "hierarchy.station_rounds=2", "federation.rounds=2")


def test_bhattacharyya_closed_form():
    # N(0, 1) vs N(2, 3): (2²)/(4·4) + ½ ln(4 / (2√3))
    want = 0.25 + 0.5 * math.log(4 / (2 * math.sqrt(3)))
    assert bhattacharyya(np.array([0.0]), np.array([1.0]), np.array([2.0]), np.array([3.0])) == pytest.approx(want, 1e-5)
    two = bhattacharyya(np.array([0.0, 0.0]), np.array([1.0, 1.0]), np.array([2.0, 0.0]), np.array([3.0, 1.0]))
    assert two == pytest.approx(want, 1e-5)  # a second, identical channel adds D_B = 0
    a, b = (np.array([0.3, -1.0]), np.array([0.5, 2.0])), (np.array([1.0, 0.0]), np.array([1.5, 0.2]))
    assert bhattacharyya(*a, *b) == pytest.approx(bhattacharyya(*b, *a))


def test_mixture_and_image_moments():
    mean, var = mixture(np.array([[0.0], [2.0]]), np.array([[1.0], [1.0]]), [1, 1])
    np.testing.assert_allclose([mean[0], var[0]], [1.0, 2.0])  # E[x] = 1; E[x²] − 1 = (1 + 0 + 1 + 4)/2 − 1
    mean, var = mixture(np.array([[0.0], [2.0]]), np.array([[1.0], [1.0]]), [3, 1])
    np.testing.assert_allclose([mean[0], var[0]], [0.5, 1.0 + 0.75 * 0.25 * 4])  # σ² + p(1−p)Δ²
    x = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]], [[1.0, 1.0], [1.0, 1.0]]]])  # one 2-channel 2×2 image
    m, v = image_gaussians(x)
    np.testing.assert_allclose(m.numpy(), [[1.5, 1.0]])
    np.testing.assert_allclose(v.numpy(), [[1.25, 0.0]])


def _setup(fed, method):
    state = fed.topology.init(method, fed.model, ServerContext(len(fed.clients), 4, 0))
    request = fed.topology.setup_request(method, state)
    replies, cstates = [], {}
    for cid in range(len(fed.clients)):
        reply, cstates[cid] = method.client_setup(fed.model, request, {}, client_context(fed, cid, 0))
        replies.append(Reply(cid, reply))
    return fed.topology.server_setup(method, state, replies), replies, cstates


def test_edge_and_cloud_weights_are_the_documented_formulas():
    fed = toy_federation(*HIER)
    method = fed.method
    state, replies, cstates = _setup(fed, method)
    msgs = {r.client_id: r.message for r in replies}
    for cid, c in enumerate(fed.clients):  # ñ_i = Σ_m exp(−D_B(N_m, N_i)), N_i the mixture of its images
        x = fed.dataset.x[torch.from_numpy(c.train_idx)]
        mu_m, var_m = x.double().flatten(2).mean(2).numpy(), x.double().flatten(2).var(2, unbiased=False).numpy()
        mean, var = mu_m.mean(0), (var_m + mu_m**2).mean(0) - mu_m.mean(0) ** 2
        np.testing.assert_allclose(msgs[cid][MEAN], mean, rtol=1e-9)
        np.testing.assert_allclose(msgs[cid][VAR], var, rtol=1e-9)
        assert msgs[cid][N] == len(c.train_idx)
        assert msgs[cid][N_EFF] == pytest.approx(np.exp(-bhattacharyya(mu_m, var_m, mean, var)).sum(), rel=1e-9)
        assert 0 < msgs[cid][N_EFF] < len(c.train_idx)
    topo = fed.topology
    members = {e: [c for c in range(4) if topo.station_of(c) == e] for e in range(2)}

    def gaussian(ids):
        n = np.array([msgs[c][N] for c in ids], dtype=np.float64)
        mu = np.stack([msgs[c][MEAN] for c in ids])
        second = np.stack([msgs[c][VAR] + msgs[c][MEAN] ** 2 for c in ids])
        mean = (n[:, None] * mu).sum(0) / n.sum()
        return mean, (n[:, None] * second).sum(0) / n.sum() - mean**2

    glob = gaussian(range(4))
    for e, ids in members.items():
        station = state["stations"][e]
        np.testing.assert_allclose(station["station_mean"], gaussian(ids)[0], rtol=1e-9)
        want = sum(msgs[c][N_EFF] for c in ids) * np.exp(-bhattacharyya(*gaussian(ids), *glob))
        assert method.station_weight(station, 2) == pytest.approx(want, rel=1e-9)
        for c in ids:  # the client's reply weight: ñ_i exp(−D_B(N_i, N_j))
            msg = {**topo.client_config(method, state, c, 1), "lr": 0.0, "round": 1}
            reply, _ = method.client_update(fed.model, msg, cstates[c], client_context(fed, c, 1))
            assert reply[WEIGHT] == pytest.approx(msgs[c][N_EFF] * np.exp(-bhattacharyya(
                msgs[c][MEAN], msgs[c][VAR], *gaussian(ids))), rel=1e-9)


def test_the_station_mean_is_weighted_by_the_replied_weights():
    method = FedRC()
    acc = method.start(30.0)
    for w, value in ((1.0, 0.0), (3.0, 4.0)):
        acc = method.accumulate(acc, Reply(0, {"w/a": np.array([value], np.float32), "num_examples": 15, WEIGHT: w}))
    _, _ = method.finish({"weights": {}}, acc)
    np.testing.assert_allclose(method.finish({"weights": {}}, acc)[0]["weights"]["w/a"], [3.0])


def test_without_image_weighting_at_large_temperature_it_is_hfedavg_by_volume():
    fed = toy_federation(*HIER)
    method = FedRC(FedRCParams(image_weighting=False, temperature=1e12))
    state, replies, cstates = _setup(fed, method)
    for e in range(2):
        ids = [c for c in range(4) if fed.topology.station_of(c) == e]
        volume = sum(len(fed.clients[c].train_idx) for c in ids)
        assert method.station_weight(state["stations"][e], 2) == pytest.approx(volume)
        for c in ids:
            msg = {**fed.topology.client_config(method, state, c, 1), "lr": 0.0, "round": 1}
            reply, _ = method.client_update(fed.model, msg, cstates[c], client_context(fed, c, 1))
            assert reply[WEIGHT] == pytest.approx(len(fed.clients[c].train_idx))


def test_without_image_weighting_each_image_counts_one_at_the_default_temperature() -> None:
    """``image_weighting: false``: ``ñ_i = n_i`` (at τ = 1, where image weighting gives ``ñ_i < n_i``), and the edge
    weight is ``n_i exp(−D_B(N_i, N_j))`` with ``N_j`` the station's Gaussian sent to the client."""
    fed = toy_federation(*HIER)
    method = FedRC(FedRCParams(image_weighting=False))
    state, replies, cstates = _setup(fed, method)
    for r in replies:
        c = r.client_id
        n = len(fed.clients[c].train_idx)
        assert r.message[N_EFF] == n
        msg = {**fed.topology.client_config(method, state, c, 1), "lr": 0.0, "round": 1}
        station = state["stations"][fed.topology.station_of(c)]
        reply, _ = method.client_update(fed.model, msg, cstates[c], client_context(fed, c, 1))
        distance = bhattacharyya(r.message[MEAN], r.message[VAR], station["station_mean"], station["station_var"])
        assert distance > 0 and reply[WEIGHT] == pytest.approx(n * math.exp(-distance), rel=1e-9)


def test_runs_end_to_end_and_refuses_a_flat_federation(tmp_path):
    from feddg.federation.setup import check_topology

    server = Server(toy_federation(*HIER), tmp_path / "run")
    results = run_inprocess(server)
    assert math.isfinite(results["final"]["ood_acc"]) and len(server.metrics) == 4
    fed = toy_federation("method.name=fedrc")
    with pytest.raises(ValueError, match="fedrc is a hierarchical method"):
        check_topology(fed.method, fed.cfg)
