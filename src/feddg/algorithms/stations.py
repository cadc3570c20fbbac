"""Station topology of a hierarchical federation (HFedATM, Algorithm 1): which station each client
belongs to, the station-round schedule, station and client sampling, and the two-level Dirichlet
partition (domains over stations, then over each station's clients)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from feddg.data.partition import Partition

ASSIGNMENTS = ("contiguous", "domain", "round_robin", "dirichlet")


@dataclass(frozen=True)
class Topology:
    """Which station each client belongs to, and the station-round schedule."""

    station_of: np.ndarray  # client id -> station
    station_rounds: int  # N
    station_fraction: float = 1.0

    @property
    def num_stations(self) -> int:
        return int(self.station_of.max()) + 1

    def server_round(self, round: int) -> int:
        return (round - 1) // self.station_rounds + 1

    def station_round(self, round: int) -> int:
        return (round - 1) % self.station_rounds + 1

    def sample(self, round: int, client_fraction: float, seed: int) -> list[int]:
        """Stations sampled once per server round (``station_fraction``), then ``client_fraction`` of
        each active station's clients every station round (Algorithm 1, line 5)."""
        s = self.num_stations
        stations = range(s)
        if self.station_fraction < 1.0:
            rng = np.random.default_rng([seed, self.server_round(round), 4_000_037])
            stations = sorted(rng.choice(s, size=_share(self.station_fraction, s), replace=False).tolist())
        out: list[int] = []
        for e in stations:
            members = np.flatnonzero(self.station_of == e)
            if client_fraction < 1.0:
                rng = np.random.default_rng([seed, round, e, 1_000_003])
                members = rng.choice(members, size=_share(client_fraction, len(members)), replace=False)
            out += [int(c) for c in members]
        return sorted(out)


def _share(fraction: float, n: int) -> int:
    return max(1, int(math.floor(fraction * n + 0.5)))


def assign_stations(kind: str, num_stations: int, client_domains: Sequence[Sequence[int]]) -> np.ndarray:
    """Station of every client.

    ``contiguous`` (and ``dirichlet``, whose partition lays clients out station by station): equal
    consecutive blocks of client ids — with the ``lambda``/``by_domain`` partitions, clients are
    numbered domain by domain, so stations are domain-coherent; ``domain``: the same after sorting
    clients by their (first) assigned domain; ``round_robin``: client ``k`` to station ``k mod S``
    (domain-mixed stations).
    """
    k = len(client_domains)
    if k < num_stations:
        raise ValueError(f"{num_stations} stations need at least as many clients, got {k}")
    blocks = np.arange(k) * num_stations // k
    if kind in ("contiguous", "dirichlet"):
        return blocks
    if kind == "round_robin":
        return np.arange(k) % num_stations
    if kind == "domain":
        order = sorted(range(k), key=lambda c: (min(client_domains[c], default=-1), c))
        out = np.empty(k, dtype=np.int64)
        out[order] = blocks
        return out
    raise ValueError(f"unknown station assignment {kind!r}; expected one of {ASSIGNMENTS}")


def two_level_dirichlet(
    source_idx: np.ndarray,
    domain_ids: np.ndarray,
    num_clients: int,
    num_stations: int,
    alpha_station: float,
    alpha_client: float,
    rng: np.random.Generator,
    max_tries: int = 100,
) -> Partition:
    """Per source domain, station shares ``~ Dir(α_station)``; inside each station, client shares
    ``~ Dir(α_client)``. Clients are numbered station by station (``C/S`` each); redrawn while a
    client is empty."""
    if num_clients % num_stations:
        raise ValueError(f"assignment=dirichlet needs num_clients ({num_clients}) divisible by stations ({num_stations})")
    per = num_clients // num_stations
    idx = np.asarray(source_idx, dtype=np.int64)
    doms = np.asarray(domain_ids)[idx]
    groups = [idx[doms == d] for d in np.unique(doms)]
    for _ in range(max_tries):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for g in groups:
            for e, part in enumerate(_dirichlet_cut(rng.permutation(g), num_stations, alpha_station, rng)):
                for i, sub in enumerate(_dirichlet_cut(part, per, alpha_client, rng)):
                    buckets[e * per + i].append(sub)
        if all(sum(len(b) for b in bs) for bs in buckets):
            client_idx = [np.sort(np.concatenate(bs)).astype(np.int64) for bs in buckets]
            domains = [sorted(int(d) for d in np.unique(np.asarray(domain_ids)[c])) for c in client_idx]
            return Partition(client_idx, domains)
    raise ValueError(f"two-level Dirichlet left a client empty in {max_tries} draws; raise the alphas or use fewer clients")


def _dirichlet_cut(samples: np.ndarray, parts: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    share = rng.dirichlet(np.full(parts, alpha))
    return np.split(samples, (np.cumsum(share)[:-1] * len(samples)).astype(np.int64))
