"""FedGMA: the sign-agreement mask (both readings), the masked server step, and what a client sends."""

import numpy as np
import pytest
from toy import toy_federation

from feddg.algorithms import Reply
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.fedgma import SIGN_PREFIX, FedGMA, FedGMAParams, gradient_mask
from feddg.federation.client import client_context
from feddg.messages import weights_of


def test_mask_is_one_above_the_threshold_and_the_agreement_or_zero_below():
    sign_sum = np.array([3.0, 1.0, -1.0, -3.0, 0.0])  # K = 3: A = 1, 1/3, 1/3, 1, 0
    np.testing.assert_allclose(gradient_mask(sign_sum, 3, 0.5, "paper"), [1, 1 / 3, 1 / 3, 1, 0])
    np.testing.assert_allclose(gradient_mask(sign_sum, 3, 0.5, "port"), [1, 0, 0, 1, 0])
    np.testing.assert_allclose(gradient_mask(sign_sum, 3, 1 / 3, "port"), [1, 1, 1, 1, 0])  # A ≥ τ is kept


def _replies(global_w, deltas, counts):
    return [Reply(k, {"w/a": (global_w + d).astype(np.float32), "w/bn.running_mean": np.full(2, float(k), np.float32),
                      SIGN_PREFIX + "a": np.sign(d).astype(np.int8), "num_examples": n})
            for k, (d, n) in enumerate(zip(deltas, counts))]


DELTAS = [np.array([1.0, 2.0, -1.0, 0.5]), np.array([1.0, -1.0, -1.0, -0.5]), np.array([1.0, 2.0, 1.0, 0.0])]
# signs per coordinate: +++ (A=1), +-+ (A=1/3), --+ (A=1/3), +-0 (A=0); equal n: mean Δ = [1, 1, -1/3, 0]


@pytest.mark.parametrize(("mask", "server_lr", "expected"), [
    ("paper", 1.0, [1.0, 1 / 3, -1 / 9, 0.0]),
    ("port", 1.0, [1.0, 0.0, 0.0, 0.0]),
    ("paper", 2.0, [2.0, 2 / 3, -2 / 9, 0.0]),
])
def test_server_step_is_the_masked_mean_update(mask, server_lr, expected):
    g = np.zeros(4, np.float32)
    state = {"weights": {"w/a": g, "w/bn.running_mean": np.zeros(2, np.float32)}, "params": ["a"]}
    method = FedGMA(FedGMAParams(threshold=0.5, mask=mask, server_lr=server_lr))
    new, metrics = method.aggregate(state, _replies(g, DELTAS, [10, 10, 10]))
    np.testing.assert_allclose(new["weights"]["w/a"], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new["weights"]["w/bn.running_mean"], 1.0)  # buffers: FedAvg, never masked
    assert metrics["gma/mask_mean"] == pytest.approx(np.mean(gradient_mask(np.array([3, 1, -1, 0]), 3, 0.5, mask)))


def test_mean_update_is_example_weighted_and_the_agreement_is_not():
    g = np.ones(4, np.float32)
    state = {"weights": {"w/a": g, "w/bn.running_mean": np.zeros(2, np.float32)}, "params": ["a"]}
    new, _ = FedGMA(FedGMAParams(threshold=0.5)).aggregate(state, _replies(g, DELTAS, [10, 10, 20]))
    mean = (10 * DELTAS[0] + 10 * DELTAS[1] + 20 * DELTAS[2]) / 40  # [1, 1.25, -0.25, 0]
    np.testing.assert_allclose(new["weights"]["w/a"], 1 + np.array([1, 1 / 3, 1 / 3, 0]) * mean, rtol=1e-6)


def test_threshold_zero_and_unit_server_lr_is_fedavg_bit_for_bit():
    rng = np.random.default_rng(0)
    g = rng.normal(size=5).astype(np.float32)
    deltas = [rng.normal(size=5) for _ in range(3)]
    replies = _replies(g, deltas, [7, 11, 13])
    state = {"weights": {"w/a": g, "w/bn.running_mean": np.zeros(2, np.float32)}, "params": ["a"]}
    gma, _ = FedGMA(FedGMAParams(threshold=0.0)).aggregate(state, replies)
    avg, _ = FedAvg().aggregate(state, replies)
    assert all(np.array_equal(gma["weights"][k], avg["weights"][k]) for k in avg["weights"])


def test_client_sends_its_weights_and_the_signs_of_its_update():
    fed = toy_federation("method.name=fedgma")
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1}
    reply, state = FedGMA().client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    params = [n for n, _ in fed.model.named_parameters()]
    assert set(reply) == {*msg.keys() - {"lr", "round"}, *(SIGN_PREFIX + n for n in params), "num_examples",
                          "train_loss"}
    for n in params:
        assert reply[SIGN_PREFIX + n].dtype == np.int8
        np.testing.assert_array_equal(reply[SIGN_PREFIX + n], np.sign(reply["w/" + n] - msg["w/" + n]))
    assert state == {}


def test_defaults_are_the_documented_ones() -> None:
    """τ = 0.4, η_s = 1 and the paper's soft mask (docs/methods/fedgma.md)."""
    p = FedGMAParams()
    assert (p.threshold, p.server_lr, p.mask) == (0.4, 1.0, "paper")
