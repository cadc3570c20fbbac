"""MTGC: its two corrections against their closed forms on quadratics through the station topology, the
reset of z every server round, and the configurations it refuses."""

import re
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from toy import Point, quadratic, toy_federation

from feddg.algorithms import ServerContext
from feddg.algorithms.base import Reply
from feddg.algorithms.hfedatm import HFedATMParams
from feddg.algorithms.mtgc import MTGC, Z, corrections_after, station_correction
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.federation.setup import check_topology
from feddg.federation.topology import StationTopology


def test_correction_formulas():
    z = corrections_after([np.array([1.0])], [np.array([2.0])], [np.array([1.5])], h_gamma=0.25)
    np.testing.assert_allclose(z[0], [1.0 + 0.5 / 0.25])
    np.testing.assert_allclose(station_correction(np.array([0.5]), np.array([3.0]), np.array([1.0]), 4.0),
                               [0.5 + 2.0 / 4.0])


class QuadraticMTGC(MTGC):
    loss_fn = staticmethod(quadratic)


def _station_round(fed, topo, method, model, state, cstates: dict, round: int, lr: float,
                   epochs: list[int], clients: Sequence[int] = range(4)) -> tuple[dict, list[Reply]]:
    """One station round of ``clients`` (client k trains ``epochs[k]`` epochs): the new state, the replies."""
    replies = []
    for cid in clients:
        msg = {**topo.client_config(method, state, cid, round), "lr": lr, "round": round}
        ctx = replace(client_context(fed, cid, round), local_epochs=epochs[cid])
        reply, cstates[cid] = topo.client_update(method, model, msg, cstates.get(cid, {}), ctx)
        replies.append(Reply(cid, reply))
    acc = topo.start(method, {r.client_id: r.num_examples for r in replies})
    for r in replies:
        acc = topo.accumulate(method, acc, r)
    state, _ = topo.finish(method, state, acc, round)
    return state, replies


def test_on_quadratics_z_and_y_are_the_gradient_gaps_and_z_resets_every_server_round():
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000")
    a = np.array([float(fed.dataset.x[c.train_idx].mean()) for c in fed.clients])
    n = np.array([len(c.train_idx) for c in fed.clients], dtype=np.float64)
    assert np.ptp(a) > 0.5  # heterogeneous clients
    lr, station_of = 0.1, [0, 0, 1, 1]
    topo = StationTopology(np.asarray(station_of), 2, 1.0, "avg", HFedATMParams(), None)
    method, model = QuadraticMTGC(), Point()
    state = topo.init(method, model, ServerContext(4, 4, 0))
    cstates: dict[int, dict] = {}

    def station_round(round: int, epochs: int) -> list[Reply]:
        nonlocal state
        state, replies = _station_round(fed, topo, method, model, state, cstates, round, lr, [epochs] * 4)
        return replies

    def station_mean(v: np.ndarray) -> np.ndarray:  # n-weighted mean over each client's station
        return np.array([np.average(v[[k for k in range(4) if station_of[k] == station_of[i]]],
                                    weights=n[[k for k in range(4) if station_of[k] == station_of[i]]])
                         for i in range(4)])

    x0 = 3.0
    station_round(1, epochs=1)  # one step from x0, no correction: x_i = x0 − γ(x0 − a_i)
    a_bar = station_mean(a)
    x_bar1 = x0 - lr * (x0 - a_bar)
    replies = station_round(2, epochs=5)  # z_i = (x_i − x̄_j)/γ = a_i − ā_j = ∇f_j(x0) − ∇f_i(x0)
    # float32 weights near 3 (ulp 2.4e-7) differenced and divided by γ = 0.1: agreement to ~1e-5 absolute
    np.testing.assert_allclose([cstates[k][Z + "w"][0] for k in range(4)], a - a_bar, atol=1e-5)
    # corrected gradient (w − a_i) + (a_i − ā_j) = w − ā_j: every client of a station takes its station's GD steps
    x_bar2 = a_bar + (1 - lr) ** 5 * (x_bar1 - a_bar)
    np.testing.assert_allclose([float(r.message["w/w"][0]) for r in replies], x_bar2, rtol=1e-5)
    # server merge (avg, 2 active clients per station) and y_j = (x̄_j − x̄)/(Σ_e Hγ) = (x̄_j − x̄)/(1γ + 5γ)
    merged = x_bar2[[0, 2]].mean()
    np.testing.assert_allclose(state["weights"]["w/w"], [merged], rtol=1e-5)
    y = (x_bar2 - merged) / (6 * lr)
    np.testing.assert_allclose([float(state["stations"][station_of[i]]["y"]["w"][0]) for i in range(4)], y, rtol=1e-4)
    assert all(s["epoch"] == 1 for s in state["stations"])
    # next server round: z reset to 0, y in use: one step from the merged model with gradient (w − a_i) + y_j
    replies = station_round(3, epochs=1)
    np.testing.assert_allclose([float(r.message["w/w"][0]) for r in replies], merged - lr * (merged - a + y),
                               rtol=1e-5)
    assert all(float(cstates[k][Z + "w"][0]) == 0.0 for k in range(4))
    # its second station round closes it: y_j moves by (x̄_j − x̄)/(Σ_e Hγ) over this server round only, (1 + 2)γ
    replies = station_round(4, epochs=2)
    x_bar4 = station_mean(np.array([float(r.message["w/w"][0]) for r in replies]))
    merged = x_bar4[[0, 2]].mean()
    np.testing.assert_allclose(state["weights"]["w/w"], [merged], rtol=1e-5)
    np.testing.assert_allclose([float(state["stations"][station_of[i]]["y"]["w"][0]) for i in range(4)],
                               y + (x_bar4 - merged) / (3 * lr), rtol=1e-4)


def test_a_client_that_missed_the_last_station_round_keeps_its_correction():
    """Four station rounds per server round, client 0 out of the third: at the fourth its z_0 is still a_0 − ā_0 from
    the second (its last model is two station rounds old: no gradient gap to read from it)."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000")
    a = np.array([float(fed.dataset.x[c.train_idx].mean()) for c in fed.clients])
    lr, station_of = 0.1, [0, 0, 1, 1]
    topo = StationTopology(np.asarray(station_of), 4, 1.0, "avg", HFedATMParams(), None)
    method, model = QuadraticMTGC(), Point()
    state = topo.init(method, model, ServerContext(4, 4, 0))
    cstates: dict[int, dict] = {}
    for rnd, clients in ((1, [0, 1, 2, 3]), (2, [0, 1, 2, 3]), (3, [1, 2, 3]), (4, [0, 1, 2, 3])):
        state, _ = _station_round(fed, topo, method, model, state, cstates, rnd, lr, [1] * 4, clients)
        if rnd == 2:  # z_i = (x_i − x̄_j)/γ after one step from x0 = a_i − ā_j (equal n)
            np.testing.assert_allclose(float(cstates[0][Z + "w"][0]), a[0] - a[:2].mean(), atol=1e-5)
    np.testing.assert_allclose(float(cstates[0][Z + "w"][0]), a[0] - a[:2].mean(), atol=1e-5)
    assert cstates[0]["round"] == 4
    # the others' z_i accumulate, z_i + (x_i − x̄_j)/γ with a gap of 0 (a station's corrected clients move together):
    # still a_i − ā_j, not reset to the last gap
    np.testing.assert_allclose([float(cstates[k][Z + "w"][0]) for k in (1, 2, 3)],
                               a[1:] - np.array([a[:2].mean(), a[2:].mean(), a[2:].mean()]), atol=1e-5)


def test_a_station_that_did_not_train_this_server_round_keeps_its_y() -> None:
    """``Σ_e Hγ = 0`` (no client of the station trained): ``y_j`` stays (no drift to read: 0/0), the station takes
    the merged model and starts a new server round; a trained station moves ``y_j`` by ``(x̄_j − x̄)/(Σ_e Hγ)``."""
    station = {"weights": {"w/w": np.array([1.0], np.float32)}, "y": {"w": np.array([0.5], np.float32)},
               "h_gamma_sum": 0.0, "h_gamma_station": 0.0, "epoch": 2}
    merged = {"w/w": np.array([3.0], np.float32)}
    idle = MTGC().station_merged(station, merged)
    np.testing.assert_array_equal(idle["y"]["w"], [0.5])
    assert idle["weights"] is merged and idle["epoch"] == 3 and idle["h_gamma_sum"] == 0.0
    trained = MTGC().station_merged({**station, "h_gamma_sum": 0.5}, merged)
    np.testing.assert_allclose(trained["y"]["w"], [0.5 + (1.0 - 3.0) / 0.5])


_HIER = ("method.name=mtgc", "optim.momentum=0", "hierarchy.stations=2", "hierarchy.station_rounds=2",
         "federation.rounds=2")


@pytest.mark.parametrize(("overrides", "message"), [
    (("method.name=mtgc",), "mtgc is a hierarchical method: it needs a hierarchy: section with merge avg"),
    ((*_HIER, "hierarchy.merge=hfedatm-no-fot"), "(got 'hfedatm-no-fot')"),
    ((*_HIER, "hierarchy.params.client_pull=global"), "drop hierarchy.params.client_pull"),
])
def test_refused_configurations(overrides, message):
    fed = toy_federation(*overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_topology(fed.method, fed.cfg)  # build_federation's check, before any data is loaded


def test_refuses_momentum(tmp_path):
    with pytest.raises(Exception, match="plain SGD"):
        run_inprocess(Server(toy_federation(*_HIER, "optim.momentum=0.9", "federation.min_clients=4"), tmp_path))


def test_resume_is_bit_identical(tmp_path):
    full = Server(toy_federation(*_HIER), tmp_path / "full")
    run_inprocess(full)
    crashed = Server(toy_federation(*_HIER), tmp_path / "crash")
    crashed.mark_setup_done()
    for t in (1, 2, 3):  # killed inside the second server round: z in the client states, y in the stations
        run_round(crashed, t)
    resumed = Server(toy_federation(*_HIER), tmp_path / "crash", resume=True)
    run_inprocess(resumed)
    assert all(np.array_equal(full.state["weights"][k], resumed.state["weights"][k]) for k in full.state["weights"])
    assert np.isfinite(full.metrics[-1]["mtgc/h_gamma"])


@pytest.mark.parametrize("z_step", ["client", "station"])
def test_with_unequal_step_counts_only_the_station_step_keeps_a_stations_corrections_summing_to_zero(z_step):
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000",
                         "partition.kind=dirichlet_labels", "partition.params.alpha=1")
    n = np.array([len(c.train_idx) for c in fed.clients], dtype=np.float64)
    assert n[0] != n[1]  # unequal clients: the station's n-weighted mean Hγ is not the plain one
    lr, station_of, epochs = 0.1, [0, 0, 1, 1], [1, 4, 2, 2]  # station 0's clients take 1 and 4 steps
    topo = StationTopology(np.asarray(station_of), 2, 1.0, "avg", HFedATMParams(), None)
    method, model = QuadraticMTGC(MTGC.Params(z_step=z_step)), Point()
    state = topo.init(method, model, ServerContext(4, 4, 0))
    cstates: dict[int, dict] = {}
    state, replies = _station_round(fed, topo, method, model, state, cstates, 1, lr, epochs)
    # z_i is updated at the start of station round 2, from round 1's models and steps: (x_i − x̄_j)/(Hγ)
    state, replies2 = _station_round(fed, topo, method, model, state, cstates, 2, lr, epochs)
    z = np.array([float(cstates[k][Z + "w"][0]) for k in range(4)])
    x1 = np.array([float(r.message["w/w"][0]) for r in replies])
    mine = [[k for k in range(4) if station_of[k] == station_of[i]] for i in range(4)]
    x_bar = np.array([np.average(x1[m], weights=n[m]) for m in mine])
    steps = lr * np.array(epochs, dtype=np.float64)  # one full-batch step an epoch
    h_gamma = steps if z_step == "client" else np.array([np.average(steps[m], weights=n[m]) for m in mine])
    np.testing.assert_allclose(z, (x1 - x_bar) / h_gamma, rtol=1e-4)
    station0 = float(n[0] * z[0] + n[1] * z[1]) / float(np.abs(n[:2] * z[:2]).sum())  # relative to the terms
    station1 = float(n[2] * z[2] + n[3] * z[3]) / float(np.abs(n[2:] * z[2:]).sum())
    assert abs(station1) < 1e-4  # equal steps: both readings are the gradient gap (float32 weights differenced)
    assert (abs(station0) < 1e-4) == (z_step == "station")  # own Hγ with 1 and 4 steps: they do not
    # the server merge closes round 2: y_j = (x̄_j − x̄)/(Σ_e Hγ), each station round's Hγ the plain mean over its
    # clients (station 0: (1 + 4)γ/2 per round), not the n-weighted one that z_step: station uses
    x2 = np.array([float(r.message["w/w"][0]) for r in replies2])
    x_bar2 = np.array([np.average(x2[m], weights=n[m]) for m in mine])
    merged = x_bar2[[0, 2]].mean()  # avg merge: two active clients per station
    np.testing.assert_allclose(state["weights"]["w/w"], [merged], rtol=1e-5)
    h_e_gamma = 2 * np.array([steps[m].mean() for m in mine])
    np.testing.assert_allclose([float(state["stations"][station_of[i]]["y"]["w"][0]) for i in range(4)],
                               (x_bar2 - merged) / h_e_gamma, rtol=1e-4)
