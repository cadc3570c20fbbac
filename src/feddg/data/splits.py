"""Train / validation / test splits over domains, and the per-client id-validation holdout.

Two out-of-domain protocols are used by the papers:

* **leave-one-domain-out** (LODO; DomainBed, FedSR, hFedF §5.1, PARDON Table II): every
  domain but the target is a source domain, the target domain is the ood test set.
* **leave-two-domains-out** (LTDO; Bai et al., PARDON Table I): one held-out domain is the
  ood *validation* domain (model selection), another the ood *test* domain, the rest are
  source domains.

With the ``federated`` protocol (FedFA Tables 3-5) no domain is held out (:func:`every_domain_trains`): the
figures are the clients' own held-out data only.

The in-domain validation set is carved out of each client's own data afterwards with
:func:`holdout_split` (hFedF §5.1: "Each client retains 10% of its source data as a
validation set").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class DomainSplit:
    """Which domains, and which sample indices, play which role.

    Attributes:
        source_domains: sorted ids of the training domains (partitioned over clients).
        val_domains: ids of the ood validation domains; empty for LODO.
        test_domains: ids of the ood test (target) domains.
        source_idx: sorted int64 sample indices of the source domains.
        val_idx: sorted int64 sample indices of the validation domains (maybe empty).
        test_idx: sorted int64 sample indices of the test domains.
    """

    source_domains: list[int]
    val_domains: list[int]
    test_domains: list[int]
    source_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray


def _present_domains(domain_ids: np.ndarray) -> list[int]:
    return [int(d) for d in np.unique(domain_ids)]


def _indices_of(domain_ids: np.ndarray, domains: list[int]) -> np.ndarray:
    return np.flatnonzero(np.isin(domain_ids, domains)).astype(np.int64)


def _domain_split(domain_ids: np.ndarray, val_domains: list[int], test_domains: list[int]) -> DomainSplit:
    domain_ids = np.asarray(domain_ids)
    present = _present_domains(domain_ids)
    for role, d in [("val", v) for v in val_domains] + [("test", t) for t in test_domains]:
        if d not in present:
            raise ValueError(f"{role} domain {d} has no samples; domains present: {present}")
    held_out = set(val_domains) | set(test_domains)
    source = [d for d in present if d not in held_out]
    if not source:
        raise ValueError(f"no source domain left after holding out {sorted(held_out)}")
    return DomainSplit(
        source_domains=source,
        val_domains=list(val_domains),
        test_domains=list(test_domains),
        source_idx=_indices_of(domain_ids, source),
        val_idx=_indices_of(domain_ids, val_domains),
        test_idx=_indices_of(domain_ids, test_domains),
    )


def leave_one_domain_out(domain_ids: np.ndarray, target: int) -> DomainSplit:
    """LODO: ``target`` is the ood test domain, all other domains present are sources.

    Args:
        domain_ids: domain id of every sample, ``[N]``.
        target: the held-out test domain; must occur in ``domain_ids``.
    """
    return _domain_split(domain_ids, val_domains=[], test_domains=[int(target)])


def every_domain_trains(domain_ids: np.ndarray) -> DomainSplit:
    """No held-out domain (FedFA's federated tables): every domain present is a source, the ood sets are empty."""
    return _domain_split(domain_ids, val_domains=[], test_domains=[])


def leave_domains_out(domain_ids: np.ndarray, targets: list[int]) -> DomainSplit:
    """Several held-out test domains (hundreds of natural domains: a fraction of them), all others sources."""
    if len(set(targets)) != len(targets) or not targets:
        raise ValueError(f"held-out domains must be distinct and at least one, got {targets}")
    return _domain_split(domain_ids, val_domains=[], test_domains=[int(t) for t in targets])


def leave_two_domains_out(domain_ids: np.ndarray, val_domain: int, test_domain: int) -> DomainSplit:
    """LTDO (PARDON Table I): one ood validation domain, one ood test domain, rest sources.

    Args:
        domain_ids: domain id of every sample, ``[N]``.
        val_domain: domain used for ood model selection.
        test_domain: domain used for the reported ood accuracy; must differ from
            ``val_domain``.
    """
    if val_domain == test_domain:
        raise ValueError(f"val_domain and test_domain must differ, both are {val_domain}")
    return _domain_split(domain_ids, val_domains=[int(val_domain)], test_domains=[int(test_domain)])


def holdout_split_by_case(
    indices: np.ndarray, cases: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`holdout_split` over whole cases: ``floor(fraction * #cases)`` of the client's cases (at least one when
    ``fraction > 0`` and it has two, at most all but one) are held out with all their samples, so no case has
    samples on both sides. ``cases`` is the per-sample case id of the whole dataset."""
    indices = np.asarray(indices, dtype=np.int64)
    own = np.unique(cases[indices])
    _, held_cases = holdout_split(own, fraction, rng)
    hold = np.isin(cases[indices], held_cases)
    return np.sort(indices[~hold]), np.sort(indices[hold])


def holdout_split(indices: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's ``indices`` into ``(train, holdout)`` uniformly at random.

    The holdout has ``floor(fraction * n)`` samples, but at least 1 when ``fraction > 0``
    and ``n > 1``, and at most ``n - 1`` so the client always keeps training data;
    ``fraction = 0`` (or ``n <= 1``) gives an empty holdout. Not stratified. Both arrays
    are returned sorted, as int64.

    Args:
        indices: the client's global sample indices.
        fraction: share to hold out, in ``[0, 1)`` (hFedF §5.1 uses 0.1).
        rng: source of the random choice.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    indices = np.asarray(indices, dtype=np.int64)
    n = len(indices)
    n_hold = 0
    if fraction > 0 and n > 1:
        n_hold = min(max(1, int(np.floor(fraction * n + 1e-9))), n - 1)
    perm = rng.permutation(indices)
    return np.sort(perm[n_hold:]), np.sort(perm[:n_hold])
