"""The weighted mean's arithmetic against numpy formulas written out by hand: float64 products of the normalised
weights, the key sets it refuses, and RegMean's fall back to it (HFedATM eq. 12)."""

from __future__ import annotations

import numpy as np
import pytest

from feddg.aggregation.mean import CHUNK, WeightedSum, weighted_mean, weighted_mean_messages
from feddg.aggregation.regmean import GRAM_EPS, regmean
from feddg.models.permutation import RowGather


def test_weighted_mean_multiplies_by_the_float64_normalised_weights() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 1000))
    # Σ_k w_k a_k with w = (1, 2) / 3 in float64, summed in order from 0: the same operations, so the same bits
    assert np.array_equal(weighted_mean([a, b], [1, 2]), 0.0 + a * (1 / 3) + b * (2 / 3))
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    by_hand = (0.0 + a32.astype(np.float64) * (1 / 3) + b32.astype(np.float64) * (2 / 3)).astype(np.float32)
    assert np.array_equal(weighted_mean([a32, b32], [1, 2]), by_hand)  # float32 in: float64 products, rounded once


def test_a_message_missing_a_prefixed_key_of_the_first_is_refused() -> None:
    first, fewer = {"w/x": np.ones(2), "w/y": np.ones(2)}, {"w/x": np.ones(2)}
    with pytest.raises(KeyError, match="disagree"):
        weighted_mean_messages([first, fewer], [1, 1], "w/")
    fold = WeightedSum("w/")
    fold.add(first, 1)
    with pytest.raises(KeyError, match="disagree"):  # not a silent mean of w/y over the first message alone
        fold.add(fewer, 1)


@pytest.mark.parametrize(("gap", "singular"), [(1.5 * GRAM_EPS, True), (3.0 * GRAM_EPS, False)])
def test_regmean_falls_back_to_the_mean_when_the_least_unit_diagonal_eigenvalue_is_within_m_float32_eps(
    gap: float, singular: bool
) -> None:
    # [[1, c], [c, 1]] has eigenvalues 1 ± c: the least, 1 − c = gap, against m · ε₃₂ = 2 ε₃₂
    gram = np.array([[1.0, 1.0 - gap], [1.0 - gap, 1.0]])
    ws = [np.array([[1.0, 2.0]], np.float32), np.array([[3.0, -1.0]], np.float32)]
    res = regmean(ws, [gram, 3 * gram], [1, 3])
    assert res.fallback is singular and res.weight.dtype == np.float32  # the stations' dtype, solved or not
    if singular:
        np.testing.assert_array_equal(res.weight, [[2.5, -0.25]])  # (1·w₁ + 3·w₂) / 4
    else:  # eq. 12: (G + 3G)⁻¹ (G w₁ᵀ + 3G w₂ᵀ)
        expected = np.linalg.solve(4 * gram, gram @ ws[0].T + 3 * gram @ ws[1].T).T
        np.testing.assert_allclose(res.weight, expected, rtol=1e-6)


def test_a_regmean_fallback_still_reports_its_dead_inputs() -> None:
    x = np.random.default_rng(1).normal(size=(20, 3))
    x[:, 1] = x[:, 0]  # collinear: singular
    x[:, 2] = 0.0  # an input no station activates
    res = regmean([np.ones((2, 3)), 3 * np.ones((2, 3))], [x.T @ x, 2 * x.T @ x], [1, 1])
    assert res.fallback and res.dead_inputs == 1
    np.testing.assert_array_equal(res.weight, 2 * np.ones((2, 3)))


def test_weighted_mean_across_a_chunk_boundary_is_the_formula_on_every_element() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(2, CHUNK + 3))  # a full chunk and a short one: each starts from zero sums
    assert np.array_equal(weighted_mean([a, b], [3, 1]), 0.0 + a * 0.75 + b * 0.25)


def test_a_later_message_with_an_extra_prefixed_key_is_refused() -> None:
    first, more = {"w/x": np.ones(2)}, {"w/x": np.ones(2), "w/y": np.ones(2)}
    with pytest.raises(KeyError, match="disagree"):
        weighted_mean_messages([first, more], [1, 1], "w/")
    fold = WeightedSum("w/")
    fold.add(first, 1)
    with pytest.raises(KeyError, match="disagree"):  # not a w/y averaged over the second message alone
        fold.add(more, 1)


def test_a_zero_weight_is_accepted_and_contributes_nothing() -> None:
    fold = WeightedSum("w/", expected=2.0)
    fold.add({"w/x": np.array([2.0, 4.0])}, 2)
    fold.add({"w/x": np.array([100.0, -100.0])}, 0)  # a client that trained on no examples
    np.testing.assert_array_equal(fold.mean()["w/x"], [2.0, 4.0])
    np.testing.assert_array_equal(weighted_mean([np.array([2.0]), np.array([9.0])], [1, 0]), [2.0])


def test_weights_that_are_not_one_vector_or_gathers_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one weight"):
        weighted_mean([np.ones(2), np.ones(2)], [[1.0], [2.0]])
    a = np.arange(12.0)
    with pytest.raises(ValueError, match="different shapes"):
        weighted_mean([a, a], [1, 1], [RowGather(np.arange(3)), RowGather(np.arange(4))])


def test_row_gathers_permute_each_array_before_the_mean() -> None:
    a, b = np.arange(6.0).reshape(3, 2), 10 * np.arange(6.0).reshape(3, 2)
    out = weighted_mean([a, b], [1, 1], [None, RowGather(np.array([2, 0, 1]))])
    np.testing.assert_array_equal(out, (a + b[[2, 0, 1]]) / 2)
