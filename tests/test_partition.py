"""Tests of the client partitioners' arithmetic (feddg.data.partition)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from feddg.data.partition import (
    _PARAM_CHECKS,
    PARTITIONERS,
    Partition,
    assign_domains,
    d_allocation,
    lambda_counts,
    lambda_partition,
    make_partition,
)


def make_data(domain_sizes: list[int], num_classes: int = 5, target_size: int = 7, seed: int = 0):
    """Synthetic dataset: domain 0 is a held-out target (so source indices are not 0..n-1),
    domains 1.. are the sources with the given sizes, labels random."""
    sizes = [target_size, *domain_sizes]
    domain_ids = np.repeat(np.arange(len(sizes)), sizes)
    labels = np.random.default_rng(seed).integers(0, num_classes, len(domain_ids))
    perm = np.random.default_rng(seed + 1).permutation(len(domain_ids))  # interleave domains
    domain_ids, labels = domain_ids[perm], labels[perm]
    source_idx = np.flatnonzero(domain_ids != 0)
    return source_idx, domain_ids, labels


def domain_counts(p: Partition, domain_ids: np.ndarray, domains: list[int]) -> np.ndarray:
    """``[num_clients, len(domains)]`` sample counts."""
    return np.array([[np.sum(domain_ids[ix] == d) for d in domains] for ix in p.client_indices])


# kind, params, num_clients -- every registered partitioner appears at least once
CASES: list[tuple[str, dict[str, Any], int]] = [
    ("iid", {}, 7),
    ("by_domain", {}, 6),
    ("lambda", {"lam": 0.0}, 5),
    ("lambda", {"lam": 0.1}, 7),
    ("lambda", {"lam": 0.37}, 2),
    ("lambda", {"lam": 1.0}, 9),
    ("d_allocation", {"d": 1}, 5),
    ("d_allocation", {"d": 2}, 4),
    ("d_allocation", {"d": 3}, 7),
    ("d_allocation", {"d": 2, "shuffle_clients": True}, 3),
    ("dirichlet_domains", {"alpha": 0.5}, 4),
    ("dirichlet_labels", {"alpha": 0.3}, 6),
    ("two_level_dirichlet", {"groups": 3, "alpha_group": 1.0, "alpha_client": 1.0}, 6),
    ("two_level_dirichlet", {"groups": 2, "alpha_group": 0.5, "alpha_client": 2.0}, 4),
]
SIZES = [[40, 25, 61], [100, 100, 100], [13, 200, 57]]


def test_cases_cover_every_partitioner() -> None:
    # natural takes the dataset's groups, not a client count: its own tests below and in test_natural_groups.py
    assert {kind for kind, _, _ in CASES} | {"natural"} == set(PARTITIONERS)


def test_natural_makes_each_group_of_the_sources_a_client_in_group_order() -> None:
    domain_ids = np.array([0, 0, 1, 1, 1, 2, 2, 1])
    groups = np.array([5, 5, 2, 2, 9, 7, 7, 9])
    p = make_partition("natural", np.array([0, 1, 2, 3, 4, 7]), domain_ids, np.zeros(8, np.int64), 99,
                       np.random.default_rng(0), groups)
    assert [ix.tolist() for ix in p.client_indices] == [[2, 3], [0, 1], [4, 7]]  # groups 2, 5, 9 (7 held out)
    assert p.client_domains == [[1], [0], [1]]
    with pytest.raises(ValueError, match="natural group"):
        make_partition("natural", np.array([0, 1]), domain_ids, np.zeros(8, np.int64), 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="duplicate"):
        make_partition("natural", np.array([0, 1, 1]), domain_ids, np.zeros(8, np.int64), 2, np.random.default_rng(0),
                       groups)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("kind,params,num_clients", CASES)
def test_no_sample_lost_or_duplicated(kind: str, params: dict[str, Any], num_clients: int, sizes: list[int]) -> None:
    for seed in range(4):
        source_idx, domain_ids, labels = make_data(sizes, seed=seed)
        p = make_partition(kind, source_idx, domain_ids, labels, num_clients, np.random.default_rng(seed), **params)
        assert p.num_clients == num_clients == len(p.client_domains)
        everything = np.concatenate(p.client_indices)
        assert len(everything) == len(source_idx)  # no sample twice ...
        assert np.array_equal(np.sort(everything), np.sort(source_idx))  # ... none lost, none foreign
        for ix in p.client_indices:
            assert ix.dtype == np.int64 and len(ix) > 0
            assert np.all(np.diff(ix) > 0)  # sorted


@pytest.mark.parametrize("kind,params,num_clients", CASES)
def test_same_seed_same_partition(kind: str, params: dict[str, Any], num_clients: int) -> None:
    source_idx, domain_ids, labels = make_data(SIZES[0])

    def run(seed: int) -> Partition:
        return make_partition(kind, source_idx, domain_ids, labels, num_clients, np.random.default_rng(seed), **params)

    a, b, c = run(3), run(3), run(4)
    assert a.client_domains == b.client_domains
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
    assert not all(np.array_equal(x, y) for x, y in zip(a.client_indices, c.client_indices))


@pytest.mark.parametrize("kind,params,num_clients", [c for c in CASES if c[0] in
                                                      ("iid", "dirichlet_domains", "dirichlet_labels",
                                                       "two_level_dirichlet")])
def test_partitions_that_assign_no_domains_report_the_domains_held(kind: str, params: dict[str, Any],
                                                                   num_clients: int) -> None:
    source_idx, domain_ids, labels = make_data(SIZES[2])  # domains 1..3, labels 0..4: a mix-up shows
    p = make_partition(kind, source_idx, domain_ids, labels, num_clients, np.random.default_rng(0), **params)
    assert p.client_domains == [sorted(set(domain_ids[ix].tolist())) for ix in p.client_indices]


# --------------------------------------------------------------------------- iid, by_domain


def test_iid_sizes_differ_by_at_most_one() -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    p = make_partition("iid", source_idx, domain_ids, labels, 8, np.random.default_rng(0))
    sizes = [len(ix) for ix in p.client_indices]
    assert max(sizes) - min(sizes) <= 1


def test_by_domain_gives_each_domain_its_own_clients() -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    p = make_partition("by_domain", source_idx, domain_ids, labels, 6, np.random.default_rng(0))
    assert p.client_domains == [[1], [1], [2], [2], [3], [3]]
    for ix, (d,) in zip(p.client_indices, p.client_domains):
        assert set(domain_ids[ix]) == {d}
    assert [len(ix) for ix in p.client_indices] == [20, 20, 13, 12, 31, 30]


def test_by_domain_one_domain_per_client() -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    p = make_partition("by_domain", source_idx, domain_ids, labels, 3, np.random.default_rng(0))
    assert [len(ix) for ix in p.client_indices] == [40, 25, 61]


# ------------------------------------------------------------ lambda: HFedATM supplement eq. 7


def test_assign_domains_fewer_domains_than_clients() -> None:
    # start one client per domain; extra clients go to argmax n_d / k_d: 50/1 -> d0, then 30/1 -> d1
    a = assign_domains(np.array([50, 30, 20]), 5)
    assert a.tolist() == [
        [True, True, False, False, False],
        [False, False, True, True, False],
        [False, False, False, False, True],
    ]


def test_assign_domains_more_domains_than_clients() -> None:
    # largest first to the least-loaded client: 40->c0, 30->c1, 20->c1 (30<40), 10->c0 (40<50)
    a = assign_domains(np.array([10, 40, 30, 20]), 2)
    assert a.tolist() == [[True, False], [True, False], [False, True], [False, True]]


def test_lambda_counts_match_eq7_by_hand() -> None:
    # n = (60, 40), C = 4, D_c = (0, 0, 1, 1), lam = 0.5:
    # n_{0,c} = 0.5*60/4 + 0.5*60/2 = 22.5 for c in {0,1}, 7.5 otherwise; n_{1,c} = 5 or 5+10 = 15
    assigned = assign_domains(np.array([60, 40]), 4)
    expected = lambda_counts(np.array([60, 40]), assigned, 0.5)
    np.testing.assert_allclose(expected, [[22.5, 22.5, 7.5, 7.5], [5, 5, 15, 15]])
    source_idx, domain_ids, labels = make_data([60, 40])
    p = lambda_partition(source_idx, domain_ids, labels, 4, np.random.default_rng(0), lam=0.5)
    counts = domain_counts(p, domain_ids, [1, 2]).T
    assert np.all(np.abs(counts - expected) < 1)
    assert counts.sum(axis=1).tolist() == [60, 40]


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("sizes,num_clients", [([40, 25, 61], 7), ([13, 200, 57, 90, 31], 3), ([100, 100], 10)])
def test_lambda_counts_within_one_of_eq7(lam: float, sizes: list[int], num_clients: int) -> None:
    source_idx, domain_ids, labels = make_data(sizes)
    p = lambda_partition(source_idx, domain_ids, labels, num_clients, np.random.default_rng(1), lam=lam)
    expected = lambda_counts(np.array(sizes), assign_domains(np.array(sizes), num_clients), lam)
    counts = domain_counts(p, domain_ids, list(range(1, len(sizes) + 1))).T
    assert np.all(np.abs(counts - expected) < 1)


@pytest.mark.parametrize("sizes,num_clients", [([40, 25, 61], 7), ([13, 200, 57, 90, 31], 3), ([500, 300], 10)])
def test_lambda_one_is_iid_over_domains(sizes: list[int], num_clients: int) -> None:
    """lam = 1: every client holds n_d / C of every domain, up to rounding (±1 sample)."""
    source_idx, domain_ids, labels = make_data(sizes)
    p = lambda_partition(source_idx, domain_ids, labels, num_clients, np.random.default_rng(0), lam=1.0)
    counts = domain_counts(p, domain_ids, list(range(1, len(sizes) + 1)))
    share = np.array(sizes) / num_clients
    assert np.all(np.abs(counts - share) < 1)
    assert np.all(counts.max(axis=0) - counts.min(axis=0) <= 1)


@pytest.mark.parametrize("sizes,num_clients", [([40, 25, 61], 7), ([13, 200, 57, 90, 31], 3), ([40, 25, 61], 3)])
def test_lambda_zero_gives_only_assigned_domains(sizes: list[int], num_clients: int) -> None:
    source_idx, domain_ids, labels = make_data(sizes)
    p = lambda_partition(source_idx, domain_ids, labels, num_clients, np.random.default_rng(0), lam=0.0)
    for ix, assigned in zip(p.client_indices, p.client_domains):
        assert sorted(set(domain_ids[ix].tolist())) == assigned
    holders = {d: sum(d in ds for ds in p.client_domains) for d in range(1, len(sizes) + 1)}
    for d, k in holders.items():  # 1 - lam = 1 of the domain shared equally among its holders
        shares = [np.sum(domain_ids[ix] == d) for ix, ds in zip(p.client_indices, p.client_domains) if d in ds]
        assert len(shares) == k and max(shares) - min(shares) <= 1


def test_lambda_small_spreads_a_little_of_every_domain() -> None:
    """lam = 0.1 (PARDON default): each client's non-assigned domains are lam * n_d / C."""
    source_idx, domain_ids, labels = make_data([400, 400, 400])
    p = lambda_partition(source_idx, domain_ids, labels, 4, np.random.default_rng(0), lam=0.1)
    counts = domain_counts(p, domain_ids, [1, 2, 3])
    for c, assigned in enumerate(p.client_domains):
        for k, d in enumerate([1, 2, 3]):
            if d not in assigned:
                assert counts[c, k] == 10  # 0.1 * 400 / 4


# ----------------------------------------------------------------- d-allocation: hFedF Alg. 5


@pytest.mark.parametrize("num_domains", [2, 3, 5])
@pytest.mark.parametrize("num_clients", [1, 2, 3, 4, 7])
def test_d_allocation_exactly_d_distinct_domains(num_domains: int, num_clients: int) -> None:
    sizes = [30 + 11 * k for k in range(num_domains)]
    source_idx, domain_ids, labels = make_data(sizes)
    for d in range(1, num_domains + 1):
        if num_clients * d < num_domains:
            continue
        p = d_allocation(source_idx, domain_ids, labels, num_clients, np.random.default_rng(d), d=d)
        for ix, doms in zip(p.client_indices, p.client_domains):
            assert len(doms) == d
            assert sorted(set(domain_ids[ix].tolist())) == doms


def test_d_allocation_figure_2b_example() -> None:
    """hFedF Fig. 2b: 3 domains, 2 clients, d = 2; the largest domain is split into 2 parts.

    a = floor(2*2/3) = 1, b = 4 mod 3 = 1: domain 2 (the largest, 50) gets a+1 = 2 parts.
    Pass 1: client 0 takes domain 1 (whole), client 1 the first half of domain 2.
    Pass 2: client 0 takes the second half of domain 2, client 1 domain 3 (whole).
    """
    source_idx, domain_ids, labels = make_data([30, 50, 20])
    p = d_allocation(source_idx, domain_ids, labels, 2, np.random.default_rng(0), d=2)
    assert p.client_domains == [[1, 2], [2, 3]]
    assert domain_counts(p, domain_ids, [1, 2, 3]).tolist() == [[30, 25, 0], [0, 25, 20]]


def test_d_allocation_hfedf_setting_clients_equal_domains() -> None:
    """N = |Z_src| = 3 (hFedF §5.1), d = 2: a = 2, b = 0, every domain halved; parts taken
    in domain order go to clients 0,1,2,0,1,2."""
    source_idx, domain_ids, labels = make_data([40, 60, 80])
    p = d_allocation(source_idx, domain_ids, labels, 3, np.random.default_rng(0), d=2)
    assert p.client_domains == [[1, 2], [1, 3], [2, 3]]
    assert domain_counts(p, domain_ids, [1, 2, 3]).tolist() == [[20, 30, 0], [20, 0, 40], [0, 30, 40]]


@pytest.mark.parametrize("num_clients,d", [(4, 2), (5, 2), (7, 3), (5, 1), (6, 4), (8, 3)])
def test_d_allocation_parts_per_domain(num_clients: int, d: int) -> None:
    """The b largest domains are cut into a + 1 equal parts, the others into a (Alg. 5)."""
    sizes = [31, 77, 45, 90, 58]
    source_idx, domain_ids, labels = make_data(sizes)
    p = d_allocation(source_idx, domain_ids, labels, num_clients, np.random.default_rng(0), d=d)
    a, b = divmod(num_clients * d, len(sizes))
    largest = set(np.argsort(sizes)[::-1][:b].tolist())
    counts = domain_counts(p, domain_ids, [1, 2, 3, 4, 5])
    for k, n in enumerate(sizes):
        parts = counts[:, k][counts[:, k] > 0]
        assert len(parts) == (a + 1 if k in largest else a)
        assert parts.max() - parts.min() <= 1 and parts.sum() == n


def test_d_allocation_shuffle_only_relabels_clients() -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    plain = d_allocation(source_idx, domain_ids, labels, 5, np.random.default_rng(2), d=2)
    shuffled = d_allocation(source_idx, domain_ids, labels, 5, np.random.default_rng(2), d=2, shuffle_clients=True)
    assert {tuple(ix) for ix in plain.client_indices} == {tuple(ix) for ix in shuffled.client_indices}
    assert [tuple(ix) for ix in plain.client_indices] != [tuple(ix) for ix in shuffled.client_indices]


# ---------------------------------------------------------------------------- Dirichlet


def test_dirichlet_domains_huge_alpha_is_uniform() -> None:
    source_idx, domain_ids, labels = make_data([1000, 800, 1200])
    p = make_partition("dirichlet_domains", source_idx, domain_ids, labels, 4, np.random.default_rng(0), alpha=1e6)
    counts = domain_counts(p, domain_ids, [1, 2, 3])
    np.testing.assert_allclose(counts / counts.sum(axis=0), 0.25, atol=0.01)


def test_dirichlet_domains_tiny_alpha_is_concentrated() -> None:
    source_idx, domain_ids, labels = make_data([100] * 6)
    p = make_partition("dirichlet_domains", source_idx, domain_ids, labels, 3, np.random.default_rng(0), alpha=1e-3)
    counts = domain_counts(p, domain_ids, list(range(1, 7)))
    assert np.all(counts.max(axis=0) / counts.sum(axis=0) >= 0.99)


def class_counts(p: Partition, labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.array([np.bincount(labels[ix], minlength=num_classes) for ix in p.client_indices])


def test_dirichlet_labels_huge_alpha_is_uniform() -> None:
    source_idx, domain_ids, labels = make_data([1500, 1500], num_classes=4)
    p = make_partition("dirichlet_labels", source_idx, domain_ids, labels, 3, np.random.default_rng(0), alpha=1e6)
    counts = class_counts(p, labels, 4)
    np.testing.assert_allclose(counts / counts.sum(axis=0), 1 / 3, atol=0.01)


def test_dirichlet_labels_tiny_alpha_is_concentrated() -> None:
    source_idx, domain_ids, labels = make_data([400, 400], num_classes=8)
    p = make_partition("dirichlet_labels", source_idx, domain_ids, labels, 3, np.random.default_rng(0), alpha=1e-3)
    counts = class_counts(p, labels, 8)
    assert np.all(counts.max(axis=0) / counts.sum(axis=0) >= 0.99)


@pytest.mark.parametrize("kind", ["dirichlet_domains", "dirichlet_labels"])
def test_dirichlet_guard_raises_when_clients_stay_empty(kind: str) -> None:
    # 2 domains / 2 classes, each put on ~one client: 6 clients can never all be fed
    source_idx, domain_ids, labels = make_data([100, 100], num_classes=2)
    with pytest.raises(ValueError, match="empty in all 5 draws"):
        make_partition(kind, source_idx, domain_ids, labels, 6, np.random.default_rng(0), alpha=1e-4, max_tries=5)


# ------------------------------------------------------------------------ make_partition


@pytest.mark.parametrize(
    "kind,num_clients,params,match",
    [
        ("nope", 3, {}, "unknown partition kind 'nope'"),
        ("iid", 3, {"lam": 0.5}, "takes no parameter 'lam'"),
        ("lambda", 3, {"alpha": 1.0}, "takes no parameter 'alpha'"),
        ("lambda", 3, {}, "needs parameter 'lam'"),
        ("lambda", 3, {"lam": 1.5}, "lam must be a number in"),
        ("lambda", 3, {"lam": "0.1"}, "lam must be a number in"),
        ("dirichlet_labels", 3, {"alpha": 0.0}, "alpha must be a finite number > 0"),
        ("dirichlet_domains", 3, {"alpha": 1.0, "max_tries": 0}, "max_tries must be an integer"),
        ("d_allocation", 3, {"d": 0}, "d must be an integer >= 1"),
        ("d_allocation", 3, {"d": 1.5}, "d must be an integer >= 1"),
        ("d_allocation", 3, {"d": 4}, r"d must be in \[1, 3\]"),
        ("d_allocation", 2, {"d": 1}, "below the 3 source domains"),
        ("iid", 0, {}, "num_clients must be >= 1"),
        ("iid", 10_000, {}, "exceeds the 126 source samples"),
        ("by_domain", 4, {}, "multiple of the 3 source domains"),
    ],
)
def test_make_partition_rejects_bad_input(kind: str, num_clients: int, params: dict[str, Any], match: str) -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    with pytest.raises(ValueError, match=match):
        make_partition(kind, source_idx, domain_ids, labels, num_clients, np.random.default_rng(0), **params)


def test_rejects_duplicate_source_indices() -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    with pytest.raises(ValueError, match="duplicate"):
        make_partition("iid", np.r_[source_idx, source_idx[:1]], domain_ids, labels, 3, np.random.default_rng(0))


def test_rejects_partitions_with_empty_clients() -> None:
    source_idx, domain_ids, labels = make_data([2, 200, 50])  # 3 clients for a 2-sample domain
    with pytest.raises(ValueError, match="received no samples"):
        make_partition("by_domain", source_idx, domain_ids, labels, 9, np.random.default_rng(0))


def test_lambda_one_balances_leftover_samples_across_clients() -> None:
    """With lam = 1 every domain leaves the same fractional share; leftovers rotate over
    clients, so client totals differ by at most 1 as in a plain iid split."""
    source_idx, domain_ids, labels = make_data([2, 2, 2, 2, 2, 2])
    p = lambda_partition(source_idx, domain_ids, labels, 4, np.random.default_rng(0), lam=1.0)
    sizes = [len(ix) for ix in p.client_indices]
    assert sorted(sizes) == [3, 3, 3, 3]


def test_lambda_rounding_breaks_full_ties_at_random() -> None:
    # one domain of 5 over 4 clients (lam = 1): 1.25 each, and the one leftover sample goes to a random client,
    # not always client 0 (20 seeds all picking one client: probability 4^-19)
    source_idx, domain_ids, labels = make_data([5])
    lucky = {int(np.argmax([len(ix) for ix in lambda_partition(source_idx, domain_ids, labels, 4,
                                                               np.random.default_rng(seed), lam=1.0).client_indices]))
             for seed in range(20)}
    assert len(lucky) > 1


def test_every_keyword_parameter_has_a_check() -> None:
    for fn in PARTITIONERS.values():
        for name, p in inspect.signature(fn).parameters.items():
            if p.kind is p.KEYWORD_ONLY and name != "natural_groups":  # the dataset's, not the config's
                assert name in _PARAM_CHECKS, f"{fn.__name__}: no check for {name!r}"


def test_a_partitioner_parameter_named_groups_is_not_the_natural_grouping() -> None:
    # make_clients passes the dataset's natural groups (None here) beside the config's params
    rng = np.random.default_rng(0)
    domain_ids, labels = np.repeat([0, 1], 40), np.tile(np.arange(4), 20)
    p = make_partition("two_level_dirichlet", np.arange(80), domain_ids, labels, 4, rng, None,
                       groups=2, alpha_group=1.0, alpha_client=1.0)
    assert p.num_clients == 4 and np.array_equal(np.sort(np.concatenate(p.client_indices)), np.arange(80))
    # a config cannot pass the natural grouping as a parameter: one line, not a TypeError
    with pytest.raises(ValueError, match=r"^partition 'iid' takes no parameter 'natural_groups'; it takes none$"):
        make_partition("iid", np.arange(80), domain_ids, labels, 4, rng, None, natural_groups=3)
    with pytest.raises(ValueError, match=r"^partition 'dirichlet_labels': alpha must be a finite number > 0, got inf$"):
        make_partition("dirichlet_labels", np.arange(80), domain_ids, labels, 4, rng, alpha=float("inf"))


def test_a_cases_slices_go_to_one_client_whatever_the_partition() -> None:
    # 12 volumes of 5 slices over 2 domains: iid over slices spread a volume over clients (one client's holdout case
    # was another's training data); dealt out by case, every volume lands whole on one client
    from types import SimpleNamespace

    from feddg.config import build_config
    from feddg.federation.setup import partition_cases

    cases = np.repeat(np.arange(12), 5)
    ds = SimpleNamespace(cases=cases, domain_ids=np.repeat([0, 1], 30), labels=np.zeros(60, np.int64), groups=None)
    source = np.arange(60)
    for kind in ("iid", "by_domain", "dirichlet_domains"):
        params = {"alpha": 1.0} if kind == "dirichlet_domains" else {}
        cfg = build_config({"partition": {"kind": kind, "num_clients": 4, "params": params}})
        part = partition_cases(SimpleNamespace(**vars(ds)), source, cfg, np.random.default_rng(0))
        owners = [{k for k, idx in enumerate(part.client_indices) if c in cases[idx]} for c in range(12)]
        assert all(len(o) == 1 for o in owners), kind  # each volume on exactly one client
        assert np.array_equal(np.sort(np.concatenate(part.client_indices)), source), kind  # every slice, once
        assert [len(idx) % 5 for idx in part.client_indices] == [0] * 4, kind


def test_a_round_samples_the_fraction_rounded_half_up_without_float_error() -> None:
    from feddg.federation.rounds import sample_size

    assert 0.35 * 90 < 31.5 and sample_size(90, 0.35) == 32  # 31.4999… as a float: it gave 31
    assert (sample_size(45, 0.7), sample_size(100, 0.1), sample_size(20, 0.2), sample_size(3, 0.1)) == (32, 10, 4, 1)


def test_few_shot_is_refused_where_a_shots_neighbouring_slices_would_stay_in_the_test_set() -> None:
    from types import SimpleNamespace

    from feddg.config import build_config
    from feddg.federation.setup import few_shot_samples

    ds = SimpleNamespace(name="synthetic-mri", cases=np.repeat(np.arange(4), 3), domain_ids=np.repeat([0, 1], 6))
    with pytest.raises(ValueError, match=r"^split.few_shot_k: synthetic-mri keeps a case's slices together"):
        few_shot_samples(ds, [1], build_config({}, ["split.few_shot_k=1", "partition.num_clients=2"]))


def test_dirichlet_labels_shuffles_each_class_before_cutting_it() -> None:
    # domains stored one after the other (as real datasets are): an even label split must still mix both domains,
    # not give client 0 the first (domain-1) half of every class
    domain_ids, labels = np.repeat([1, 2], 300), np.tile(np.arange(3), 200)
    p = make_partition("dirichlet_labels", np.arange(600), domain_ids, labels, 2, np.random.default_rng(0), alpha=1e6)
    share = domain_counts(p, domain_ids, [1, 2]) / np.array([[len(ix)] for ix in p.client_indices])
    np.testing.assert_allclose(share, 0.5, atol=0.1)  # hypergeometric sd ~0.02 around the overall 300/600


# ------------------------------------------------------------------ two-level Dirichlet (HFedATM)


def test_two_level_dirichlet_numbers_clients_group_by_group() -> None:
    # tiny alpha_group: each domain on one group; huge alpha_client: split evenly inside it. Clients 2e, 2e+1 are
    # group e, so each domain lands on one contiguous pair, half each
    domain_ids = np.repeat(np.arange(6), 100)
    p = make_partition("two_level_dirichlet", np.arange(600), domain_ids, domain_ids, 4, np.random.default_rng(0),
                       groups=2, alpha_group=1e-3, alpha_client=1e6)
    counts = domain_counts(p, domain_ids, list(range(6)))  # [client, domain]
    pairs = counts.reshape(2, 2, 6).sum(axis=1)  # [group, domain]
    assert np.all((pairs >= 99) | (pairs <= 1))  # each domain on one group
    np.testing.assert_allclose(counts[0::2], counts[1::2], atol=6)  # halved between the pair's two clients


def test_two_level_dirichlet_alpha_client_skews_inside_a_group() -> None:
    # huge alpha_group: every group gets half of each domain; tiny alpha_client: that half goes to one of its clients
    domain_ids = np.repeat(np.arange(6), 100)
    p = make_partition("two_level_dirichlet", np.arange(600), domain_ids, domain_ids, 4, np.random.default_rng(0),
                       groups=2, alpha_group=1e6, alpha_client=1e-3)
    pairs = domain_counts(p, domain_ids, list(range(6))).reshape(2, 2, 6)  # [group, client in group, domain]
    np.testing.assert_allclose(pairs.sum(axis=1), 50, atol=2)
    assert np.all(pairs.max(axis=1) >= 0.99 * pairs.sum(axis=1))


def test_two_level_dirichlet_shuffles_a_domain_before_cutting_it() -> None:
    # one domain whose labels come in two blocks: an even split must give every client both labels about equally
    domain_ids, labels = np.zeros(400, np.int64), np.repeat([0, 1], 200)
    p = make_partition("two_level_dirichlet", np.arange(400), domain_ids, labels, 4, np.random.default_rng(0),
                       groups=2, alpha_group=1e6, alpha_client=1e6)
    share = class_counts(p, labels, 2)[:, 0] / np.array([len(ix) for ix in p.client_indices])
    np.testing.assert_allclose(share, 0.5, atol=0.15)  # hypergeometric sd ~0.04 around 200/400


def test_two_level_dirichlet_refuses_when_a_client_stays_empty() -> None:
    # 6 clients from 6 samples: every client needs exactly one, which shares this peaked (α = 0.01) almost never give
    with pytest.raises(ValueError, match="^two-level Dirichlet left a client empty in 3 draws"):
        make_partition("two_level_dirichlet", np.arange(6), np.zeros(6, np.int64), np.zeros(6, np.int64), 6,
                       np.random.default_rng(0), groups=2, alpha_group=0.01, alpha_client=0.01, max_tries=3)


# ------------------------------------------------------------------------ mutation-audit additions


def test_as_many_clients_as_samples_is_allowed() -> None:
    """The refusal is for more clients than source samples: one sample each is a valid iid split."""
    source_idx, domain_ids, labels = make_data([3, 2])
    p = make_partition("iid", source_idx, domain_ids, labels, 5, np.random.default_rng(0))
    assert sorted(ix.tolist() for ix in p.client_indices) == [[int(i)] for i in np.sort(source_idx)]


def test_lambda_rounds_by_largest_remainder() -> None:
    # sizes (70, 30), C = 3: D_c = (0, 0, 1) (the extra client goes to the larger domain); lam = 0.5, eq. 7:
    # n_{0,c} = 35/3 + 35/2 = 29.17 for c in {0, 1}, 35/3 = 11.67 for c = 2: floors 29, 29, 11, the one missing
    # sample goes to the largest remainder (c = 2); n_{1,c} = 5, 5, 5 + 15 = 20 exactly
    source_idx, domain_ids, labels = make_data([70, 30])
    for seed in range(5):
        p = lambda_partition(source_idx, domain_ids, labels, 3, np.random.default_rng(seed), lam=0.5)
        assert domain_counts(p, domain_ids, [1, 2]).T.tolist() == [[29, 29, 12], [5, 5, 20]]
        assert p.client_domains == [[1], [1], [2]]  # the assigned D_c, though every client holds both domains


@pytest.mark.parametrize("lam", [-0.1, 1.2])
def test_lambda_partition_refuses_lam_outside_0_1_when_called_directly(lam: float) -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    with pytest.raises(ValueError, match=r"^lam must be in \[0, 1\]"):
        lambda_partition(source_idx, domain_ids, labels, 3, np.random.default_rng(0), lam=lam)


def test_lambda_deals_a_shuffled_domain() -> None:
    # lam = 0, 3 domains of 40 over 6 clients: each domain halved between its two clients (no rounding); the halves
    # are random, not the domain's 20 lowest indices to its first client
    source_idx, domain_ids, labels = make_data([40, 40, 40])
    p = lambda_partition(source_idx, domain_ids, labels, 6, np.random.default_rng(0), lam=0.0)
    assert p.client_domains == [[1], [1], [2], [2], [3], [3]]
    assert [len(ix) for ix in p.client_indices] == [20] * 6
    assert not np.array_equal(p.client_indices[0], np.flatnonzero(domain_ids == 1)[:20])


def test_d_allocation_refuses_a_domain_smaller_than_its_parts() -> None:
    # N = 3, d = 2, 3 domains: a = 2, b = 0, every domain cut in 2; a 1-sample domain cannot be, a 2-sample one can
    source_idx, domain_ids, labels = make_data([1, 50, 50])
    with pytest.raises(ValueError, match="^domain 1 has 1 samples, fewer than its 2 parts$"):
        d_allocation(source_idx, domain_ids, labels, 3, np.random.default_rng(0), d=2)
    source_idx, domain_ids, labels = make_data([2, 50, 50])
    p = d_allocation(source_idx, domain_ids, labels, 3, np.random.default_rng(0), d=2)
    assert domain_counts(p, domain_ids, [1, 2, 3]).tolist() == [[1, 25, 0], [1, 0, 25], [0, 25, 25]]


def test_d_allocation_shuffled_clients_report_the_domains_they_hold() -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    for seed in range(5):
        p = d_allocation(source_idx, domain_ids, labels, 5, np.random.default_rng(seed), d=2, shuffle_clients=True)
        assert p.client_domains == [sorted(set(domain_ids[ix].tolist())) for ix in p.client_indices]


@pytest.mark.parametrize("kind,params", [("dirichlet_domains", {"alpha": 1e6}), ("dirichlet_labels", {"alpha": 1e6}),
                                         ("two_level_dirichlet", {"groups": 2, "alpha_group": 1e6, "alpha_client": 1e6})])
def test_dirichlet_max_tries_counts_the_first_draw(kind: str, params: dict[str, Any]) -> None:
    # alphas huge: the first draw feeds every client, so max_tries = 1 must be enough
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    p = make_partition(kind, source_idx, domain_ids, labels, 4, np.random.default_rng(0), max_tries=1, **params)
    assert p.num_clients == 4


@pytest.mark.parametrize(
    "kind,params,match",
    [
        ("d_allocation", {"d": True}, "d must be an integer >= 1, got True"),
        ("lambda", {"lam": True}, "lam must be a number in"),
        ("dirichlet_domains", {"alpha": True}, "alpha must be a finite number > 0"),
        ("d_allocation", {"d": 1, "shuffle_clients": 1}, "shuffle_clients must be a bool"),
        ("two_level_dirichlet", {"groups": 0}, "groups must be an integer >= 1, got 0"),
        ("two_level_dirichlet", {"groups": 1, "alpha_group": 0.0}, "alpha_group must be a finite number > 0"),
        ("two_level_dirichlet", {"groups": 1, "alpha_group": float("inf")}, "alpha_group must be a finite"),
        ("two_level_dirichlet", {"groups": 1, "alpha_client": 0.0}, "alpha_client must be a finite number > 0"),
        ("two_level_dirichlet", {"groups": 1, "alpha_client": float("nan")}, "alpha_client must be a finite"),
    ],
)
def test_make_partition_refuses_bools_and_out_of_range_group_parameters(kind: str, params: dict[str, Any],
                                                                        match: str) -> None:
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    with pytest.raises(ValueError, match=f"^partition '{kind}': {match}"):
        make_partition(kind, source_idx, domain_ids, labels, 3, np.random.default_rng(0), **params)


def test_two_level_dirichlet_refuses_duplicate_source_indices_and_more_clients_than_samples() -> None:
    """It used to deal a repeated index twice (sample 0 in two places) and to report too many clients as "left a
    client empty"; it now checks its source as every other partition does."""
    source_idx, domain_ids, labels = make_data([40, 25, 61])
    with pytest.raises(ValueError, match="^source_idx contains duplicate sample indices$"):
        make_partition("two_level_dirichlet", np.r_[source_idx, source_idx[:1]], domain_ids, labels, 4,
                       np.random.default_rng(0), groups=2)
    with pytest.raises(ValueError, match="^num_clients=4 exceeds the 3 source samples$"):
        make_partition("two_level_dirichlet", source_idx[:3], domain_ids, labels, 4, np.random.default_rng(0),
                       groups=2)


def dirichlet_reference(keys: np.ndarray, source_idx: np.ndarray, num_clients: int, alpha: float,
                        seed: int) -> list[list[int]]:
    """The documented draw rebuilt from numpy: per group (ascending key, its indices sorted) ``p ~ Dir(alpha 1_C)``,
    the shuffled group cut at ``floor(cumsum(p) n)`` (a first draw that feeds every client: no redraw)."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = [[] for _ in range(num_clients)]
    for k in np.unique(keys[source_idx]):
        g = np.sort(source_idx[keys[source_idx] == k])
        p = rng.dirichlet(np.full(num_clients, alpha))
        cuts = np.floor(np.cumsum(p)[:-1] * len(g)).astype(np.int64)
        for c, part in enumerate(np.split(rng.permutation(g), cuts)):
            out[c] += part.tolist()
    return [sorted(ix) for ix in out]


@pytest.mark.parametrize("kind", ["dirichlet_domains", "dirichlet_labels"])
@pytest.mark.parametrize("alpha", [0.7, 5.0])
def test_dirichlet_partitions_are_the_documented_draw(kind: str, alpha: float) -> None:
    source_idx, domain_ids, labels = make_data([400, 250, 610], num_classes=4)
    keys = domain_ids if kind == "dirichlet_domains" else labels
    for seed in range(3):
        p = make_partition(kind, source_idx, domain_ids, labels, 3, np.random.default_rng(seed), alpha=alpha)
        assert [ix.tolist() for ix in p.client_indices] == dirichlet_reference(keys, source_idx, 3, alpha, seed)


def test_assign_domains_and_d_allocation_break_ties_to_the_lower_domain_and_client() -> None:
    # D <= C: equal domains, the one extra client goes to the lower domain
    assert assign_domains(np.array([40, 40]), 3).tolist() == [[True, True, False], [False, False, True]]
    # D > C: equal domains in id order, each to the least-loaded client, the lower client on a tie: d0 -> c0,
    # d1 -> c1, d2 -> c0, d3 -> c1
    assert assign_domains(np.array([10, 10, 10, 10]), 2).tolist() == [[True, False], [False, True]] * 2
    # Alg. 5 with N = 2, d = 2 over three equal domains: a = 1, b = 1, the "largest" is the lowest id, halved
    source_idx, domain_ids, labels = make_data([40, 40, 40])
    p = d_allocation(source_idx, domain_ids, labels, 2, np.random.default_rng(0), d=2)
    assert p.client_domains == [[1, 2], [1, 3]]
    assert domain_counts(p, domain_ids, [1, 2, 3]).tolist() == [[20, 40, 0], [20, 0, 40]]
