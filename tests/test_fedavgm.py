"""FedAvgM: the server momentum over two hand-computed rounds, FedAvg at β = 0, η_s = 1, and an exact resume."""

import numpy as np
import pytest
from pydantic import ValidationError
from toy import ToyNet, toy_federation

from feddg.algorithms import Reply, ServerContext
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.fedavgm import FedAvgM, FedAvgMParams
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.server import Server


def _replies(p_values, b_values):
    return [Reply(k, {"w/p": np.array([p], np.float32), "w/b": np.array([b], np.float32), "num_examples": n})
            for k, (p, b, n) in enumerate(zip(p_values, b_values, [10, 30]))]


def test_two_rounds_of_server_momentum_by_hand():
    method = FedAvgM(FedAvgMParams(server_lr=0.5, server_momentum=0.9))
    state = {"weights": {"w/p": np.array([1.0], np.float32), "w/b": np.array([0.0], np.float32)},
             "velocity": {"p": np.zeros(1, np.float32)}}
    # round 1: w̄ = (10·2 + 30·4)/40 = 3.5, Δ = 1 − 3.5 = −2.5, v = −2.5, w = 1 − 0.5·(−2.5) = 2.25
    state, metrics = method.aggregate(state, _replies([2.0, 4.0], [1.0, 3.0]))
    np.testing.assert_allclose(state["velocity"]["p"], [-2.5])
    np.testing.assert_allclose(state["weights"]["w/p"], [2.25])
    np.testing.assert_allclose(state["weights"]["w/b"], [2.5])  # buffers: FedAvg
    assert metrics["fedavgm/v_norm"] == pytest.approx(2.5)
    # round 2: w̄ = 4.5, Δ = 2.25 − 4.5 = −2.25, v = 0.9·(−2.5) − 2.25 = −4.5, w = 2.25 − 0.5·(−4.5) = 4.5
    state, _ = method.aggregate(state, _replies([3.0, 5.0], [0.0, 0.0]))
    np.testing.assert_allclose(state["velocity"]["p"], [-4.5])
    np.testing.assert_allclose(state["weights"]["w/p"], [4.5])


def test_zero_momentum_and_unit_server_lr_is_fedavg_bit_for_bit():
    rng = np.random.default_rng(0)
    g = rng.normal(size=5).astype(np.float32)
    replies = [Reply(k, {"w/p": rng.normal(size=5).astype(np.float32), "w/b": rng.normal(size=2).astype(np.float32),
                         "num_examples": n}) for k, n in enumerate([7, 11, 13])]
    state = {"weights": {"w/p": g, "w/b": np.zeros(2, np.float32)}, "velocity": {"p": np.ones(5, np.float32)}}
    m, _ = FedAvgM(FedAvgMParams(server_momentum=0.0)).aggregate(state, replies)
    avg, _ = FedAvg().aggregate(state, replies)
    assert all(np.array_equal(m["weights"][k], avg["weights"][k]) for k in avg["weights"])


def test_a_resumed_run_keeps_the_velocity_and_ends_bit_identical(tmp_path):
    over = ("method.name=fedavgm", "method.params.server_lr=0.7")
    full = Server(toy_federation(*over), tmp_path / "full")
    run_inprocess(full)
    crashed = Server(toy_federation(*over), tmp_path / "crash")
    crashed.mark_setup_done()
    run_round(crashed, 1)
    resumed = Server(toy_federation(*over), tmp_path / "crash", resume=True)
    run_inprocess(resumed)
    for k, v in full.state["velocity"].items():
        assert np.abs(v).sum() > 0 and np.array_equal(v, resumed.state["velocity"][k])
    assert all(np.array_equal(full.state["weights"][k], resumed.state["weights"][k]) for k in full.state["weights"])


def test_defaults_are_the_documented_ones_and_beta_one_or_a_zero_server_lr_is_refused():
    p = FedAvgMParams()
    assert (p.server_lr, p.server_momentum) == (1.0, 0.9)  # docs/methods/fedavgm.md
    for bad in ({"server_momentum": 1.0}, {"server_lr": 0.0}):
        with pytest.raises(ValidationError):
            FedAvgMParams(**bad)


def test_momentum_is_kept_for_the_trainable_parameters_only_and_buffers_are_fedavgs():
    """server_init on a BatchNorm model: velocity for the parameters only; at η_s = 0.5 a parameter moves half way
    from the old weights to the mean (v = 0), a buffer is the FedAvg mean."""
    method = FedAvgM(FedAvgMParams(server_lr=0.5))
    model = ToyNet()
    state = method.server_init(model, ServerContext(2, 3, 0))
    assert set(state["velocity"]) == {n for n, _ in model.named_parameters()}
    rng = np.random.default_rng(0)
    replies = [Reply(k, {**{key: (v + rng.normal(size=v.shape)).astype(v.dtype) for key, v in state["weights"].items()},
                         "num_examples": n}) for k, n in enumerate([10, 30])]
    new, _ = method.aggregate(state, replies)
    avg, _ = FedAvg().aggregate(state, replies)
    for key in ("w/bn.running_mean", "w/bn.running_var", "w/bn.num_batches_tracked"):
        assert np.array_equal(new["weights"][key], avg["weights"][key]), key
    old, mean = state["weights"]["w/bn.weight"], avg["weights"]["w/bn.weight"]
    np.testing.assert_allclose(new["weights"]["w/bn.weight"], (old + mean) / 2, rtol=1e-6, atol=1e-7)
