"""Client partitioners: how the source-domain samples are dealt out to clients.

Every partitioner has the signature ``fn(source_idx, domain_ids, labels, num_clients, rng,
*, <params>) -> Partition``. ``source_idx`` are the global indices of the source samples;
``domain_ids`` and ``labels`` are the *full* per-sample arrays (indexed by global sample
index). All randomness comes from ``rng``, so an equally seeded generator gives the same
partition. Every partitioner deals out each source sample to exactly one client.

See ``docs/partitions.md`` for how the paper algorithms were read.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class Partition:
    """The result of a partitioner.

    Attributes:
        client_indices: per client, its global sample indices, sorted ascending (int64).
        client_domains: per client, the sorted domain ids the partitioner *assigned* to it
            (``D_c`` of HFedATM supplement eq. 7 for ``lambda``, the ``d`` domains of hFedF
            Algorithm 5 for ``d_allocation``, the single domain for ``by_domain``); for
            partitioners that assign no domains (``iid``, ``dirichlet_*``) the domains
            present in the client's data.
    """

    client_indices: list[np.ndarray]
    client_domains: list[list[int]]

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)


# ---------------------------------------------------------------------------- helpers


def _source(source_idx: np.ndarray, num_clients: int) -> np.ndarray:
    """Validated int64 copy of ``source_idx``."""
    idx = np.asarray(source_idx, dtype=np.int64)
    if idx.ndim != 1 or len(idx) == 0:
        raise ValueError("source_idx must be a non-empty 1-d array of sample indices")
    if len(np.unique(idx)) != len(idx):
        raise ValueError("source_idx contains duplicate sample indices")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(idx):
        raise ValueError(f"num_clients={num_clients} exceeds the {len(idx)} source samples")
    return idx


def _group(idx: np.ndarray, keys: np.ndarray) -> dict[int, np.ndarray]:
    """``idx`` grouped by ``keys[idx]``, groups in ascending key order, each sorted."""
    k = np.asarray(keys)[idx]
    return {int(v): np.sort(idx[k == v]) for v in np.unique(k)}


def _split(indices: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Consecutive chunks of ``indices`` with the given sizes (which sum to its length)."""
    return np.split(indices, np.cumsum(counts)[:-1])


def _finish(
    buckets: list[list[np.ndarray]], client_domains: list[list[int]] | None, domain_ids: np.ndarray
) -> Partition:
    """Concatenate and sort each client's chunks; default ``client_domains`` to those held.

    Raises if a client got no sample (e.g. more clients than a small domain can feed).
    """
    client_indices = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
    empty = [c for c, ix in enumerate(client_indices) if len(ix) == 0]
    if empty:
        raise ValueError(f"clients {empty} received no samples; use fewer clients")
    if client_domains is None:
        client_domains = [[int(d) for d in np.unique(np.asarray(domain_ids)[ix])] for ix in client_indices]
    return Partition(client_indices, [sorted(ds) for ds in client_domains])


def _round_rows(expected: np.ndarray, totals: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integer matrix with row sums ``totals`` (the exact row sums of ``expected``) and
    every entry within 1 of ``expected``.

    Largest-remainder rounding per row (domain): floor everything, then give the missing
    units to the entries with the largest fractional parts. Ties go to the column (client)
    with the fewest samples so far, then at random, so that e.g. with ``lam = 1`` the
    leftover samples of successive domains go to different clients.
    """
    floors = np.floor(expected + 1e-9).astype(np.int64)
    out = floors.copy()
    for r in range(expected.shape[0]):
        missing = int(totals[r]) - int(floors[r].sum())
        running = out[:r].sum(axis=0) + floors[r]
        order = np.lexsort((rng.random(expected.shape[1]), running, -(expected[r] - floors[r])))
        out[r, order[:missing]] += 1
    return out


def _dirichlet_split(
    groups: list[np.ndarray], num_clients: int, alpha: float, rng: np.random.Generator, max_tries: int
) -> list[list[np.ndarray]]:
    """Per group, proportions over clients ~ Dir(alpha); redraw until no client is empty."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    for _ in range(max_tries):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for g in groups:
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(p)[:-1] * len(g)).astype(np.int64)
            for c, part in enumerate(np.split(rng.permutation(g), cuts)):
                buckets[c].append(part)
        if all(sum(len(part) for part in b) > 0 for b in buckets):
            return buckets
    raise ValueError(
        f"Dirichlet(alpha={alpha}) left some of the {num_clients} clients empty in all "
        f"{max_tries} draws; raise alpha or max_tries, or use fewer clients"
    )


# ----------------------------------------------------------------------- partitioners


def iid(
    source_idx: np.ndarray, domain_ids: np.ndarray, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> Partition:
    """Uniform random split into ``num_clients`` parts whose sizes differ by at most 1."""
    idx = _source(source_idx, num_clients)
    parts = np.array_split(rng.permutation(idx), num_clients)
    return _finish([[p] for p in parts], None, domain_ids)


def by_domain(
    source_idx: np.ndarray, domain_ids: np.ndarray, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> Partition:
    """Each source domain split evenly over ``num_clients / num_domains`` clients of its own.

    With ``num_clients == num_domains`` this is the classic FedDG setup of one whole domain
    per client. Clients are laid out domain by domain (clients ``0..k-1`` hold the first
    domain, and so on).
    """
    idx = _source(source_idx, num_clients)
    groups = _group(idx, domain_ids)
    if num_clients % len(groups):
        raise ValueError(
            f"by_domain needs num_clients to be a multiple of the {len(groups)} source domains, got {num_clients}"
        )
    per_domain = num_clients // len(groups)
    buckets: list[list[np.ndarray]] = []
    client_domains: list[list[int]] = []
    for d, members in groups.items():
        buckets += [[p] for p in np.array_split(rng.permutation(members), per_domain)]
        client_domains += [[d]] * per_domain
    return _finish(buckets, client_domains, domain_ids)


def assign_domains(domain_sizes: np.ndarray, num_clients: int) -> np.ndarray:
    """The assignment ``D_c`` of HFedATM supplement eq. 7, as a bool matrix ``[D, C]``.

    Eq. 7 only says the algorithm "first assigns a subset of domain indices D_c to one or
    more clients"; this follows Bai et al.'s benchmark:

    * ``D <= C``: every client gets one domain; each domain starts with one client and the
      remaining clients go, one at a time, to the domain with the most samples per client
      (ties to the lower domain). Clients are laid out domain by domain.
    * ``D > C``: every domain goes to one client; domains, largest first, go to the client
      with the fewest samples so far (ties to the lower client).
    """
    sizes = np.asarray(domain_sizes, dtype=np.float64)
    n_domains = len(sizes)
    assigned = np.zeros((n_domains, num_clients), dtype=bool)
    if n_domains <= num_clients:
        clients_per_domain = np.ones(n_domains, dtype=np.int64)
        for _ in range(num_clients - n_domains):
            clients_per_domain[np.argmax(sizes / clients_per_domain)] += 1
        assigned[np.repeat(np.arange(n_domains), clients_per_domain), np.arange(num_clients)] = True
    else:
        load = np.zeros(num_clients)
        for d in np.argsort(-sizes, kind="stable"):
            c = int(np.argmin(load))
            assigned[d, c] = True
            load[c] += sizes[d]
    return assigned


def lambda_counts(domain_sizes: np.ndarray, assigned: np.ndarray, lam: float) -> np.ndarray:
    """Real-valued ``n_{d,c}(lambda)`` of HFedATM supplement eq. 7, ``[D, C]``.

    ``n_{d,c} = lam * n_d / C + (1 - lam) * 1[d in D_c] * n_d / |{c' : d in D_c'}|``.
    """
    n_d = np.asarray(domain_sizes, dtype=np.float64)[:, None]
    num_clients = assigned.shape[1]
    holders = assigned.sum(axis=1, keepdims=True)
    return lam * n_d / num_clients + (1.0 - lam) * assigned * n_d / holders


def lambda_partition(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    lam: float,
) -> Partition:
    """Bai et al.'s heterogeneous partition, HFedATM supplement eq. 7 (PARDON §IV-A).

    Client ``c`` receives ``n_{d,c}(lam)`` samples of domain ``d`` (:func:`lambda_counts`),
    rounded to integers that keep every domain's total and stay within 1 of eq. 7. Within
    a domain the samples are shuffled and dealt out in consecutive chunks. ``lam = 1`` is
    iid over domains; ``lam = 0`` gives every client only its assigned domains ``D_c``
    (:func:`assign_domains`), which ``client_domains`` reports.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    idx = _source(source_idx, num_clients)
    groups = _group(idx, domain_ids)
    domains = list(groups)
    sizes = np.array([len(groups[d]) for d in domains])
    assigned = assign_domains(sizes, num_clients)
    counts = _round_rows(lambda_counts(sizes, assigned, lam), sizes, rng)
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for d, row in zip(domains, counts):
        for c, part in enumerate(_split(rng.permutation(groups[d]), row)):
            buckets[c].append(part)
    client_domains = [[domains[k] for k in np.flatnonzero(assigned[:, c])] for c in range(num_clients)]
    return _finish(buckets, client_domains, domain_ids)


def d_allocation(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    d: int,
    shuffle_clients: bool = False,
) -> Partition:
    """hFedF Algorithm 5 ("Data split"): every client holds exactly ``d`` source domains.

    ``a = floor(N d / |Z_src|)``, ``b = (N d) mod |Z_src|``; the ``b`` largest domains
    (ties to the lower domain id) are split at random into ``a + 1`` equal parts, the others
    into ``a`` (sizes differ by at most 1). Then ``d`` times, for each client ``i = 1..N``,
    the client takes the first remaining part of the first domain (in domain-id order)
    that still has parts. Each domain has at most ``N`` parts, so the ``d`` parts a client
    takes come from ``d`` distinct domains.

    ``shuffle_clients=True`` additionally permutes which client receives which bundle of
    parts, the reading of hFedF §C.8.1 ("the partitions are randomly distributed among the
    clients"); the default follows the algorithm box, which assigns them in order.
    """
    idx = _source(source_idx, num_clients)
    groups = _group(idx, domain_ids)
    domains = list(groups)
    if not 1 <= d <= len(domains):
        raise ValueError(f"d must be in [1, {len(domains)}] (the number of source domains), got {d}")
    a, b = divmod(num_clients * d, len(domains))
    if a == 0:
        raise ValueError(
            f"num_clients * d = {num_clients * d} is below the {len(domains)} source domains: "
            f"Algorithm 5 would give {len(domains) - b} domains no client"
        )
    sizes = np.array([len(groups[dom]) for dom in domains])
    largest = set(np.argsort(-sizes, kind="stable")[:b].tolist())
    subsets: dict[int, deque[np.ndarray]] = {}
    for k, dom in enumerate(domains):
        n_parts = a + 1 if k in largest else a
        if sizes[k] < n_parts:
            raise ValueError(f"domain {dom} has {sizes[k]} samples, fewer than its {n_parts} parts")
        subsets[dom] = deque(np.array_split(rng.permutation(groups[dom]), n_parts))
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    client_domains: list[list[int]] = [[] for _ in range(num_clients)]
    for _ in range(d):
        for i in range(num_clients):
            for dom in domains:
                if subsets[dom]:
                    buckets[i].append(subsets[dom].popleft())
                    client_domains[i].append(dom)
                    break
    order = rng.permutation(num_clients) if shuffle_clients else np.arange(num_clients)
    return _finish([buckets[i] for i in order], [client_domains[i] for i in order], domain_ids)


def dirichlet_domains(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    max_tries: int = 100,
) -> Partition:
    """Domain skew: per source domain, client proportions ``p ~ Dir(alpha * 1_C)``.

    Each domain's shuffled samples are cut at ``floor(cumsum(p) * n_d)``. Large ``alpha``
    approaches an even split, small ``alpha`` puts each domain on few clients. The whole
    draw is repeated (up to ``max_tries`` times) while some client is left empty.
    """
    idx = _source(source_idx, num_clients)
    buckets = _dirichlet_split(list(_group(idx, domain_ids).values()), num_clients, alpha, rng, max_tries)
    return _finish(buckets, None, domain_ids)


def dirichlet_labels(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    max_tries: int = 100,
) -> Partition:
    """Label skew (Hsu et al. 2019): per class, client proportions ``p ~ Dir(alpha * 1_C)``.

    Same cutting and empty-client guard as :func:`dirichlet_domains`, grouping by label.
    """
    idx = _source(source_idx, num_clients)
    buckets = _dirichlet_split(list(_group(idx, labels).values()), num_clients, alpha, rng, max_tries)
    return _finish(buckets, None, domain_ids)


def two_level_dirichlet(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    groups: int,
    alpha_group: float = 1.0,
    alpha_client: float = 1.0,
    max_tries: int = 100,
) -> Partition:
    """Two-level domain skew for a station topology (HFedATM): per source domain, group (station)
    shares ``~ Dir(alpha_group)``; inside each group, client shares ``~ Dir(alpha_client)``.

    Clients are numbered group by group (``num_clients / groups`` each), so a ``contiguous``
    station assignment with ``groups`` stations puts each group on one station. Redrawn while a
    client is empty.
    """
    if num_clients % groups:
        raise ValueError(f"partition 'two_level_dirichlet': num_clients ({num_clients}) must be a multiple of "
                         f"groups ({groups})")
    per = num_clients // groups
    idx = _source(source_idx, num_clients)
    doms = np.asarray(domain_ids)[idx]
    parts = [idx[doms == d] for d in np.unique(doms)]
    for _ in range(max_tries):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for g in parts:
            for e, part in enumerate(_dirichlet_cut(rng.permutation(g), groups, alpha_group, rng)):
                for i, sub in enumerate(_dirichlet_cut(part, per, alpha_client, rng)):
                    buckets[e * per + i].append(sub)
        if all(sum(len(b) for b in bs) for bs in buckets):
            client_idx = [np.sort(np.concatenate(bs)).astype(np.int64) for bs in buckets]
            domains = [sorted(int(d) for d in np.unique(np.asarray(domain_ids)[c])) for c in client_idx]
            return Partition(client_idx, domains)
    raise ValueError(f"two-level Dirichlet left a client empty in {max_tries} draws; raise the alphas or use fewer "
                     "clients")


def _dirichlet_cut(samples: np.ndarray, parts: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    share = rng.dirichlet(np.full(parts, alpha))
    return np.split(samples, (np.cumsum(share)[:-1] * len(samples)).astype(np.int64))


def natural(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    natural_groups: np.ndarray,
) -> Partition:
    """Each natural group of the source samples (a writer, a camera, a hospital: ``DomainDataset.groups``) is one
    client as it is — no resampling, as FedScale and FedFA do for FEMNIST — clients in ascending group id;
    ``num_clients`` is not used (the groups decide). ``client_domains``: the domains of each group's samples."""
    idx = _source(source_idx, 1)
    by_group = _group(idx, natural_groups)
    return Partition(list(by_group.values()), [sorted({int(d) for d in np.asarray(domain_ids)[ix]})
                                               for ix in by_group.values()])


# --------------------------------------------------------------------------- registry

PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "iid": iid,
    "by_domain": by_domain,
    "lambda": lambda_partition,
    "d_allocation": d_allocation,
    "dirichlet_domains": dirichlet_domains,
    "dirichlet_labels": dirichlet_labels,
    "two_level_dirichlet": two_level_dirichlet,
    "natural": natural,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


_PARAM_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lam": (lambda v: _is_real(v) and 0.0 <= v <= 1.0, "must be a number in [0, 1]"),
    "d": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "alpha": (lambda v: _is_real(v) and 0 < v < math.inf, "must be a finite number > 0"),
    "alpha_group": (lambda v: _is_real(v) and 0 < v < math.inf, "must be a finite number > 0"),
    "alpha_client": (lambda v: _is_real(v) and 0 < v < math.inf, "must be a finite number > 0"),
    "groups": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "max_tries": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "shuffle_clients": (lambda v: isinstance(v, bool), "must be a bool"),
}


def make_partition(
    kind: str,
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    natural_groups: np.ndarray | None = None,
    /,
    **params: Any,
) -> Partition:
    """Run the partitioner registered as ``kind`` after checking its parameters; ``natural_groups`` (each sample's
    natural group, ``DomainDataset.groups``, or ``None``) goes to the partitioners that take it.

    Unknown kinds, unknown or missing parameters and out-of-range values fail with a
    ``ValueError`` that names the kind and the offending key (:func:`check_partition`).
    """
    grouped = check_partition(kind, params)
    if grouped:
        if natural_groups is None:
            raise ValueError(f"partition {kind!r} makes a client of each natural group, and this dataset has none "
                             "(DomainDataset.groups)")
        params = {**params, "natural_groups": natural_groups}
    return PARTITIONERS[kind](source_idx, domain_ids, labels, num_clients, rng, **params)


def check_partition(kind: str, params: dict[str, Any]) -> bool:
    """Refuse an unknown ``kind``, an unknown or missing parameter, an out-of-range value (no data needed: the
    config checks it when it loads); whether the partitioner takes the dataset's natural groups."""
    if kind not in PARTITIONERS:
        raise ValueError(f"unknown partition kind {kind!r}; available: {sorted(PARTITIONERS)}")
    keyword = {n: p for n, p in inspect.signature(PARTITIONERS[kind]).parameters.items() if p.kind is p.KEYWORD_ONLY}
    grouped = keyword.pop("natural_groups", None) is not None  # the dataset's, never a config's parameter
    for key in params:
        if key not in keyword:
            raise ValueError(f"partition {kind!r} takes no parameter {key!r}; it takes {sorted(keyword) or 'none'}")
    for key, p in keyword.items():
        if p.default is p.empty and key not in params:
            raise ValueError(f"partition {kind!r} needs parameter {key!r}")
    for key, value in params.items():
        check, rule = _PARAM_CHECKS[key]
        if not check(value):
            raise ValueError(f"partition {kind!r}: {key} {rule}, got {value!r}")
    return grouped
