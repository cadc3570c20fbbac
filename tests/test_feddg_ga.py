"""FedDG-GA: the weight adjustment (both readings) over rounds, the weighted fold, and the client's gap."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.decisive import decisive_argmax
from toy import toy_federation

from feddg.algorithms import Reply, ServerContext
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.feddg_ga import (
    GAP,
    HAS_GAP,
    LOCAL,
    LOCAL_ROUND,
    WEIGHT,
    FedDGGA,
    FedDGGAParams,
    adjust_weights,
    loss_and_score,
)
from feddg.federation.client import client_context
from feddg.federation.validation import check_reply
from feddg.messages import load_weights, weights_of


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
    method = FedDGGA(FedDGGAParams(step=0.4, centre_gaps=centre, gap_at="received"))
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


@pytest.mark.parametrize("gap_at", ["received", "aggregated"])
def test_an_echoed_weight_that_differs_from_the_servers_is_refused(gap_at):
    """The echo is checked with the reply (the client is dropped; it used to end the run in finish)."""
    method = FedDGGA(FedDGGAParams(gap_at=gap_at))
    sent = {"w/t": np.zeros(1, np.float32), WEIGHT: 0.5}
    layout = method.reply_layout(torch.nn.Linear(1, 1), sent, {"w/t": ((1,), np.dtype(np.float32))})
    reply = {"w/t": np.zeros(1, np.float32), "num_examples": 5, WEIGHT: 0.5, GAP: 0.0, HAS_GAP: 1}
    assert check_reply(reply, sent, {}, all_weights=True, beside=layout) is None
    assert check_reply({**reply, WEIGHT: 0.9}, sent, {}, all_weights=True, beside=layout) == "ga_weight is 0.9, sent 0.5"


def _loss_acc(model, ctx):
    model.eval()
    xs, ys = zip(*ctx.batches(shuffle=False, train=False))
    with torch.no_grad():
        logits, y = model(torch.cat(xs)), torch.cat(ys)
    return float(F.cross_entropy(logits, y)), float((decisive_argmax(logits) == y).float().mean())


def test_client_gap_is_the_global_loss_minus_the_local_loss_and_training_is_fedavgs():
    fed = toy_federation("method.name=feddg_ga")
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1, WEIGHT: 0.25}
    global_loss, global_acc = _loss_acc(fed.model, client_context(fed, 0, 1))
    avg, _ = FedAvg().client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    local_loss, local_acc = _loss_acc(fed.model, client_context(fed, 0, 1))
    received = FedDGGAParams(gap_at="received", metric="loss")
    reply, _ = FedDGGA(received).client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    assert reply[GAP] == pytest.approx(global_loss - local_loss, rel=1e-5) and reply[GAP] > 0
    by_acc, _ = FedDGGA(FedDGGAParams(gap_at="received")).client_update(fed.model, dict(msg), {},
                                                                        client_context(fed, 0, 1))
    assert by_acc[GAP] == pytest.approx(100 * (local_acc - global_acc))  # the task's accuracy, in %
    assert reply[WEIGHT] == 0.25
    assert set(reply) == {*(k for k in avg if k.startswith("w/")), "num_examples", "train_loss", WEIGHT, GAP}
    assert all(np.array_equal(reply[k], avg[k]) for k in avg if k.startswith("w/"))  # the gap passes draw nothing


def test_zero_step_with_equal_clients_is_fedavg():
    fed = toy_federation("method.name=feddg_ga")
    sizes = [len(c.train_idx) for c in fed.clients]
    assert len(set(sizes)) == 1
    rng = np.random.default_rng(0)
    w = [rng.normal(size=3).astype(np.float32) for _ in sizes]
    for gap_at in ("received", "aggregated"):
        method = FedDGGA(FedDGGAParams(step=0.0, gap_at=gap_at))
        state = method.server_init(fed.model, ServerContext(len(sizes), 3, 0))
        replies = [Reply(k, {"w/t": w[k], "num_examples": n, WEIGHT: 0.25, GAP: float(k), HAS_GAP: 1})
                   for k, n in enumerate(sizes)]
        ga, _ = method.aggregate(state, replies)
        avg, _ = FedAvg().aggregate({}, replies)
        np.testing.assert_allclose(ga["weights"]["w/t"], avg["weights"]["w/t"], rtol=1e-6)
        np.testing.assert_allclose(ga["ga_weights"], 0.25)



def test_official_timing_adjusts_by_the_last_rounds_gaps_before_aggregating():
    """gap_at: aggregated. Three clients, d = 0.4, R = 4, accuracy gaps, not centred. Round 1 has no gaps: uniform
    weights. Round 2's replies carry round 1's gaps [3, 1, −1] (measured on round 1's aggregate): a moves with round
    1's step d(1 − 1/R) = 0.3 — [1, 1/3, −1/3] · 0.3 + 1/3 = [.6333, .4333, .2333] / 1.3 — and weighs round 2's
    models at once (the official code's order)."""
    method = FedDGGA(FedDGGAParams(step=0.4))
    state = {"weights": {"w/t": np.zeros(1, np.float32)}, "ga_weights": np.full(3, 1 / 3), "round": 0, "rounds": 4}

    def replies(thetas, gaps):
        return [Reply(k, {"w/t": np.array([t], np.float32), "num_examples": 10, WEIGHT: float(state["ga_weights"][k]),
                          GAP: 0.0 if g is None else g, HAS_GAP: int(g is not None)})
                for k, (t, g) in enumerate(zip(thetas, gaps))]

    state, m1 = method.aggregate(state, replies([0.0, 1.0, 2.0], [None, None, None]))
    np.testing.assert_allclose(state["ga_weights"], 1 / 3)
    np.testing.assert_allclose(state["weights"]["w/t"], 1.0, rtol=1e-6)
    assert m1["ga/gaps"] == 0
    state, m2 = method.aggregate(state, replies([3.0, 6.0, 9.0], [3.0, 1.0, -1.0]))
    want = np.array([19, 13, 7]) / 39
    np.testing.assert_allclose(state["ga_weights"], want, rtol=1e-9)
    np.testing.assert_allclose(state["weights"]["w/t"], np.dot(want, [3.0, 6.0, 9.0]), rtol=1e-6)
    assert m2["ga/step"] == pytest.approx(0.3) and m2["ga/gaps"] == 3


def test_official_timing_client_measures_the_new_aggregate_against_its_last_model():
    fed = toy_federation("method.name=feddg_ga")
    method = FedDGGA(FedDGGAParams(metric="loss"))
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1, WEIGHT: 0.25}
    first, state = method.client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    assert first[HAS_GAP] == 0 and state[LOCAL_ROUND] == 1
    local_loss, local_acc = _loss_acc(fed.model, client_context(fed, 0, 1))  # its trained model θ_k^1
    np.testing.assert_allclose(state[LOCAL], [local_loss, 100 * local_acc], rtol=1e-5)  # the task score in %
    aggregate = {k: np.asarray(v * 0.5, dtype=v.dtype) for k, v in first.items() if k.startswith("w/")}  # θ^2
    load_weights(fed.model, aggregate)
    new_loss, _ = _loss_acc(fed.model, client_context(fed, 0, 2))
    second, _ = method.client_update(fed.model, {**aggregate, "lr": 0.1, "round": 2, WEIGHT: 0.25}, state,
                                     client_context(fed, 0, 2))
    assert second[HAS_GAP] == 1 and second[GAP] == pytest.approx(new_loss - local_loss, rel=1e-5)
    stale, _ = method.client_update(fed.model, {**aggregate, "lr": 0.1, "round": 3, WEIGHT: 0.25}, state,
                                    client_context(fed, 0, 3))
    assert stale[HAS_GAP] == 0  # its last model is from round 1, not the aggregate's round: no gap


def test_adjustment_normalises_by_the_largest_absolute_gap_and_clips_above_one():
    a = np.full(2, 0.5)
    # the negative gap dominates: G / max|G| = [−1, 0.5] -> [0.3, 0.6] / 0.9
    np.testing.assert_allclose(adjust_weights(a, {0: -4.0, 1: 2.0}, 0.2, centre=False), [1 / 3, 2 / 3])
    # [0.9, 0.1, 0.5] + 0.5·[1, 0, 0] = [1.4, 0.1, 0.5] -> clipped [1, 0.1, 0.5] / 1.6
    got = adjust_weights(np.array([0.9, 0.1, 0.5]), {0: 1.0, 1: 0.0, 2: 0.0}, 0.5, centre=False)
    np.testing.assert_allclose(got, np.array([1.0, 0.1, 0.5]) / 1.6)


def test_every_weight_clipped_to_zero_is_refused_naming_the_step():
    with pytest.raises(ValueError, match="every aggregation weight was clipped to 0.*lower method.params.step"):
        adjust_weights(np.full(2, 0.5), {0: -1.0, 1: -1.0}, 1.0, centre=False)


def test_a_round_whose_clients_all_weigh_zero_keeps_the_global_model():
    method = FedDGGA(FedDGGAParams(step=0.0, gap_at="received"))
    state = {"weights": {"w/t": np.array([7.0], np.float32)}, "ga_weights": np.array([0.0, 0.5, 0.5]), "round": 0,
             "rounds": 4}
    new, metrics = _round(method, state, [1.0], [2.0])  # client 0 only, a_0 = 0
    assert new["weights"]["w/t"].item() == 7.0 and metrics["ga/skipped"] == 1.0


def test_metrics_of_a_round_by_hand():
    """The rounds test's first round (official normalisation): gaps [3, 1, −1], a = [19, 13, 7] / 39."""
    method = FedDGGA(FedDGGAParams(step=0.4, gap_at="received"))
    state = {"weights": {"w/t": np.zeros(1, np.float32)}, "ga_weights": np.full(3, 1 / 3), "round": 0, "rounds": 4}
    _, m = _round(method, state, [0.0, 1.0, 2.0], [3.0, 1.0, -1.0])
    assert m == pytest.approx({"ga/step": 0.3, "ga/gaps": 3.0, "ga/skipped": 0.0, "ga/weight_max": 19 / 39,
                               "ga/weight_min": 7 / 39, "ga/gap_mean": 1.0})


def test_defaults_start_uniform_and_each_client_is_sent_its_own_weight():
    p = FedDGGAParams()
    assert (p.step, p.gap_at, p.centre_gaps, p.metric) == (pytest.approx(0.2 / 3), "aggregated", False, "score")
    method = FedDGGA(p)
    state = method.server_init(torch.nn.Linear(1, 1), ServerContext(4, 3, 0))
    np.testing.assert_array_equal(state["ga_weights"], np.full(4, 0.25))
    state["ga_weights"] = np.array([0.1, 0.2, 0.3, 0.4])
    assert [method.client_config(state, k, 2)[WEIGHT] for k in range(4)] == [0.1, 0.2, 0.3, 0.4]


def test_the_gap_passes_read_the_training_data_in_eval_mode_without_augmentation(monkeypatch):
    """``loss_and_score`` asks the dataset for un-augmented batches (``train=False``) and runs the model in eval mode;
    its loss is the example-weighted mean over the client's 54 examples (batches of 16, 16, 16, 6)."""
    fed = toy_federation("method.name=feddg_ga")
    flags, get = [], type(fed.dataset).get_batch

    def recording(self, indices, train, generator=None):
        flags.append(train)
        return get(self, indices, train, generator)

    monkeypatch.setattr(type(fed.dataset), "get_batch", recording)
    fed.model.train()
    ctx = client_context(fed, 0, 1)
    loss, score = loss_and_score(fed.model, ctx)
    assert flags == [False] * 4 and not fed.model.training
    want_loss, want_acc = _loss_acc(fed.model, ctx)
    assert loss == pytest.approx(want_loss, rel=1e-5) and score == pytest.approx(100 * want_acc)
