"""Gaussian mechanism on Gram matrices (clipping, calibration, symmetric noise), client-level DP of a shared
statistic (joint clipping, noise) and the run's ε from dp-accounting."""

import math

import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy.stats import norm
from support.dp_reference import accounted_gaussian, analytic_gaussian_epsilon
from torch import nn

from feddg.aggregation.accounting import gaussian_epsilon, privacy_record, statistic_privacy
from feddg.aggregation.dp import (
    Mechanism,
    StatisticDP,
    analytic_delta,
    analytic_sigma,
    basic_composition,
    classic_sigma,
    clip_rows,
    gaussian_sigma,
    gram_sensitivity,
    privatize,
    privatize_gram,
    symmetric_noise,
)
from feddg.algorithms.hfedatm import GramRecorder
from feddg.config import ConfigError, build_config


def test_rows_are_clipped_to_the_norm_bound():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(clip_rows(x, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64))


def test_one_clipped_sample_changes_the_gram_by_at_most_c_squared():
    g = torch.Generator().manual_seed(0)
    x = clip_rows(torch.randn(20, 6, generator=g, dtype=torch.float64) * 5, 2.0)
    full, without = x.T @ x, x[1:].T @ x[1:]
    change = torch.linalg.matrix_norm(full - without)  # Frobenius = ‖x_0‖² = C² after clipping
    assert float(change) == pytest.approx(4.0) and gram_sensitivity(2.0) == 4.0


class _PixelHead(nn.Module):
    """A segmentation-like head: a 1×1 conv ``classifier`` sees each image's H·W pixels as its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Conv2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)


def _recorded(model: nn.Module, *inputs: torch.Tensor, mask: torch.Tensor | None = None, clip: float = 1.0) -> dict:
    rec = GramRecorder(model, clip=clip)
    with rec, torch.no_grad():
        rec.new_pass()
        rec.new_batch({"attention_mask": mask} if mask is not None else None)
        model.train()
        model(*inputs)
    return rec.grams()


@pytest.mark.parametrize("kind", ["pixels", "tokens"])
def test_a_sample_of_many_rows_changes_the_recorded_gram_by_at_most_c_squared(kind):
    # each row clipped alone, an 8×8 image (64 rows) moved G by up to 64·C², 16 tokens by 16·C²: the sample's rows are
    # now clipped together, so one sample moves it by at most C²
    g = torch.Generator().manual_seed(0)
    if kind == "pixels":
        model, x, mask = _PixelHead(), torch.randn(3, 3, 8, 8, generator=g) * 4, None
    else:
        model, x = nn.Linear(5, 2), torch.randn(3, 16, 5, generator=g) * 4
        mask = torch.ones(3, 16, dtype=torch.long)
        mask[2, 10:] = 0  # the last sequence is padded
    key = "classifier" if kind == "pixels" else ""
    full = _recorded(model, x, mask=mask)[key]
    without = _recorded(model, x[1:], mask=None if mask is None else mask[1:])[key]
    assert float(torch.linalg.matrix_norm(full - without)) <= 1.0 + 1e-9
    rows = (x[0].movedim(0, -1).reshape(-1, 3) if kind == "pixels" else x[0]).double()  # sample 0's rows
    scale = min(1.0, 1.0 / float(rows.norm()))  # clipped together to Frobenius norm 1, by hand
    torch.testing.assert_close(full - without, scale**2 * rows.T @ rows)
    garbage = x.clone()
    if mask is not None:  # padding rows take no part in a sample's norm nor in G
        garbage[2, 10:] = 100.0
        torch.testing.assert_close(_recorded(model, garbage, mask=mask)[key], full, rtol=0, atol=0)


def test_classic_sigma_closed_form():
    assert classic_sigma(1.0, 1e-5, 1.0) == pytest.approx(math.sqrt(2 * math.log(1.25e5)))  # 4.8448
    assert classic_sigma(0.5, 1e-5, 3.0) == pytest.approx(6 * math.sqrt(2 * math.log(1.25e5)))


def test_analytic_sigma_is_the_tightest_sigma_of_balle_and_wang_theorem_8():
    def delta(sigma, eps, sens):  # Thm. 8 written with scipy.stats directly
        a, b = sens / (2 * sigma), eps * sigma / sens
        return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)

    for eps in (0.5, 1.0, 5.0, 10.0):
        sigma = analytic_sigma(eps, 1e-5, 2.0)
        assert delta(sigma, eps, 2.0) == pytest.approx(1e-5, rel=1e-6)
        assert analytic_delta(sigma * 0.999, eps, 2.0) > 1e-5
    assert analytic_sigma(1.0, 1e-5, 1.0) < classic_sigma(1.0, 1e-5, 1.0)
    assert analytic_sigma(10.0, 1e-5, 1.0) < analytic_sigma(5.0, 1e-5, 1.0) < analytic_sigma(1.0, 1e-5, 1.0)
    assert gaussian_sigma(1.0, 1e-5, 1.0, "classic") == classic_sigma(1.0, 1e-5, 1.0)


@pytest.mark.parametrize(("eps", "delta", "sens"), [(0.0, 1e-5, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1e-5, 0.0),
                                                    (1.0, 1e-5, -1.0)])
@pytest.mark.parametrize("mechanism", ["analytic", "classic"])
def test_gaussian_sigma_refuses_parameters_outside_its_domain(eps: float, delta: float, sens: float,
                                                              mechanism: Mechanism) -> None:
    with pytest.raises(ValueError, match="need epsilon > 0, 0 < delta < 1, sensitivity > 0"):
        gaussian_sigma(eps, delta, sens, mechanism)


def test_an_unknown_mechanism_is_an_error_not_a_default() -> None:
    with pytest.raises(ValueError, match="unknown DP mechanism 'laplace'"):
        gaussian_sigma(1.0, 1e-5, 1.0, "laplace")  # type: ignore[arg-type]


def test_classic_mechanism_is_refused_where_its_sigma_gives_no_dp():
    # at ε = 10 (the paper's grid) classic's σ = 0.4845 has a true δ of 2.3e-5 by the exact analytic δ(σ), not 1e-5
    from feddg.aggregation.merges import HFedATMParams

    assert analytic_delta(classic_sigma(10.0, 1e-5, 1.0), 10.0, 1.0) > 2e-5
    for eps in (0.5, 1.0, 8.0):  # proven below 1; above, still at least the least σ up to ≈ 8
        assert HFedATMParams(gram_pass="after", dp_epsilon=eps, dp_mechanism="classic").dp_sigma() == pytest.approx(
            classic_sigma(eps, 1e-5, 1.0))
    with pytest.raises(ValueError, match=r"dp_mechanism: classic's noise at ε=10, δ=1e-05 is 0\.4845·Δ, below the "
                                         r"0\.4999·Δ that \(ε, δ\)-DP needs: use analytic"):
        HFedATMParams(gram_pass="after", dp_epsilon=10.0, dp_mechanism="classic")


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


# --- client-level DP of a statistic -----------------------------------------------------------


def test_statistic_dp_sigma_from_noise_multiplier_or_per_release_epsilon():
    assert StatisticDP(clip=3.0, noise_multiplier=1.5).sigma() == 1.5 * 6.0  # σ = z · Δ, Δ = 2C
    dp = StatisticDP(clip=2.0, epsilon=1.0, delta=1e-6)
    assert dp.sensitivity == 4.0 and dp.sigma() == pytest.approx(analytic_sigma(1.0, 1e-6, 4.0))
    assert analytic_delta(dp.sigma(), 1.0, 4.0) == pytest.approx(1e-6, rel=1e-6)  # one release is (1, 1e-6)-DP


@pytest.mark.parametrize(("over", "says"), [
    (["method.params.dp.clip=1"], "method.params.dp: .*exactly one of dp.noise_multiplier or dp.epsilon"),
    (["method.params.dp.epsilon=1", "method.params.dp.noise_multiplier=1"], "exactly one of"),
    (["method.params.dp.epsilon=1", "method.params.dp.sigma=1"], r"method\.params\.dp\.sigma"),
    (["method.params.dp.epsilon=-1"], r"method\.params\.dp\.epsilon"),
    (["method.params.dp.epsilon=1", "method.params.dp.accountant=moments"], r"method\.params\.dp\.accountant"),
])
def test_dp_block_mistakes_are_one_line_errors_naming_the_key(over, says):
    with pytest.raises(ConfigError, match=says) as err:
        build_config({"method": {"name": "fpl"}}, over)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("method", "over", "says"), [
    ("fedfa", ["method.params.variant=random", "method.params.lambda_h=0"], "uploads no statistic"),
    ("pardon", ["method.params.objective=augment-triplet"], "uploads no style"),
])
def test_dp_on_a_method_that_shares_nothing_is_an_error(method, over, says):
    with pytest.raises(ConfigError, match=says):
        build_config({"method": {"name": method}}, [*over, "method.params.dp.epsilon=1"])


def test_privatize_clips_all_arrays_as_one_vector_and_adds_the_generators_noise():
    arrays = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}  # joint norm 5
    clipped = privatize(arrays, 1.0, 0.0, torch.Generator().manual_seed(0))
    assert np.allclose(clipped["a"], [0.6, 0.0]) and np.allclose(clipped["b"], [[0.8]]) and clipped["b"].shape == (1, 1)
    assert privatize(arrays, 10.0, 0.0, torch.Generator())["a"].tolist() == [3.0, 0.0]  # inside the ball: untouched
    noisy = privatize(arrays, 1.0, 2.0, torch.Generator().manual_seed(7))
    z = torch.randn(3, generator=torch.Generator().manual_seed(7), dtype=torch.float64).numpy() * 2.0
    assert np.allclose(noisy["a"], [0.6 + z[0], z[1]], atol=1e-6) and np.allclose(noisy["b"], [[0.8 + z[2]]], atol=1e-6)
    assert noisy["a"].dtype == np.float32


def test_privatize_of_an_all_zero_statistic_is_the_noise_alone() -> None:
    # ‖s‖ = 0: nothing to clip and no division by the norm
    out = privatize({"p": np.zeros((2, 2))}, 1.0, 0.5, torch.Generator().manual_seed(3))["p"]
    z = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64).numpy() * 0.5
    np.testing.assert_allclose(out, z.reshape(2, 2), atol=1e-6)


def test_privatize_noise_has_std_sigma_and_two_clipped_statistics_are_at_most_2c_apart():
    big = {"s": np.full(20_000, 5.0)}
    out = privatize(big, 1.0, 3.0, torch.Generator().manual_seed(1))["s"]
    assert out.std() == pytest.approx(3.0, rel=0.02) and out.mean() == pytest.approx(1.0 / np.sqrt(20_000), abs=0.05)
    a = privatize({"s": np.array([9.0, 0.0])}, 1.5, 0.0, torch.Generator())["s"]
    b = privatize({"s": np.array([-4.0, 0.0])}, 1.5, 0.0, torch.Generator())["s"]
    assert np.linalg.norm(a - b) == pytest.approx(3.0) == StatisticDP(clip=1.5, epsilon=1).sensitivity


# --- the accountant -------------------------------------------------------------------------


RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]  # the package's


def _rdp_closed_form(z: float, k: int, delta: float) -> float:
    """RDP of the Gaussian, k α / (2 z²) (Mironov 2017, Prop. 7 + composition), to (ε, δ) by Canonne et al. 2020
    (Prop. 12): min_α [ε(α) + log(1 − 1/α) − log(δ α)/(α − 1)]."""
    return min(k * a / (2 * z * z) + math.log1p(-1 / a) - math.log(delta * a) / (a - 1) for a in RDP_ORDERS if a > 1.01)


@pytest.mark.parametrize(("z", "k"), [(1.0, 1), (1.1, 10), (4.0, 100), (0.8, 3)])
def test_rdp_epsilon_is_the_closed_form_of_k_gaussian_releases(z, k):
    assert gaussian_epsilon(z, k, 1e-5, "rdp") == pytest.approx(_rdp_closed_form(z, k, 1e-5), rel=1e-9)


def test_epsilon_matches_the_packages_documented_gaussian_example():
    # dp-accounting's rdp test: noise multiplier 4.530877117 is exactly (1, 1e-6)-DP for one release (fine orders)
    assert gaussian_epsilon(4.530877117, 1, 1e-6, "rdp") == pytest.approx(1.0, rel=1e-3)
    # PLD is exact for the Gaussian: one release is the analytic Gaussian mechanism (Balle & Wang 2018)
    eps = gaussian_epsilon(4.530877117, 1, 1e-6, "pld")
    assert eps == pytest.approx(analytic_gaussian_epsilon(4.530877117, 1e-6), rel=1e-3)


def test_pld_composition_of_k_gaussians_is_one_gaussian_with_noise_z_over_root_k():
    eps = gaussian_epsilon(2.0, 16, 1e-5, "pld")  # 16 releases at z = 2 ≡ one at z = 0.5 (Dong et al. 2019, GDP)
    assert eps == pytest.approx(analytic_gaussian_epsilon(0.5, 1e-5), rel=1e-2)
    assert eps < _rdp_closed_form(2.0, 16, 1e-5) < 16 * eps


def test_each_accountant_is_the_packages_own_and_rdp_is_the_default():
    pld, rdp = (accounted_gaussian(a, 3.0, 2, 1e-5) for a in (PLDAccountant, RdpAccountant))
    assert gaussian_epsilon(3.0, 2, 1e-5) == pytest.approx(rdp) and pld < 0.95 * rdp  # the two differ
    assert gaussian_epsilon(3.0, 2, 1e-5, "pld") == pytest.approx(pld)


@pytest.mark.parametrize(("z", "k", "delta"), [(-1.0, 1, 1e-5), (1.0, -1, 1e-5), (1.0, 1, 0.0), (1.0, 1, 1.0)])
def test_epsilon_refuses_arguments_outside_its_domain(z, k, delta):
    # δ = 1 would be reported as ε = 0 and δ = 0 as ε = ∞ by the accountant: both are refused
    with pytest.raises(ValueError, match=r"need noise_multiplier > 0, releases >= 0, 0 < delta < 1"):
        gaussian_epsilon(z, k, delta)


def test_epsilon_edge_cases():
    assert gaussian_epsilon(1.0, 0, 1e-5) == 0.0
    assert gaussian_epsilon(1.0, 4, 1e-5) < gaussian_epsilon(1.0, 8, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier > 0"):
        gaussian_epsilon(0.0, 1, 1e-5)
    with pytest.raises(ValueError, match="accountant"):
        gaussian_epsilon(1.0, 1, 1e-5, "moments")


def test_privacy_record_carries_the_run_epsilon_and_its_ingredients():
    rec = statistic_privacy(StatisticDP(clip=0.5, noise_multiplier=2.0, delta=1e-6, accountant="rdp"), 7)
    assert rec == {"epsilon": pytest.approx(_rdp_closed_form(2.0, 7, 1e-6)), "delta": 1e-6, "sigma": 2.0, "clip": 0.5,
                   "sensitivity": 1.0, "noise_multiplier": 2.0, "releases": 7, "accountant": "rdp", "unit": "client"}
    gram = privacy_record(sigma=8.0, sensitivity=4.0, clip=2.0, releases=3, delta=1e-5, accountant="rdp", unit="sample")
    assert gram["noise_multiplier"] == 2.0 and gram["epsilon"] == pytest.approx(_rdp_closed_form(2.0, 3, 1e-5))


def test_privacy_record_accounts_with_the_accountant_it_names():
    rec = statistic_privacy(StatisticDP(clip=0.5, noise_multiplier=3.0, delta=1e-6, accountant="pld"), 2)
    assert rec["accountant"] == "pld" and rec["epsilon"] == pytest.approx(accounted_gaussian(PLDAccountant, 3.0, 2, 1e-6))
    gram = privacy_record(sigma=12.0, sensitivity=4.0, clip=2.0, releases=1, delta=1e-5, accountant="pld", unit="sample")
    assert gram["epsilon"] == pytest.approx(accounted_gaussian(PLDAccountant, 3.0, 1, 1e-5))
