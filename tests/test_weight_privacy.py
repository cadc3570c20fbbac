"""The server's DP-FedAvg state (``federation/weight_privacy.py``) against formulas rebuilt by hand: which sums get
noise and how much, how the adaptive clip moves, what is listed as sent in the clear, and results.json's record.
The formulas themselves (clipping, ``noise_std``, ``next_clip``) are tested in ``tests/test_dp_weights.py``."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, NeighboringRelation, SampledWithoutReplacementDpEvent
from dp_accounting.rdp import RdpAccountant

from feddg.aggregation.mean import WeightedSum
from feddg.algorithms.base import Accumulator
from feddg.config import WeightDPConfig
from feddg.federation.weight_privacy import NOISE_STREAM, WeightPrivacy
from feddg.seeds import derived_seed


def _round(priv: WeightPrivacy, examples: list[int], round: int = 1, sampled: int | None = None):
    """A round of zero updates (a float array and an integer counter of 5) from clients of ``examples`` through the
    server's noise: returns the noised mean and the round's metrics."""
    acc = Accumulator(WeightedSum("w/", sum(examples)))
    for n in examples:
        acc.weights.add({"w/x": np.zeros(6, np.float32), "w/n": np.array(5, np.int64)}, n)
    metrics = priv.add_noise(acc, round, examples, len(examples) if sampled is None else sampled)
    return acc.weights.mean(), metrics


def test_integer_arrays_get_no_noise_even_when_it_is_large() -> None:
    priv = WeightPrivacy(WeightDPConfig(noise_multiplier=8.0, clip=1.0), num_clients=1, fraction=1.0, seed=5)
    mean, metrics = _round(priv, [10])
    assert metrics["dp_weights/noise_std"] == 8.0  # z·C·max p = 8·1·1: rounding would not hide it
    assert mean["w/n"] == 5
    expected = np.random.default_rng(derived_seed(5, 1, NOISE_STREAM)).normal(0.0, 8.0, 6).astype(np.float32)
    np.testing.assert_array_equal(mean["w/x"], expected)


def test_adaptive_clipping_noises_the_weights_with_the_split_multiplier() -> None:
    """Andrew et al. Thm. 1: with the count noised at σ_b, the weights get z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)."""
    cfg = WeightDPConfig(noise_multiplier=1.0, clip=0.5, adaptive={"count_std": 1.0})
    priv = WeightPrivacy(cfg, num_clients=4, fraction=1.0, seed=0)
    priv.begin()
    _, metrics = _round(priv, [3, 3, 3, 3])
    z_weights = (1.0**-2 - (2 * 1.0) ** -2) ** -0.5
    assert metrics["dp_weights/noise_std"] == pytest.approx(z_weights * 0.5 / 4, rel=1e-12)


def test_the_adaptive_clip_moves_by_the_share_of_the_clients_sent_to_this_round() -> None:
    cfg = WeightDPConfig(noise_multiplier=0.0, clip=2.0, adaptive={"target_quantile": 0.5, "clip_lr": 0.2})
    priv = WeightPrivacy(cfg, num_clients=4, fraction=1.0, seed=0)  # 4 planned, 2 sent to this round
    priv.begin()
    priv.unclipped = 2
    metrics = priv.add_noise(Accumulator(WeightedSum("w/", 2)), 1, [1, 1], sampled=2)
    assert metrics["dp_weights/unclipped_noised"] == 1.0  # z = 0: the count is not noised
    priv.commit()
    assert priv.clip == pytest.approx(2.0 * math.exp(-0.2 * (2 / 2 - 0.5)), rel=1e-15)


def test_only_payloads_beside_the_weights_num_examples_and_train_loss_are_listed_and_each_warned_once(caplog):
    priv = WeightPrivacy(WeightDPConfig(noise_multiplier=1.0, clip=1.0), num_clients=2, fraction=1.0, seed=0)
    reply = {"w/x": np.zeros(1), "num_examples": 3, "train_loss": 0.5, "bn/mean": np.zeros(1), "bn/var": np.ones(1)}
    with caplog.at_level(logging.WARNING, logger="feddg.federation.weight_privacy"):
        priv.note_clear(reply, "replies")
        priv.note_clear(reply, "replies")  # nothing new: no second warning
        priv.note_clear({**reply, "dc/x": np.zeros(1)}, "setup replies")
    assert priv.uncovered == {"bn", "dc"}
    assert [r.getMessage().split(" carry ")[-1] for r in caplog.records] == ["bn in the clear", "bn, dc in the clear"]
    assert "setup replies" in caplog.records[-1].getMessage()


def test_the_record_accounts_replace_one_sampling_without_replacement_at_half_z_and_the_configured_delta() -> None:
    cfg = WeightDPConfig(noise_multiplier=1.2, clip=0.7, delta=1e-6)
    record = WeightPrivacy(cfg, num_clients=10, fraction=0.3, seed=0).record(7)
    acc = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(SampledWithoutReplacementDpEvent(10, 3, GaussianDpEvent(0.6)), 7)  # m = round(0.3·10) of K = 10
    assert record["epsilon"] == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    assert (record["sampled"], record["clients"], record["releases"]) == (3, 10, 7)
    assert record["sampling_rate"] == pytest.approx(0.3, abs=1e-15)
    assert record["noise_multiplier_accounted"] == 0.6 and record["noise_multiplier_weights"] == 1.2
    assert record["delta"] == 1e-6 and record["clip"] == record["clip_final"] == 0.7 and record["adaptive"] is False


def test_clipping_only_has_no_epsilon() -> None:
    record = WeightPrivacy(WeightDPConfig(noise_multiplier=0.0, clip=1.0), 4, 1.0, 0).record(3)
    assert record["epsilon"] is None and record["noise_multiplier_accounted"] == 0.0


def test_a_round_without_a_running_weighted_sum_of_the_weights_is_refused() -> None:
    priv = WeightPrivacy(WeightDPConfig(noise_multiplier=1.0, clip=1.0), num_clients=2, fraction=1.0, seed=0)
    for acc in (Accumulator(None), {"w/x": np.zeros(1)}):  # a method that does not average the weights; not a fold
        with pytest.raises(ValueError, match="no running weighted sum of the weights to noise"):
            priv.add_noise(acc, 1, [1, 1], 2)
