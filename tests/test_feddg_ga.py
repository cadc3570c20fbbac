"""FedDG-GA: the weight adjustment (both readings) over rounds, the weighted fold, and the client's gap."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import toy_federation

from feddg.algorithms import Reply, ServerContext
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.feddg_ga import GAP, WEIGHT, FedDGGA, FedDGGAParams, adjust_weights
from feddg.federation.client import client_context
from feddg.messages import weights_of


def test_adjustment_centres_normalises_clips_and_renormalises():
    a = np.full(4, 0.25)
    gaps = {0: 0.4, 1: 0.2, 2: 0.1, 3: 0.1}
    # centred: G − Ḡ = [0.2, 0, −0.1, −0.1], / 0.2 -> [1, 0, −0.5, −0.5]
    np.testing.assert_allclose(adjust_weights(a, gaps, 0.1, centre=True), [0.35, 0.25, 0.2, 0.2])
    # official: G / max|G| = [1, 0.5, 0.25, 0.25] -> [0.35, 0.3, 0.275, 0.275] / 1.2
    np.testing.assert_allclose(adjust_weights(a, gaps, 0.1, centre=False), np.array([0.35, 0.3, 0.275, 0.275]) / 1.2)
    np.testing.assert_allclose(adjust_weights(a, {0: 1.0, 1: 1.0}, 0.1, centre=True), a)  # equal gaps: no move
    np.testing.assert_allclose(adjust_weights(a, {2: 5.0}, 0.1, centre=False), np.array([.25, .25, .35, .25]) / 1.1)


def _round(method, state, thetas, gaps):
    replies = [Reply(k, {"w/t": np.array([t], np.float32), "num_examples": 10, WEIGHT: float(state["ga_weights"][k]),
                         GAP: g}) for k, (t, g) in enumerate(zip(thetas, gaps))]
    return method.aggregate(state, replies)


# three clients, d = 0.4 over R = 4 rounds: steps d(1 − r/R) = 0.3, 0.2; the same gaps [3, 1, −1] twice
@pytest.mark.parametrize(("centre", "after1", "after2"), [
    # centred: [1, 0, −1]; round 1 -> [1/3 + .3, 1/3, 1/3 − .3]; round 2 -> [.8333, .3333, −.1667 -> 0] / 1.1667
    (True, [1 / 3 + 0.3, 1 / 3, 1 / 3 - 0.3], [5 / 7, 2 / 7, 0.0]),
    # official: [1, 1/3, −1/3]; round 1 -> [.6333, .4333, .2333] / 1.3; round 2 adds .2·[1, 1/3, −1/3], / 1.2
    (False, np.array([19, 13, 7]) / 39, (np.array([19, 13, 7]) / 39 + 0.2 * np.array([1, 1 / 3, -1 / 3])) / 1.2),
])
def test_weights_over_rounds_and_the_weighted_model(centre, after1, after2):
    method = FedDGGA(FedDGGAParams(step=0.4, centre_gaps=centre))
    state = {"weights": {"w/t": np.zeros(1, np.float32)}, "ga_weights": np.full(3, 1 / 3), "round": 0, "rounds": 4}
    thetas = [0.0, 1.0, 2.0]
    state, m1 = _round(method, state, thetas, [3.0, 1.0, -1.0])
    np.testing.assert_allclose(state["ga_weights"], after1, rtol=1e-9)
    np.testing.assert_allclose(state["weights"]["w/t"], 1.0, rtol=1e-6)  # uniform weights: the mean
    assert m1["ga/step"] == pytest.approx(0.3)
    state, m2 = _round(method, state, thetas, [3.0, 1.0, -1.0])
    np.testing.assert_allclose(state["ga_weights"], after2, rtol=1e-9)
    np.testing.assert_allclose(state["weights"]["w/t"], np.dot(after1, thetas), rtol=1e-6)  # round 1's weights
    assert m2["ga/step"] == pytest.approx(0.2) and state["round"] == 2


def test_an_echoed_weight_that_differs_from_the_servers_is_refused():
    state = {"weights": {"w/t": np.zeros(1, np.float32)}, "ga_weights": np.full(2, 0.5), "round": 0, "rounds": 4}
    replies = [Reply(k, {"w/t": np.zeros(1, np.float32), "num_examples": 5, WEIGHT: w, GAP: 0.0})
               for k, w in enumerate([0.5, 0.9])]
    with pytest.raises(ValueError, match="client 1 echoed"):
        FedDGGA().aggregate(state, replies)


def _loss_acc(model, ctx):
    model.eval()
    xs, ys = zip(*ctx.batches(shuffle=False, train=False))
    with torch.no_grad():
        logits, y = model(torch.cat(xs)), torch.cat(ys)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def test_client_gap_is_the_global_loss_minus_the_local_loss_and_training_is_fedavgs():
    fed = toy_federation("method.name=feddg_ga")
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1, WEIGHT: 0.25}
    global_loss, global_acc = _loss_acc(fed.model, client_context(fed, 0, 1))
    avg, _ = FedAvg().client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    local_loss, local_acc = _loss_acc(fed.model, client_context(fed, 0, 1))
    reply, _ = FedDGGA().client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    assert reply[GAP] == pytest.approx(global_loss - local_loss, rel=1e-5) and reply[GAP] > 0
    by_acc, _ = FedDGGA(FedDGGAParams(metric="accuracy")).client_update(fed.model, dict(msg), {},
                                                                        client_context(fed, 0, 1))
    assert by_acc[GAP] == pytest.approx(local_acc - global_acc)
    assert reply[WEIGHT] == 0.25
    assert set(reply) == {*(k for k in avg if k.startswith("w/")), "num_examples", "train_loss", WEIGHT, GAP}
    assert all(np.array_equal(reply[k], avg[k]) for k in avg if k.startswith("w/"))  # the gap passes draw nothing


def test_zero_step_with_equal_clients_is_fedavg():
    fed = toy_federation("method.name=feddg_ga")
    sizes = [len(c.train_idx) for c in fed.clients]
    assert len(set(sizes)) == 1
    rng = np.random.default_rng(0)
    w = [rng.normal(size=3).astype(np.float32) for _ in sizes]
    state = FedDGGA(FedDGGAParams(step=0.0)).server_init(fed.model, ServerContext(len(sizes), 3, 4, 0))
    replies = [Reply(k, {"w/t": w[k], "num_examples": n, WEIGHT: 0.25, GAP: float(k)}) for k, n in enumerate(sizes)]
    ga, _ = FedDGGA(FedDGGAParams(step=0.0)).aggregate(state, replies)
    avg, _ = FedAvg().aggregate({}, replies)
    np.testing.assert_allclose(ga["weights"]["w/t"], avg["weights"]["w/t"], rtol=1e-6)
    np.testing.assert_allclose(ga["ga_weights"], 0.25)

