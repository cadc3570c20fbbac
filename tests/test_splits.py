"""Tests of the domain splits and the per-client holdout (feddg.data.splits)."""

from __future__ import annotations

import numpy as np
import pytest

from feddg.data.splits import (
    every_domain_trains,
    holdout_split,
    leave_domains_out,
    leave_one_domain_out,
    leave_two_domains_out,
)

DOMAIN_IDS = np.random.default_rng(0).permutation(np.repeat([0, 1, 2, 3], [30, 45, 12, 50]))


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    everything = np.concatenate(parts)
    assert len(everything) == n
    assert np.array_equal(np.sort(everything), np.arange(n))


@pytest.mark.parametrize("target", [0, 1, 2, 3])
def test_lodo(target: int) -> None:
    s = leave_one_domain_out(DOMAIN_IDS, target)
    assert s.test_domains == [target] and s.val_domains == []
    assert s.source_domains == [d for d in range(4) if d != target]
    assert len(s.val_idx) == 0 and s.val_idx.dtype == np.int64
    assert_disjoint_cover([s.source_idx, s.test_idx], len(DOMAIN_IDS))
    assert np.all(DOMAIN_IDS[s.test_idx] == target)
    assert np.all(DOMAIN_IDS[s.source_idx] != target)


@pytest.mark.parametrize("val_domain,test_domain", [(0, 1), (1, 0), (2, 3), (3, 2)])
def test_ltdo(val_domain: int, test_domain: int) -> None:
    s = leave_two_domains_out(DOMAIN_IDS, val_domain, test_domain)
    assert s.val_domains == [val_domain] and s.test_domains == [test_domain]
    assert s.source_domains == [d for d in range(4) if d not in (val_domain, test_domain)]
    assert_disjoint_cover([s.source_idx, s.val_idx, s.test_idx], len(DOMAIN_IDS))
    assert np.all(DOMAIN_IDS[s.val_idx] == val_domain)
    assert np.all(DOMAIN_IDS[s.test_idx] == test_domain)
    assert set(DOMAIN_IDS[s.source_idx].tolist()) == set(s.source_domains)


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="test domain 7 has no samples"):
        leave_one_domain_out(DOMAIN_IDS, 7)
    with pytest.raises(ValueError, match="must differ"):
        leave_two_domains_out(DOMAIN_IDS, 2, 2)
    with pytest.raises(ValueError, match="no source domain left"):
        leave_two_domains_out(np.array([0, 0, 1, 1]), 0, 1)
    with pytest.raises(ValueError, match="^val domain 7 has no samples"):  # the val domain is checked too
        leave_two_domains_out(DOMAIN_IDS, 7, 1)
    for targets in ([1, 1], []):
        with pytest.raises(ValueError, match="distinct and at least one"):
            leave_domains_out(DOMAIN_IDS, targets)


def test_leave_domains_out_holds_out_exactly_the_targets() -> None:
    s = leave_domains_out(DOMAIN_IDS, [3, 1])
    assert s.test_domains == [3, 1] and s.source_domains == [0, 2] and s.val_domains == []
    np.testing.assert_array_equal(s.test_idx, np.flatnonzero((DOMAIN_IDS == 1) | (DOMAIN_IDS == 3)))
    np.testing.assert_array_equal(s.source_idx, np.flatnonzero((DOMAIN_IDS == 0) | (DOMAIN_IDS == 2)))


def test_every_domain_trains_holds_nothing_out() -> None:
    s = every_domain_trains(DOMAIN_IDS)
    assert s.source_domains == [0, 1, 2, 3] and s.val_domains == s.test_domains == []
    np.testing.assert_array_equal(s.source_idx, np.arange(len(DOMAIN_IDS)))
    assert len(s.val_idx) == len(s.test_idx) == 0


@pytest.mark.parametrize(
    "n,fraction,n_hold",
    [
        (100, 0.1, 10),
        (105, 0.1, 10),  # floor
        (100, 0.29, 29),  # 0.29 * 100 = 28.999... in floats
        (5, 0.1, 1),  # at least one
        (2, 0.9, 1),  # at most n - 1
        (2, 1 - 1e-10, 1),  # at most n - 1 even where the rounding guard lifts floor(fraction * n) to n
        (1, 0.5, 0),  # a single sample stays for training
        (50, 0.0, 0),
    ],
)
def test_holdout_sizes(n: int, fraction: float, n_hold: int) -> None:
    indices = np.arange(1000, 1000 + 3 * n, 3)  # global indices, not 0..n-1
    train, hold = holdout_split(indices, fraction, np.random.default_rng(0))
    assert len(hold) == n_hold and len(train) == n - n_hold
    assert train.dtype == hold.dtype == np.int64
    assert np.all(np.diff(train) > 0) and np.all(np.diff(hold) > 0)  # both sorted
    assert np.array_equal(np.sort(np.concatenate([train, hold])), indices)


def test_holdout_is_random_and_reproducible() -> None:
    indices = np.arange(200)
    a = holdout_split(indices, 0.1, np.random.default_rng(5))
    b = holdout_split(indices, 0.1, np.random.default_rng(5))
    c = holdout_split(indices, 0.1, np.random.default_rng(6))
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0])
    assert not np.array_equal(a[1], c[1])
    assert not np.array_equal(a[1], np.arange(20))  # not simply the first samples


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_holdout_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        holdout_split(np.arange(10), fraction, np.random.default_rng(0))


def test_a_holdout_by_case_keeps_every_case_on_one_side():
    from feddg.data.splits import holdout_split_by_case

    cases = np.repeat(np.arange(10), 4)  # 10 cases of 4 slices
    idx = np.random.default_rng(1).permutation(np.arange(8, 40))  # a client with cases 2..9, in no order
    train, hold = holdout_split_by_case(idx, cases, 0.25, np.random.default_rng(0))
    assert len(np.unique(cases[hold])) == 2 and len(hold) == 8  # floor(0.25 × 8 cases) whole
    assert not set(cases[train]) & set(cases[hold]) and sorted(np.concatenate([train, hold])) == list(range(8, 40))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(hold) > 0)  # both sorted


def test_a_holdout_by_case_draws_only_from_the_clients_own_cases():
    from feddg.data.splits import holdout_split_by_case

    cases = np.repeat(np.arange(10), 4)  # 10 cases of 4 slices
    idx = np.arange(28, 40)  # a client with cases 7, 8, 9: floor(0.5 × 3) = 1 of them held out, whole
    for seed in range(10):
        train, hold = holdout_split_by_case(idx, cases, 0.5, np.random.default_rng(seed))
        assert len(hold) == 4 and len(np.unique(cases[hold])) == 1 and len(train) == 8
