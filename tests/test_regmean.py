"""Shrinkage-aware RegMean, HFedATM eqs. 8–12, against closed forms."""

import logging

import numpy as np
import pytest

from feddg.aggregation.regmean import psd_project, regmean, shrink, station_gram


def _stations(seed=0, n=(40, 60, 30), m=5, out=3):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(k, m)) * rng.uniform(0.5, 2.0, size=m) for k in n]
    ws = [rng.normal(size=(out, m)) for _ in n]  # nn.Linear weights [out, in]
    return xs, ws


def test_eq10_shrinkage_scales_off_diagonal_entries_only():
    g = np.array([[4.0, 2.0], [2.0, 9.0]])
    np.testing.assert_allclose(shrink(g, 0.75), [[4.0, 1.5], [1.5, 9.0]])
    np.testing.assert_allclose(shrink(g, 1.0), g)
    np.testing.assert_allclose(shrink(g, 0.0), np.diag([4.0, 9.0]))


def test_eq9_station_gram_is_the_mean_of_client_grams():
    a, b = np.eye(2), np.array([[3.0, 1.0], [1.0, 5.0]])
    np.testing.assert_allclose(station_gram([a, b]), [[2.0, 0.5], [0.5, 3.0]])


def test_eq12_equals_the_least_squares_solution_of_the_merged_regression():
    xs, ws = _stations()
    # eq. 11: min_W Σ_e ‖X_e W − X_e W_e‖² is one least-squares problem on the stacked data
    stacked_x = np.concatenate(xs)
    stacked_y = np.concatenate([x @ w.T for x, w in zip(xs, ws)])
    lstsq = np.linalg.lstsq(stacked_x, stacked_y, rcond=None)[0].T
    res = regmean(ws, [x.T @ x for x in xs], [1, 1, 1])
    np.testing.assert_allclose(res.weight, lstsq, rtol=1e-9, atol=1e-10)
    assert not res.fallback and res.dead_inputs == 0
    assert res.cond == pytest.approx(np.linalg.cond(sum(x.T @ x for x in xs)), rel=1e-8)


def test_eq12_with_shrunk_grams_is_the_regularised_closed_form():
    xs, ws = _stations(1)
    gs = [shrink(x.T @ x, 0.75) for x in xs]
    expected = np.linalg.inv(sum(gs)) @ sum(g @ w.T for g, w in zip(gs, ws))  # eq. 12 literally
    np.testing.assert_allclose(regmean(ws, gs, [1, 1, 1]).weight, expected.T, rtol=1e-9, atol=1e-10)


def test_alpha_one_with_equal_grams_is_plain_averaging():
    xs, ws = _stations(2)
    g = shrink(xs[0].T @ xs[0], 1.0)
    np.testing.assert_allclose(regmean(ws, [g, g, g], [1, 1, 1]).weight, np.mean(ws, axis=0), rtol=1e-9, atol=1e-12)


def test_inputs_no_station_ever_activates_are_set_to_the_mean_and_decouple():
    xs, ws = _stations(3)
    for x in xs:
        x[:, 2] = 0.0  # a dead ReLU unit
    res = regmean(ws, [x.T @ x for x in xs], [1, 2, 1])
    live = [0, 1, 3, 4]
    sub = np.linalg.lstsq(np.concatenate([x[:, live] for x in xs]),
                          np.concatenate([x @ w.T for x, w in zip(xs, ws)]), rcond=None)[0].T
    np.testing.assert_allclose(res.weight[:, live], sub, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(res.weight[:, 2], (ws[0][:, 2] + 2 * ws[1][:, 2] + ws[2][:, 2]) / 4)
    assert res.dead_inputs == 1 and not res.fallback


def test_a_singular_system_falls_back_to_the_weighted_mean_with_a_warning(caplog):
    xs, ws = _stations(4)
    for x in xs:
        x[:, 1] = x[:, 0]  # collinear inputs: singular without being dead
    with caplog.at_level(logging.WARNING, logger="feddg.aggregation.regmean"):
        res = regmean(ws, [x.T @ x for x in xs], [1, 1, 2], name="fc")
    assert res.fallback and res.cond > 1e12
    np.testing.assert_allclose(res.weight, (ws[0] + ws[1] + 2 * ws[2]) / 4)
    assert "fc is singular" in caplog.text


def test_psd_projection_clips_negative_eigenvalues():
    q = np.array([[0.6, -0.8], [0.8, 0.6]])
    g = q @ np.diag([2.0, -1.0]) @ q.T
    np.testing.assert_allclose(psd_project(g), q @ np.diag([2.0, 0.0]) @ q.T, atol=1e-12)


def test_fewer_samples_than_inputs_falls_back_even_when_float32_rounding_hides_the_singularity():
    # 2 stations x 3 samples < 8 inputs: rank 6. Rounded to float32, as clients send Grams, the two missing
    # eigenvalues become ±1e-7 of the largest, and where both land positive a plain condition-number test passes
    # and the solve fills the unseen directions with rounding noise
    rng = np.random.default_rng(1)
    for _ in range(40):
        ws = [rng.standard_normal((2, 8)) for _ in range(2)]
        grams = [(x.T @ x).astype(np.float32) for x in (rng.standard_normal((3, 8)) for _ in range(2))]
        res = regmean(ws, grams, [1, 1])
        assert res.fallback
        np.testing.assert_allclose(res.weight, (ws[0] + ws[1]) / 2)


def test_the_singularity_test_ignores_how_the_inputs_are_scaled():
    # input 0 is 1e-7 the others' scale: the plain condition number is ~1e14, yet every entry is known to float32's
    # relative precision and the solve is exact
    xs, ws = _stations(5)
    for x in xs:
        x[:, 0] *= 1e-7
    grams = [(x.T @ x).astype(np.float32).astype(np.float64) for x in xs]
    res = regmean(ws, grams, [1, 1, 1])
    assert not res.fallback and res.cond > 1e12
    expected = np.linalg.solve(sum(grams), sum(g @ w.T for g, w in zip(grams, ws))).T
    np.testing.assert_allclose(res.weight, expected, rtol=1e-6)


@pytest.mark.parametrize(("margin", "falls_back"), [(0.75, True), (1.25, False)])
def test_the_singularity_threshold_is_m_times_float32_eps_at_unit_diagonal(margin: float, falls_back: bool) -> None:
    # m = 2 inputs, G = [[1, c], [c, 1]] has eigenvalues 1 ± c: the least is margin · 2ε₃₂ below/above the threshold
    eps = float(np.finfo(np.float32).eps)
    c = 1.0 - margin * 2 * eps
    g = np.array([[1.0, c], [c, 1.0]])
    ws = [np.array([[1.0, 2.0]]), np.array([[3.0, -1.0]])]
    res = regmean(ws, [g, g], [1, 3])
    assert res.fallback == falls_back
    if falls_back:
        np.testing.assert_allclose(res.weight, (ws[0] + 3 * ws[1]) / 4)
    else:  # equal Grams: W = (2G)^{-1} G (W_1 + W_2)ᵀ = the plain mean
        np.testing.assert_allclose(res.weight, (ws[0] + ws[1]) / 2, rtol=1e-6)
