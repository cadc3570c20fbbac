"""Topologies: which clients train in a round, where their replies are folded, when a server round
ends and when to evaluate.

The :class:`~feddg.federation.server.Server` owns one topology and asks it everything that depends
on the shape of the federation, so it has no branches on it:

* :class:`Topology` (flat) — clients → server: the method's own state and fold, one round a server round.
* :class:`StationTopology` — clients → stations → server (HFedATM, Algorithm 1): every station keeps its
  own copy of the client method's server state; a client talks to its station, and its replies are
  folded there by the method's own ``accumulate``/``finish`` (FedAvg, FedProx, FedSR, FedIIR's rule,
  ...). One engine round is one *station round*; engine round ``t`` is server round
  ``r = (t−1)//N + 1``, station round ``n = (t−1)%N + 1``. After station round ``N`` the server merges
  the active stations with a registered station merge (``feddg.aggregation.merges``: ``avg``,
  ``hfedatm``, ...) and every station restarts from the merged global model.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from torch import Tensor, nn

from feddg.aggregation.merges import GRAM_FLAG, GRAM_PREFIX, HFedATMParams, StationMerge, StationParams, station_merge
from feddg.algorithms.base import ClientContext, ClientState, Method, Metrics, Reply, ServerContext, ServerState
from feddg.federation.rounds import sample_members
from feddg.messages import Layout, Message, Shapes, array_slot, entries, message_nbytes, subset, weights_of, without
from feddg.models.permutation import PermutationSpec, permutation_spec
from feddg.seeds import derived_seed

ASSIGNMENTS = ("contiguous", "domain", "round_robin")


class Topology:
    """The flat topology (clients → server): the method's state and fold pass through unchanged.
    Subclasses add structure behind the same interface."""

    #: engine rounds per server round (``N`` station rounds; 1 when flat)
    station_rounds: int = 1

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    # --- the round clock -----------------------------------------------------------------
    def engine_rounds(self, server_rounds: int) -> int:
        return server_rounds * self.station_rounds

    def server_round_ends(self, round: int) -> bool:
        return round % self.station_rounds == 0

    def eval_due(self, round: int, every: int, total: int) -> bool:
        """Every ``every`` server rounds (at a server round's end) and after the last engine round."""
        return round == total or (self.server_round_ends(round) and (round // self.station_rounds) % every == 0)

    def sample(self, round: int, fraction: float, seed: int) -> list[int]:
        """:func:`~feddg.federation.rounds.sample_size` distinct clients (``fraction·K`` rounded half up, at least 1),
        sorted; all when ``fraction == 1``."""
        rng = np.random.default_rng(derived_seed(seed, round, 1_000_003))
        return sample_members(np.arange(self.num_clients), fraction, rng)

    def station_of(self, client_id: int) -> int:
        return 0

    # --- the method's state ----------------------------------------------------------------
    def init(self, method: Method, model: nn.Module, ctx: ServerContext) -> ServerState:
        return method.server_init(model, ctx)

    def client_config(self, method: Method, state: ServerState, client_id: int, round: int) -> Message:
        return method.client_config(state, client_id, round)

    def start(self, method: Method, expected: dict[int, int]) -> Any:
        """A round's accumulator; ``expected`` maps each sampled client to its ``num_examples``."""
        return method.start(sum(expected.values()))

    def accumulate(self, method: Method, acc: Any, reply: Reply) -> Any:
        return method.accumulate(acc, reply)

    def reply_layout(self, method: Method, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """What a reply to ``sent`` carries beside its ``w/`` arrays (:meth:`Method.reply_layout`)."""
        return method.reply_layout(model, sent, weights)

    def finish(self, method: Method, state: ServerState, acc: Any, round: int) -> tuple[ServerState, Metrics]:
        return method.finish(state, acc)

    def eval_weights(self, method: Method, state: ServerState, client_id: int | None) -> Message:
        return method.eval_weights(state, client_id)

    def setup_request(self, method: Method, state: ServerState) -> Message | None:
        return method.setup_request(state)

    def server_setup(self, method: Method, state: ServerState, replies: list[Reply]) -> ServerState:
        return method.server_setup(state, replies)

    # --- the client half -------------------------------------------------------------------
    def client_update(
        self, method: Method, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        return method.client_update(model, msg, client_state, ctx)

    # --- results.json -------------------------------------------------------------------
    def results(self, method: Method, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Entries the topology adds to results.json."""
        return {}


@dataclass
class StationFold:
    """One station round's accumulators: the client method's per station (in order of first reply),
    the clients that replied per station, and their Grams when the merge uses them."""

    expected: dict[int, int]  # station -> Σ num_examples of its sampled clients
    stations: dict[int, Any] = field(default_factory=dict)
    clients: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    grams: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=lambda: defaultdict(list))
    gram_bytes: int = 0
    seconds: float = 0.0


class StationTopology(Topology):
    """Clients → stations → server (module docstring)."""

    def __init__(
        self,
        station_of: np.ndarray,
        station_rounds: int,
        station_fraction: float,
        merge: str,
        params: StationParams,
        spec: PermutationSpec | None,
    ) -> None:
        super().__init__(len(station_of))
        self.stations_of = np.asarray(station_of)
        self.station_rounds = station_rounds
        self.station_fraction = station_fraction
        self.merge_name = merge
        self.merge: StationMerge = station_merge(merge)
        self.params = params
        #: HFedATM's merge parameters, for the merges that collect Grams or align (``hierarchy.params``)
        self.hfedatm = params if isinstance(params, HFedATMParams) else None
        self.spec = spec if self.merge.uses_alignment else None
        self.dp_sigma = self.hfedatm.dp_sigma() if self.merge.uses_grams and self.hfedatm else None

    @property
    def num_stations(self) -> int:
        return int(self.stations_of.max()) + 1

    def station_of(self, client_id: int) -> int:
        return int(self.stations_of[client_id])

    def server_round(self, round: int) -> int:
        return (round - 1) // self.station_rounds + 1

    def station_round(self, round: int) -> int:
        return (round - 1) % self.station_rounds + 1

    def sample(self, round: int, fraction: float, seed: int) -> list[int]:
        """Stations sampled once per server round (``station_fraction``), then ``fraction`` of each active
        station's clients every station round (Algorithm 1, line 5)."""
        stations = np.arange(self.num_stations)
        if self.station_fraction < 1.0:
            rng = np.random.default_rng([seed, self.server_round(round), 4_000_037])
            stations = np.asarray(sample_members(stations, self.station_fraction, rng))
        out: list[int] = []
        for e in stations:
            members = np.flatnonzero(self.stations_of == e)
            out += sample_members(members, fraction, np.random.default_rng([seed, round, int(e), 1_000_003]))
        return sorted(out)

    # --- server half -------------------------------------------------------------------
    def init(self, method: Method, model: nn.Module, ctx: ServerContext) -> ServerState:
        station = method.server_init(model, ctx)
        stations = [method.station_init(copy.deepcopy(station), np.flatnonzero(self.stations_of == e).tolist())
                    for e in range(self.num_stations)]
        return {"weights": weights_of(model), "stations": stations, "round": 0}

    def client_config(self, method: Method, state: ServerState, client_id: int, round: int) -> Message:
        station = state["stations"][self.station_of(client_id)]
        if self.params.client_pull == "global":
            station = {**station, "weights": state["weights"]}
        msg = method.client_config(station, client_id, round)
        if self.merge.uses_grams and self.station_round(round) == self.station_rounds:
            msg = {**msg, GRAM_FLAG: 1}
        return msg

    def start(self, method: Method, expected: dict[int, int]) -> StationFold:
        per_station: dict[int, int] = defaultdict(int)
        for cid, n in expected.items():
            per_station[self.station_of(cid)] += n
        return StationFold(dict(per_station))

    def reply_layout(self, method: Method, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """The method's, and under a Gram request (eq. 8) a ``[d, d]`` float32 Gram per layer of
        ``gram_layers`` (a client sends those its data ran through)."""
        layout = method.reply_layout(model, sent, weights)
        if not sent.get(GRAM_FLAG):
            return layout
        from feddg.algorithms.hfedatm import gram_layers  # HFedATM's layers (the client's recorder)

        return {**layout, **{GRAM_PREFIX + name: array_slot((d, d), np.float32, required=False)
                             for name, m in gram_layers(model).items()
                             for d in [int(cast(Tensor, m.weight).shape[1])]}}  # [out, in] or [out, in, 1, 1]

    def accumulate(self, method: Method, acc: StationFold, reply: Reply) -> StationFold:
        t0 = time.perf_counter()
        e = self.station_of(reply.client_id)
        if e not in acc.stations:  # a station is active from its first reply
            acc.stations[e] = method.start(acc.expected[e])
        if self.merge.uses_grams and any(k.startswith(GRAM_PREFIX) for k in reply.message):
            acc.grams[e].append({k: np.asarray(v) for k, v in subset(reply.message, GRAM_PREFIX).items()})
            acc.gram_bytes += message_nbytes(entries(reply.message, GRAM_PREFIX))
        acc.stations[e] = method.accumulate(acc.stations[e], Reply(reply.client_id, without(reply.message, GRAM_PREFIX)))
        acc.clients[e] += 1
        acc.seconds += time.perf_counter() - t0
        return acc

    def finish(self, method: Method, state: ServerState, acc: StationFold, round: int) -> tuple[ServerState, Metrics]:
        """Algorithm 1: step 2 in every active station; step 3 (the merge) after station round ``N``."""
        t0 = time.perf_counter()
        stations = list(state["stations"])
        station_metrics = []
        for e, station_acc in acc.stations.items():
            stations[e], m = method.finish(stations[e], station_acc)
            station_metrics.append(m)
        metrics: dict[str, float] = {
            "hfl/server_round": self.server_round(round),
            "hfl/station_round": self.station_round(round),
            "hfl/active_stations": len(acc.stations),
            "hfl/time_station_agg_s": acc.seconds + time.perf_counter() - t0,
            "hfl/bytes_client_gram_up": acc.gram_bytes,
        }
        for key in sorted(set().union(*station_metrics)):  # the client method's own metrics, mean over stations
            metrics[key] = float(np.mean([m[key] for m in station_metrics if key in m]))
        new = {**state, "round": round, "stations": stations}
        if self.station_round(round) == self.station_rounds and acc.stations:
            new = self._merge(method, new, sorted(acc.stations), acc, metrics)
        return new, metrics

    def _merge(self, method: Method, state: ServerState, active: list[int], acc: StationFold,
               metrics: dict[str, float]) -> ServerState:
        t0 = time.perf_counter()
        weights = [state["stations"][e]["weights"] for e in active]
        grams = None
        if self.merge.uses_grams:
            from feddg.algorithms.hfedatm import station_grams  # HFedATM's station statistics (eqs. 9–10)

            assert self.hfedatm is not None
            grams = [station_grams(acc.grams[e], self.hfedatm) for e in active]
        gammas = [method.station_weight(state["stations"][e], acc.clients[e]) for e in active]  # γ_e (eq. 7)
        merged, merge_metrics = self.merge.fn(weights, grams, gammas, self.spec, **self.params.model_dump())
        metrics.update(merge_metrics)
        metrics["hfl/time_merge_s"] = time.perf_counter() - t0
        metrics["hfl/bytes_station_up"] = sum(message_nbytes(w) for w in weights) + sum(
            message_nbytes({GRAM_PREFIX + k: v for k, v in g.items()}) for g in grams or []
        )
        perm_bytes = sum(8 * g.size for g in self.spec.groups) * (len(active) - 1) if self.spec else 0
        metrics["hfl/bytes_station_down"] = self.num_stations * message_nbytes(merged) + perm_bytes
        stations = [method.station_merged(s, merged) for s in state["stations"]]
        return {**state, "weights": merged, "stations": stations}

    def eval_weights(self, method: Method, state: ServerState, client_id: int | None) -> Message:
        if client_id is None:
            return state["weights"]
        return method.eval_weights(state["stations"][self.station_of(client_id)], client_id)

    # --- one-time setup: the same global exchange, applied to every station ----------------
    def setup_request(self, method: Method, state: ServerState) -> Message | None:
        return method.setup_request(state["stations"][0])

    def server_setup(self, method: Method, state: ServerState, replies: list[Reply]) -> ServerState:
        return {**state, "stations": [method.server_setup(s, replies) for s in state["stations"]]}

    # --- client half -------------------------------------------------------------------
    def client_update(
        self, method: Method, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        if not self.merge.uses_grams:
            return method.client_update(model, msg, client_state, ctx)
        from feddg.algorithms.hfedatm import update_with_grams  # the client's Grams (eq. 8)

        assert self.hfedatm is not None
        return update_with_grams(method, model, msg, client_state, ctx, self.hfedatm)

    # --- results.json ------------------------------------------------------------------
    def results(self, method: Method, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """What the run was and what it cost per *server* round (Table 3 of the paper), plus DP."""
        return {"hierarchy": {"client_method": method.name, **station_summary(self, rows)}}


def station_summary(topo: StationTopology, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """results.json's ``hierarchy``: topology, mean cost per completed server round, FOT and DP figures (basic
    composition, and ``privacy``: the accountant's ε over every Gram released, per sample, docs/privacy.md)."""
    from feddg.aggregation.accounting import privacy_record
    from feddg.aggregation.dp import basic_composition, gram_sensitivity

    n = topo.station_rounds
    per: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        acc = per[topo.server_round(row["round"])]
        acc["station_rounds"] += 1
        acc["time_s"] += row.get("time_round_s", 0.0) - row.get("time_eval_s", 0.0)
        acc["time_local_training_s"] += row.get("time_train_s", 0.0)
        acc["bytes_client_up"] += row.get("bytes_up", 0)
        acc["bytes_client_down"] += row.get("bytes_down", 0)
        for k in ("time_station_agg_s", "time_fot_s", "time_regmean_s", "time_merge_s", "bytes_client_gram_up",
                  "bytes_station_up", "bytes_station_down"):
            acc[k] += row.get(f"hfl/{k}", 0.0)
    done = [acc for acc in per.values() if acc["station_rounds"] == n]
    keys = sorted({k for acc in done for k in acc} - {"station_rounds"})
    last = rows[-1] if rows else {}
    gram_layers = sum(1 for k in last if k.startswith("regmean/") and k.endswith("/cond"))
    p = topo.hfedatm
    out: dict[str, Any] = {
        "merge": topo.merge_name,
        "stations": topo.num_stations,
        "station_rounds": n,
        "server_rounds": len(done),
        "per_server_round": {k: float(np.mean([acc[k] for acc in done])) for k in keys} if done else {},
        "fot_moved_mean": _mean_of(rows, "fot/moved"),
        "regmean_fallbacks": int(sum(row.get("regmean/fallbacks", 0) for row in rows)),
        "dp_epsilon": p.dp_epsilon if p is not None and topo.dp_sigma is not None else None,
    }
    if topo.dp_sigma is not None:
        assert p is not None and p.dp_epsilon is not None
        eps_total, delta_total = basic_composition(p.dp_epsilon, p.dp_delta, len(done) * gram_layers)
        out.update(
            dp_delta=p.dp_delta, dp_clip=p.dp_clip, dp_mechanism=p.dp_mechanism, dp_sigma=topo.dp_sigma,
            dp_gram_releases=len(done) * gram_layers, dp_epsilon_total_basic=eps_total,
            dp_delta_total_basic=delta_total,
            privacy=privacy_record(sigma=topo.dp_sigma, sensitivity=gram_sensitivity(p.dp_clip), clip=p.dp_clip,
                                   releases=len(done) * gram_layers, delta=p.dp_delta, accountant=p.dp_accountant,
                                   unit="sample"),
        )
    return out


def _mean_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if key in r]
    return float(np.mean(vals)) if vals else None


def assign_stations(kind: str, num_stations: int, client_domains: Sequence[Sequence[int]]) -> np.ndarray:
    """Station of every client.

    ``contiguous``: equal consecutive blocks of client ids — with the ``lambda``/``by_domain`` partitions,
    clients are numbered domain by domain, so stations are domain-coherent, and with
    ``two_level_dirichlet`` group by group; ``domain``: the same after sorting clients by their (first)
    assigned domain; ``round_robin``: client ``k`` to station ``k mod S`` (domain-mixed stations).
    """
    k = len(client_domains)
    if k < num_stations:
        raise ValueError(f"{num_stations} stations need at least as many clients, got {k}")
    blocks = np.arange(k) * num_stations // k
    if kind == "contiguous":
        return blocks
    if kind == "round_robin":
        return np.arange(k) % num_stations
    if kind == "domain":
        order = sorted(range(k), key=lambda c: (min(client_domains[c], default=-1), c))
        out = np.empty(k, dtype=np.int64)
        out[order] = blocks
        return out
    raise ValueError(f"unknown station assignment {kind!r}; expected one of {ASSIGNMENTS}")


def station_topology(
    stations: int, station_rounds: int, station_fraction: float, assignment: str, merge: str,
    params: dict[str, Any], client_domains: Sequence[Sequence[int]], model: nn.Module,
) -> StationTopology:
    """The station topology of a config's ``hierarchy:`` section around ``model`` (already prepared by the
    client method: FOT's permutation spec is built from it when the merge aligns)."""
    spec = permutation_spec(model) if station_merge(merge).uses_alignment else None
    station_of = assign_stations(assignment, stations, client_domains)
    kind = station_merge(merge).params  # the keys this merge uses (config.py validates all of them)
    return StationTopology(station_of, station_rounds, station_fraction, merge,
                           kind(**{k: v for k, v in params.items() if k in kind.model_fields}), spec)
