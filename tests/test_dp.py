"""Gaussian mechanism on Gram matrices: clipping, calibration, symmetric noise."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from feddg.aggregation.dp import (
    analytic_delta,
    analytic_sigma,
    basic_composition,
    classic_sigma,
    clip_rows,
    gaussian_sigma,
    gram_sensitivity,
    privatize_gram,
    symmetric_noise,
)


def test_rows_are_clipped_to_the_norm_bound():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(clip_rows(x, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64))


def test_one_clipped_sample_changes_the_gram_by_at_most_c_squared():
    g = torch.Generator().manual_seed(0)
    x = clip_rows(torch.randn(20, 6, generator=g, dtype=torch.float64) * 5, 2.0)
    full, without = x.T @ x, x[1:].T @ x[1:]
    change = torch.linalg.matrix_norm(full - without)  # Frobenius = ‖x_0‖² = C² after clipping
    assert float(change) == pytest.approx(4.0) and gram_sensitivity(2.0) == 4.0


def test_classic_sigma_closed_form():
    assert classic_sigma(1.0, 1e-5, 1.0) == pytest.approx(math.sqrt(2 * math.log(1.25e5)))  # 4.8448
    assert classic_sigma(0.5, 1e-5, 3.0) == pytest.approx(6 * math.sqrt(2 * math.log(1.25e5)))


def test_analytic_sigma_is_the_tightest_sigma_of_balle_and_wang_theorem_8():
    def delta(sigma, eps, sens):  # Thm. 8 written with scipy.stats directly
        return norm.cdf(sens / (2 * sigma) - eps * sigma / sens) - math.exp(eps) * norm.cdf(-sens / (2 * sigma) - eps * sigma / sens)

    for eps in (0.5, 1.0, 5.0, 10.0):
        sigma = analytic_sigma(eps, 1e-5, 2.0)
        assert delta(sigma, eps, 2.0) == pytest.approx(1e-5, rel=1e-6)
        assert analytic_delta(sigma * 0.999, eps, 2.0) > 1e-5
    assert analytic_sigma(1.0, 1e-5, 1.0) < classic_sigma(1.0, 1e-5, 1.0)
    assert analytic_sigma(10.0, 1e-5, 1.0) < analytic_sigma(5.0, 1e-5, 1.0) < analytic_sigma(1.0, 1e-5, 1.0)
    assert gaussian_sigma(1.0, 1e-5, 1.0, "classic") == classic_sigma(1.0, 1e-5, 1.0)
    with pytest.raises(ValueError):
        gaussian_sigma(0.0, 1e-5, 1.0)


def test_gram_noise_is_symmetric_with_variance_sigma_squared_per_entry():
    noise = symmetric_noise(400, 3.0, torch.Generator().manual_seed(0)).numpy()
    assert np.array_equal(noise, noise.T)
    upper = noise[np.triu_indices(400, k=1)]
    assert upper.std() == pytest.approx(3.0, rel=0.02) and np.diag(noise).std() == pytest.approx(3.0, rel=0.15)
    g = torch.eye(400, dtype=torch.float64)
    noisy = privatize_gram(g, 3.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(noisy - g, torch.from_numpy(noise))


def test_basic_composition():
    assert basic_composition(1.0, 1e-5, 6) == (6.0, pytest.approx(6e-5))
