"""The station topology's fold (HFedATM, Algorithm 1) against weighted means built by hand: which station's state and
clients go where, and what the Gram exchange leaves to the client method."""

from __future__ import annotations

import numpy as np

from feddg.aggregation.mean import weighted_mean
from feddg.aggregation.merges import HFedATMParams
from feddg.algorithms.base import Reply
from feddg.algorithms.fedavg import FedAvg
from feddg.federation.topology import StationFold, StationTopology
from feddg.messages import Message, message_nbytes


def topology(station_of: list[int], station_rounds: int = 1, merge: str = "avg") -> StationTopology:
    return StationTopology(np.asarray(station_of), station_rounds, 1.0, merge, HFedATMParams(), None)


def station_round(topo: StationTopology, sampled: dict[int, int], replies: list[Reply]) -> StationFold:
    """One station round's fold: ``sampled`` (client → num_examples) were asked, ``replies`` came back."""
    acc = topo.start(FedAvg(), sampled)
    for r in replies:
        acc = topo.accumulate(FedAvg(), acc, r)
    return acc


def weights(p: np.ndarray) -> Message:
    return {"w/p": p}


class _KeepingFedAvg(FedAvg):
    """FedAvg that keeps every reply it folds, to show what reached the client method."""

    def keep(self, reply: Reply) -> Message:
        return dict(reply.message)


def test_only_replying_stations_are_merged_by_active_clients_and_every_station_restarts_from_it() -> None:
    topo = topology([0, 0, 1, 2, 2])  # station 1 (client 2) stays silent, and so does client 4 of station 2
    rng = np.random.default_rng(0)
    a, b, c = (rng.normal(size=64) for _ in range(3))  # float64: the fold's bits are the weighted mean's bits
    stale = [weights(np.full(64, 100.0 * (e + 1))) for e in range(3)]
    state = {"weights": stale[0], "round": 0, "stations": [{"weights": w, "tag": e} for e, w in enumerate(stale)]}
    acc = station_round(topo, {0: 10, 1: 30, 3: 5},
                        [Reply(0, {**weights(a), "num_examples": 10}), Reply(1, {**weights(b), "num_examples": 30}),
                         Reply(3, {**weights(c), "num_examples": 5})])
    new, metrics = topo.finish(FedAvg(), state, acc, 1)
    station0 = weighted_mean([a, b], [10, 30])  # FedAvg by examples within the station
    merged = weighted_mean([station0, c], [2, 1])  # γ_e = active clients (eq. 7); the silent station takes no part
    assert np.array_equal(new["weights"]["w/p"], merged)
    assert all(np.array_equal(s["weights"]["w/p"], merged) for s in new["stations"])  # the silent one too
    assert [s["tag"] for s in new["stations"]] == [0, 1, 2]  # each station's own state, finished in place
    assert metrics["hfl/active_stations"] == 2
    assert metrics["hfl/bytes_station_up"] == 2 * message_nbytes(weights(a))
    assert metrics["hfl/bytes_station_down"] == 3 * message_nbytes(weights(a))  # sent to every station


def test_a_stations_grams_are_kept_by_layer_out_of_the_client_methods_fold() -> None:
    topo = topology([0, 0], merge="hfedatm-no-fot")
    gram = np.eye(2, dtype=np.float32)
    acc = topo.start(_KeepingFedAvg(), {0: 4})
    acc = topo.accumulate(_KeepingFedAvg(), acc, Reply(0, {**weights(np.ones(2)), "gram/fc": gram, "num_examples": 4}))
    assert set(acc.stations[0].kept[0].message) == {"w/p", "num_examples"}
    assert [list(g) for g in acc.grams[0]] == [["fc"]] and np.array_equal(acc.grams[0][0]["fc"], gram)  # by layer
