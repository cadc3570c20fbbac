"""The station topology's fold (HFedATM, Algorithm 1) against weighted means built by hand: which station's state and
clients go where, and what the Gram exchange leaves to the client method."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from support.dp_reference import accounted_gaussian
from torch import nn

from feddg.aggregation.mean import weighted_mean
from feddg.aggregation.merges import HFedATMParams
from feddg.algorithms.base import Reply, ServerState
from feddg.algorithms.fedavg import FedAvg
from feddg.federation.topology import StationFold, StationTopology, Topology, assign_stations, station_summary
from feddg.messages import Message, message_nbytes, weights_of
from feddg.models.permutation import sequential_spec


def topology(station_of: list[int], station_rounds: int = 1, merge: str = "avg",
             params: HFedATMParams | None = None, spec: Any = None) -> StationTopology:
    return StationTopology(np.asarray(station_of), station_rounds, 1.0, merge, params or HFedATMParams(), spec)


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


def test_a_flat_federation_draws_a_new_sample_of_the_rounded_fraction_every_round() -> None:
    draws = [Topology(10).sample(t, 0.3, seed=0) for t in range(1, 11)]
    assert all(len(set(d)) == 3 and d == sorted(d) and set(d) <= set(range(10)) for d in draws)  # round(0.3 · 10)
    assert len({tuple(d) for d in draws}) > 1  # not one fixed subset for the whole run


def test_a_station_resamples_its_clients_every_station_round_independently_of_the_others() -> None:
    topo = topology([0] * 6 + [1] * 6, station_rounds=8)
    draws = [topo.sample(t, 0.5, seed=0) for t in range(1, 9)]  # the 8 station rounds of server round 1
    assert all(len([c for c in d if c < 6]) == 3 and len([c for c in d if c >= 6]) == 3 for d in draws)
    assert len({tuple(d) for d in draws}) > 1  # Algorithm 1, line 5: every station round, not once a server round
    # each station has its own stream: station 1 does not pick the same positions among its members as station 0
    assert any([c for c in d if c < 6] != [c - 6 for c in d if c >= 6] for d in draws)


def test_clients_evaluate_their_stations_model_and_the_global_one_is_the_merged_model() -> None:
    topo = topology([0, 1, 1])
    merged, own = weights(np.zeros(2)), [weights(np.full(2, e + 1.0)) for e in range(2)]
    state = {"weights": merged, "round": 2, "stations": [{"weights": w} for w in own]}
    assert topo.eval_weights(FedAvg(), state, None) is merged
    assert [topo.eval_weights(FedAvg(), state, c) for c in range(3)] == [own[0], own[1], own[1]]


class _SetupCounting(FedAvg):
    """FedAvg whose one-time setup records how many replies it saw, to show which stations were set up."""

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        return {**state, "setup": len(replies)}


def test_the_one_time_setup_is_applied_to_every_station() -> None:
    topo = topology([0, 1, 2])
    state = {"weights": weights(np.zeros(1)), "stations": [{"weights": weights(np.zeros(1))} for _ in range(3)]}
    new = topo.server_setup(_SetupCounting(), state, [Reply(c, {"num_examples": 1}) for c in range(3)])
    assert [s.get("setup") for s in new["stations"]] == [3, 3, 3]


def test_aligned_merge_sends_every_station_the_model_and_every_aligned_station_its_permutations() -> None:
    model = nn.Sequential(nn.Conv2d(1, 3, 1), nn.Flatten(), nn.Linear(3, 2))  # one group of 3 channels
    topo = topology([0, 1, 2], merge="hfedatm-no-regmean", spec=sequential_spec(model))
    w = weights_of(model)
    state = {"weights": w, "round": 0, "stations": [{"weights": w} for _ in range(3)]}
    acc = station_round(topo, {0: 1, 1: 1}, [Reply(c, {**w, "num_examples": 1}) for c in (0, 1)])
    _, metrics = topo.finish(FedAvg(), state, acc, 1)
    # all 3 stations get the model; the 1 station aligned to the reference gets 3 int64 indices
    assert metrics["hfl/bytes_station_down"] == 3 * message_nbytes(w) + 8 * 3 * 1


def test_summary_counts_only_complete_server_rounds_and_their_time_without_evaluation() -> None:
    topo = topology([0, 1], station_rounds=2, merge="hfedatm-no-fot",
                    params=HFedATMParams(gram_pass="after", dp_epsilon=1.0))
    # engine rounds 1..5: server rounds 1 and 2 are complete, 3 has only its first station round
    rows = [{"round": t, "time_round_s": float(t), "time_eval_s": 0.5 * (t % 2 == 0)} for t in range(1, 6)]
    rows[-1].update({"regmean/fc1/cond": 1.0, "regmean/fc2/cond": 1.0})  # two Gram layers
    out = station_summary(topo, rows)
    assert out["server_rounds"] == 2
    assert out["per_server_round"]["time_s"] == pytest.approx(((1 + 1.5) + (3 + 3.5)) / 2)  # rounds (1, 2), (3, 4)
    assert out["dp_gram_releases"] == 2 * 2  # per complete server round, every Gram layer
    assert out["dp_epsilon_total_basic"] == pytest.approx(4 * 1.0)


def test_contiguous_stations_are_blocks_of_floor_k_s_over_k_when_clients_do_not_divide() -> None:
    doms: list[tuple[int, ...]] = [(0,)] * 7
    assert assign_stations("contiguous", 3, doms).tolist() == [0, 0, 0, 1, 1, 2, 2]  # ⌊3k/7⌋
    assert assign_stations("contiguous", 2, doms[:5]).tolist() == [0, 0, 0, 1, 1]
    assert assign_stations("round_robin", 3, doms[:3]).tolist() == [0, 1, 2]  # as many stations as clients


def test_domain_stations_order_clients_by_their_first_domain_then_by_id() -> None:
    # first (lowest) domains 1, 0, 0, 2 -> order 1, 2, 0, 3 -> stations 1, 0, 0, 1
    assert assign_stations("domain", 2, [(1, 2), (0, 2), (0, 1), (2,)]).tolist() == [1, 0, 0, 1]
    # a tie across the block boundary goes by client id; a client without domains comes first
    assert assign_stations("domain", 2, [(0,), (0,), (0,), (1,)]).tolist() == [0, 0, 1, 1]
    assert assign_stations("domain", 2, [(0,), (), (1,), (1,)]).tolist() == [0, 0, 1, 1]


def _swap_channels(w: Message, perm: np.ndarray) -> Message:
    """``w`` of ``Conv2d(2, 3, 1) → Flatten → Linear(3, 2)`` with the conv's output channels permuted (the same
    function: the linear layer's input columns move with them)."""
    return {**w, "w/0.weight": w["w/0.weight"][perm], "w/0.bias": w["w/0.bias"][perm],
            "w/2.weight": w["w/2.weight"][:, perm]}


def test_the_aligned_merge_takes_the_lowest_active_station_as_reference_whatever_order_replies_arrive_in() -> None:
    torch.manual_seed(0)  # two inputs per filter: FOT compares L2-normalised filters (eq. 2), 1-element ones all look alike
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.Flatten(), nn.Linear(3, 2))
    topo = topology([0, 1], merge="hfedatm-no-regmean", params=HFedATMParams(solver="hungarian"),
                    spec=sequential_spec(model))
    w0 = weights_of(model)
    w1 = _swap_channels(w0, np.array([2, 0, 1]))  # station 1: station 0's model with its channels permuted
    assert not np.array_equal(w1["w/0.weight"], w0["w/0.weight"])
    state = {"weights": w0, "round": 0, "stations": [{"weights": w0}, {"weights": w1}]}
    replies = {0: Reply(0, {**w0, "num_examples": 1}), 1: Reply(1, {**w1, "num_examples": 1})}
    for order in ((0, 1), (1, 0)):  # FOT aligns the others to station 0, so the merge is station 0's model
        new, _ = topo.finish(FedAvg(), state, station_round(topo, {0: 1, 1: 1}, [replies[c] for c in order]), 1)
        assert all(np.allclose(new["weights"][k], w0[k], rtol=0, atol=1e-6) for k in w0), order


class _Members(FedAvg):
    """FedAvg whose stations remember which clients they serve; its setup request names the station asked."""

    def station_init(self, station: ServerState, members: list[int]) -> ServerState:
        return {**station, "members": members}

    def setup_request(self, state: ServerState) -> Message | None:
        return {"members": state["members"]}


def test_each_station_starts_knowing_its_own_clients_and_the_setup_request_is_a_stations() -> None:
    topo = topology([1, 0, 1, 2])
    state = topo.init(_Members(), nn.Linear(2, 1), None)
    assert [s["members"] for s in state["stations"]] == [[1], [0, 2], [3]]
    assert topo.setup_request(_Members(), state) == {"members": [1]}  # the method asked with station 0's state


def test_summary_sums_a_server_rounds_traffic_over_its_station_rounds_and_the_runs_fallbacks() -> None:
    topo = topology([0, 1], station_rounds=2)
    rows = [{"round": t, "bytes_up": 10 * t, "bytes_down": 1000 * t, "regmean/fallbacks": t % 2 + 1,
             "fot/moved": 0.25 * t} for t in range(1, 5)]
    out = station_summary(topo, rows)
    per = out["per_server_round"]
    assert per["bytes_client_up"] == ((10 + 20) + (30 + 40)) / 2  # server rounds (1, 2) and (3, 4)
    assert per["bytes_client_down"] == ((1000 + 2000) + (3000 + 4000)) / 2
    assert out["regmean_fallbacks"] == 2 + 1 + 2 + 1  # every station round's, summed
    assert out["fot_moved_mean"] == pytest.approx((0.25 + 0.5 + 0.75 + 1.0) / 4, abs=1e-12)


def test_summary_accounts_every_gram_layer_of_every_complete_server_round() -> None:
    topo = topology([0, 1], station_rounds=1, merge="hfedatm-no-fot",
                    params=HFedATMParams(gram_pass="after", dp_epsilon=1.0, dp_clip=2.0))
    rows = [{"round": t} for t in (1, 2, 3)]
    rows[-1].update({"regmean/fc1/cond": 1.0, "regmean/fc2/cond": 1.0})  # two Gram layers
    privacy = station_summary(topo, rows)["privacy"]
    assert privacy["releases"] == 3 * 2 and privacy["sensitivity"] == 2.0**2  # C² per sample
    z = topo.dp_sigma / 2.0**2
    assert privacy["epsilon"] == pytest.approx(accounted_gaussian(RdpAccountant, z, 6, 1e-5), rel=1e-9)


def test_every_station_keeps_its_own_copy_of_the_methods_state() -> None:
    state = topology([0, 1, 1]).init(FedAvg(), nn.Linear(2, 1), None)
    state["stations"][0]["weights"]["w/bias"] += 1.0  # in place, in station 0 only
    assert state["stations"][1]["weights"]["w/bias"] == state["weights"]["w/bias"]


def test_a_gram_merge_uploads_each_stations_model_and_grams_and_records_the_engine_round() -> None:
    topo = topology([0, 1], merge="hfedatm-no-fot")
    rng = np.random.default_rng(0)
    w = [{"w/fc.weight": rng.normal(size=(2, 3)).astype(np.float32)} for _ in range(2)]
    gram = (lambda x: x.T @ x)(rng.normal(size=(5, 3))).astype(np.float32)
    state = {"weights": w[0], "round": 2, "stations": [{"weights": v} for v in w]}
    acc = station_round(topo, {0: 4, 1: 4}, [Reply(c, {**w[c], "gram/fc": gram, "num_examples": 4}) for c in (0, 1)])
    new, metrics = topo.finish(FedAvg(), state, acc, 3)
    station_gram_bytes = len("gram/fc") + 3 * 3 * 8  # a station's Gram: float64 [3, 3] (eqs. 9–10)
    assert metrics["hfl/bytes_station_up"] == 2 * (message_nbytes(w[0]) + station_gram_bytes)
    assert new["round"] == 3


def test_interleaved_stations_give_one_sorted_sample_of_client_ids() -> None:
    # round robin: station 0 holds clients 0 and 2, station 1 clients 1 and 3; the round's clients are sorted ids
    # (the flat topology's order), not station by station
    assert topology([0, 1, 0, 1]).sample(1, 1.0, seed=0) == [0, 1, 2, 3]


def test_a_last_station_round_without_any_reply_merges_nothing_and_keeps_the_global_model() -> None:
    topo = topology([0, 1], merge="avg")
    state = {"weights": weights(np.ones(2)), "round": 0, "stations": [{"weights": weights(np.full(2, e + 2.0))}
                                                                     for e in range(2)]}
    new, metrics = topo.finish(FedAvg(), state, station_round(topo, {0: 1, 1: 1}, []), 1)
    assert np.array_equal(new["weights"]["w/p"], np.ones(2))  # no station replied: nothing to merge
    assert [s["weights"]["w/p"].tolist() for s in new["stations"]] == [[2.0, 2.0], [3.0, 3.0]]
    assert metrics["hfl/active_stations"] == 0 and "hfl/time_merge_s" not in metrics


def test_summary_sums_a_server_rounds_local_training_time_over_its_station_rounds() -> None:
    topo = topology([0, 1], station_rounds=2)
    rows = [{"round": t, "time_train_s": float(t)} for t in range(1, 5)]
    assert station_summary(topo, rows)["per_server_round"]["time_local_training_s"] == ((1 + 2) + (3 + 4)) / 2


def test_a_merge_that_does_not_align_sends_no_permutations_even_when_given_a_spec() -> None:
    model = nn.Sequential(nn.Conv2d(1, 3, 1), nn.Flatten(), nn.Linear(3, 2))
    topo = topology([0, 1, 2], merge="avg", spec=sequential_spec(model))
    assert topo.spec is None
    w = weights_of(model)
    state = {"weights": w, "round": 0, "stations": [{"weights": w} for _ in range(3)]}
    _, metrics = topo.finish(FedAvg(), state, station_round(topo, {0: 1, 1: 1}, [Reply(c, {**w, "num_examples": 1})
                                                                                 for c in (0, 1)]), 1)
    assert metrics["hfl/bytes_station_down"] == 3 * message_nbytes(w)  # the model only, no index arrays
