"""FedFA^h math (eqs. 11–14) against hand-computed and closed-form values."""

import math

import numpy as np
import pytest
import torch

from feddg.algorithms.components.soft_histogram import (
    binning_weights,
    cut_points,
    kl_divergence,
    minmax_normalise,
    soft_bin,
    soft_histogram,
    symmetric_kl,
)


def test_paper_cut_points_and_constants_for_eight_bins():
    # ρ = [0, 1, ..., L-2] / (L-2); b = [0, -ρ1, -ρ1-ρ2, ...] (§3.3.1)
    assert torch.allclose(cut_points(8), torch.tensor([0, 1, 2, 3, 4, 5, 6]) / 6)
    w, b = binning_weights(8)
    assert torch.equal(w, torch.arange(1.0, 9.0))
    assert torch.allclose(b, -torch.tensor([0, 0, 1 / 6, 1 / 2, 1, 5 / 3, 5 / 2, 7 / 2]))
    assert torch.allclose(cut_points(4, "interior"), torch.tensor([0.25, 0.5, 0.75]))


def test_cut_points_refuse_too_few_bins_and_unknown_kinds() -> None:
    assert torch.allclose(cut_points(3), torch.tensor([0.0, 1.0]))  # L − 2 = 1: the smallest paper layout
    with pytest.raises(ValueError, match="at least 3 bins"):
        cut_points(2)  # ρ / (L − 2) would divide by zero
    assert torch.allclose(cut_points(2, "interior"), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="at least 2 bins"):
        cut_points(1, "interior")
    with pytest.raises(ValueError, match="unknown cut points 'uniform'"):
        cut_points(8, "uniform")  # type: ignore[arg-type]


def test_soft_histogram_refuses_features_that_are_not_samples_by_channels() -> None:
    with pytest.raises(ValueError, match=r"features must be \[N, C\], got shape \(4, 3, 2\)"):
        soft_histogram(torch.rand(4, 3, 2))


def test_soft_bin_matches_a_hand_computed_softmax():
    # L = 3, paper cut points ρ = [0, 1]: w = [1, 2, 3], b = [0, 0, -1]; ẑ = 0.25, τ = 1
    phi = soft_bin(torch.tensor([[0.25]]), num_bins=3, tau=1.0)[0, 0]
    logits = np.array([0.25, 0.5, 0.75 - 1.0])
    expected = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(phi.numpy(), expected, rtol=1e-6)


def test_soft_bin_sums_to_one_per_sample_and_channel():
    z = torch.rand(50, 7)
    phi = soft_bin(z, num_bins=8, tau=0.01)
    assert phi.shape == (50, 7, 8)
    assert torch.allclose(phi.sum(-1), torch.ones(50, 7), atol=1e-6)
    hist = soft_histogram(torch.randn(50, 7))
    assert hist.shape == (7, 8) and torch.allclose(hist.sum(-1), torch.ones(7), atol=1e-6)


@pytest.mark.parametrize("kind", ["paper", "interior"])
def test_small_temperature_gives_the_hard_histogram(kind):
    g = torch.Generator().manual_seed(0)
    z_hat = torch.rand(400, 3, generator=g)
    rho = cut_points(8, kind)
    # keep points away from the cut points so that the hard bin is unambiguous
    z_hat = z_hat[(z_hat.unsqueeze(-1) - rho).abs().amin(-1).amin(-1) > 0.01]
    soft = soft_bin(z_hat, num_bins=8, tau=1e-4, kind=kind).mean(0)
    hard_idx = torch.searchsorted(rho, z_hat)  # bin k holds ρ_{k-1} < ẑ < ρ_k
    hard = torch.nn.functional.one_hot(hard_idx, 8).float().mean(0)
    assert torch.allclose(soft, hard, atol=1e-4)
    assert not torch.allclose(soft_bin(z_hat, 8, tau=1.0, kind=kind).mean(0), hard, atol=1e-2)  # τ matters


def test_paper_bins_put_the_min_and_max_half_in_the_outer_bins():
    # ẑ = 0 ties bins 1 and 2; ẑ = 1 ties bins 7 and 8 (the first and last cut points are 0 and 1)
    phi = soft_bin(torch.tensor([[0.0], [1.0]]), num_bins=8, tau=1e-3)[:, 0]
    assert torch.allclose(phi[0, :2], torch.tensor([0.5, 0.5]), atol=1e-4)
    assert torch.allclose(phi[1, 6:], torch.tensor([0.5, 0.5]), atol=1e-4)


def test_histogram_uses_the_requested_cut_points():
    # ẑ = [0, 0.3, 0.6, 1], L = 4, τ → 0: interior cuts [¼, ½, ¾] put one sample in each bin; the paper's cuts
    # [0, ½, 1] split the min between bins 1, 2 and the max between bins 3, 4
    z = torch.tensor([[0.0], [0.3], [0.6], [1.0]])
    interior = soft_histogram(z, num_bins=4, tau=1e-4, kind="interior")[0]
    paper = soft_histogram(z, num_bins=4, tau=1e-4, kind="paper")[0]
    assert torch.allclose(interior, torch.tensor([0.25, 0.25, 0.25, 0.25]), atol=1e-4)
    assert torch.allclose(paper, torch.tensor([0.125, 0.375, 0.375, 0.125]), atol=1e-4)


def test_minmax_normalisation_and_constant_channels():
    z = torch.tensor([[1.0, 5.0], [3.0, 5.0], [2.0, 5.0]])
    z_hat = minmax_normalise(z)
    assert torch.allclose(z_hat[:, 0], torch.tensor([0.0, 1.0, 0.5]))
    assert torch.equal(z_hat[:, 1], torch.zeros(3))  # constant channel: 0, not NaN
    assert torch.isfinite(soft_histogram(torch.ones(1, 4))).all()  # a batch of one sample


def test_histogram_is_invariant_to_an_affine_change_of_each_channel():
    z = torch.randn(64, 5)
    assert torch.allclose(soft_histogram(z), soft_histogram(3.0 * z - 2.0), atol=1e-5)


def test_symmetric_kl_closed_form_and_zero_for_identical():
    p = torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[0.25, 0.75]])
    kl_pq = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl_qp = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl_divergence(p, q).item() == pytest.approx(kl_pq, rel=1e-5)
    assert symmetric_kl(p, q).item() == pytest.approx(0.5 * (kl_pq + kl_qp), rel=1e-5)
    h = torch.softmax(torch.randn(4, 8), -1)
    assert symmetric_kl(h, h).item() == 0.0
    # over channels: mean (default) or sum
    pp, qq = torch.cat([p, p]), torch.cat([q, p])
    assert symmetric_kl(pp, qq, "sum").item() == pytest.approx(2 * symmetric_kl(pp, qq, "mean").item())


def test_symmetric_kl_is_finite_with_empty_bins_and_differentiable():
    z = torch.randn(32, 4, requires_grad=True)
    target = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]]).repeat(4, 1)  # empty bins
    loss = symmetric_kl(soft_histogram(z, tau=0.1), target)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0


def _eq12_histogram(z, num_bins, tau):
    """Eqs. 11–12 rebuilt from torch primitives with the paper's cut points ρ = [0, 1, …, L−2] / (L−2)."""
    z_hat = (z - z.min(0).values) / (z.max(0).values - z.min(0).values)
    rho = torch.arange(num_bins - 1, dtype=torch.float32) / (num_bins - 2)
    w = torch.arange(1, num_bins + 1, dtype=torch.float32)
    b = torch.cat([torch.zeros(1), -torch.cumsum(rho, 0)])
    return torch.softmax((z_hat[..., None] * w + b) / tau, dim=-1).mean(0)


def test_defaults_are_eight_paper_bins_at_temperature_0_01():
    # docs/methods/fedfa.md: bins 8, tau 0.01 (L and τ of eq. 12), the paper's cut points
    z = torch.randn(40, 3, generator=torch.Generator().manual_seed(2))
    expected = _eq12_histogram(z, 8, 0.01)
    assert torch.allclose(soft_histogram(z), expected, atol=1e-5)
    assert torch.allclose(soft_bin(minmax_normalise(z)).mean(0), expected, atol=1e-5)
    assert not torch.allclose(_eq12_histogram(z, 8, 0.1), expected, atol=1e-2)  # τ is visible at this size


def test_kl_clamps_empty_bins_at_1e_minus_8():
    # disjoint supports: D_KL(p‖q) = 1 · (log 1 − log 1e-8) = 8 ln 10; the 0 · log 0 terms vanish
    p, q = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert kl_divergence(p, q).item() == pytest.approx(8 * math.log(10), rel=1e-6)
    assert symmetric_kl(p, q).item() == pytest.approx(8 * math.log(10), rel=1e-6)
    # a small but nonzero bin (1e-6 > the clamp) enters the logarithm unchanged
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[1e-6, 1 - 1e-6]])
    exact = 0.5 * math.log(0.5 / 1e-6) + 0.5 * math.log(0.5 / (1 - 1e-6))
    assert kl_divergence(p, q).item() == pytest.approx(exact, rel=1e-5)


def test_default_reduction_over_channels_is_the_mean():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    per_pq = (p * (p.log() - q.log())).sum(-1)
    per_qp = (q * (q.log() - p.log())).sum(-1)
    assert kl_divergence(p, q).item() == pytest.approx(per_pq.mean().item(), rel=1e-6)
    assert symmetric_kl(p, q).item() == pytest.approx((0.5 * (per_pq + per_qp)).mean().item(), rel=1e-6)
