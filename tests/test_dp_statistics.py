"""dp.py's calibration and per-sample clipping, the StatisticDP defaults docs/privacy.md documents, and FedFA's
statistic noise (§6.2), against formulas written with numpy/scipy/torch in the test."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from feddg.aggregation.dp import StatisticDP, analytic_sigma, clip_samples, gaussian_sigma
from feddg.aggregation.fedfa_stats import add_noise, t_modulation


def _thm8_delta(sigma, eps, sens):
    """Balle & Wang (2018), Thm. 8, with scipy.stats directly."""
    a, b = sens / (2 * sigma), eps * sigma / sens
    return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)


@pytest.mark.parametrize("eps", [0.5, 1.0, 5.0, 10.0])
def test_analytic_sigma_is_on_the_private_side_and_tight_to_1e_7(eps):
    sigma = analytic_sigma(eps, 1e-5, 2.0)
    assert _thm8_delta(sigma, eps, 2.0) <= 1e-5  # the σ returned is (ε, δ)-DP, not one just below the bound
    assert _thm8_delta(sigma * (1 - 1e-7), eps, 2.0) > 1e-5  # and the least such σ to 1e-7


def test_gaussian_sigma_defaults_to_the_analytic_mechanism():
    assert gaussian_sigma(1.0, 1e-5, 1.0) == analytic_sigma(1.0, 1e-5, 1.0)


def test_statistic_dp_defaults_are_the_documented_ones():
    dp = StatisticDP(epsilon=1.0)  # docs/privacy.md: clip 1.0, delta 1e-5, accountant rdp
    assert (dp.clip, dp.delta, dp.accountant) == (1.0, 1e-5, "rdp")


def test_clip_samples_scales_each_sample_as_a_whole_to_frobenius_norm_c():
    x = torch.zeros(2, 2, 2, dtype=torch.float64)
    x[0] = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # ‖X_0‖_F = 5: scaled by 1/5 as a whole (each row alone: 1/3, 1/4)
    x[1] = torch.tensor([[0.1, 0.2], [0.2, 0.4]])  # inside the ball: untouched
    out = clip_samples(x, 1.0)
    torch.testing.assert_close(out[0], x[0] / 5.0)
    torch.testing.assert_close(out[1], x[1], rtol=0, atol=0)


def test_fedfa_statistic_noise_is_the_generators_zero_mean_normal_draw():
    stat = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
    out = add_noise(stat, 0.25, np.random.default_rng(4))
    expected = (stat.astype(np.float64) + np.random.default_rng(4).normal(size=(2, 2)) * 0.25).astype(np.float32)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)


def test_t_modulation_of_two_channels_by_hand():
    # q = Σ²/(1 + Σ²) = (1/2, 3/4); γ = 2 q / (5/4) = (0.8, 1.2)
    np.testing.assert_allclose(t_modulation(np.array([1.0, 3.0])), [0.8, 1.2], rtol=0, atol=1e-12)
