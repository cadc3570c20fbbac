"""Hierarchical federation (clients → stations → server) and HFedATM's station → server merge.

Hierarchy is a topology, not a method: :class:`Hierarchical` wraps any client method (``inner``)
and turns the engine's flat rounds into HFedATM's Algorithm 1. One engine round is one *station
round*; engine round ``t`` is server round ``r = (t−1)//N + 1``, station round ``n = (t−1)%N + 1``.

* every station keeps its own copy of ``inner``'s server state; a client talks to its station's
  (``client_config`` is per client) and its replies are aggregated there by ``inner.aggregate``
  (FedAvg, FedProx, FedSR, FedIIR's own rule...) — Algorithm 1, step 2;
* in station round ``n == N`` the clients also send the Gram matrices of every linear layer's
  inputs (eq. 8, optionally clipped and noised for DP); the station averages (eq. 9) and shrinks
  them (eq. 10);
* after station round ``N`` the server merges the stations (``merge``): ``avg`` (HFedAvg: mean with
  γ_e = active clients), ``hfedatm`` (FOT alignment, eqs. 2–6, then the γ-weighted mean of eq. 7 for
  conv filters and everything else, and RegMean, eqs. 11–12, for linear weights), or the paper's
  ablations ``hfedatm-no-fot`` and ``hfedatm-no-regmean``; every station then restarts from the
  merged global model.

Everything here runs inside the engine's server and client halves, so both engines run it unchanged.
"""

from __future__ import annotations

import copy
import json
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from feddg.aggregation.dp import basic_composition, clip_rows, gaussian_sigma, gram_sensitivity, privatize_gram
from feddg.aggregation.fot import align_to_reference
from feddg.aggregation.mean import weighted_mean
from feddg.aggregation.regmean import psd_project, regmean, shrink, station_gram
from feddg.algorithms.base import ClientContext, ClientState, Method, Params, Reply, ServerContext, ServerState
from feddg.algorithms.stations import Topology, assign_stations
from feddg.messages import WEIGHT_PREFIX, Message, message_nbytes, weights_of
from feddg.models.permutation import PermutationSpec, permutation_spec, permute_grams

if TYPE_CHECKING:
    from feddg.config import HierarchyConfig

MERGES = ("avg", "hfedatm", "hfedatm-no-fot", "hfedatm-no-regmean")
GRAM_FLAG = "collect_gram"  # server -> client: also send Grams this round
GRAM_PREFIX = "gram/"  # client -> station: "gram/<nn.Linear module name>" = X^T X of its inputs


class MergeParams(Params):
    """``hierarchy.params``: the merge's hyper-parameters (defaults: HFedATM supplement Table 1)."""

    lambda_ot: float = Field(0.05, gt=0, description="λ_OT, Sinkhorn entropic regulariser (eq. 4)")
    sinkhorn_iters: int = Field(25, ge=1, description="n_iter, Sinkhorn iterations")
    solver: Literal["sinkhorn", "hungarian"] = Field("sinkhorn", description="OT solver; hungarian = exact assignment")
    alpha: float = Field(0.75, ge=0, le=1, description="RegMean shrinkage α (eq. 10)")
    gram_pass: Literal["last_epoch", "after"] = Field(
        "last_epoch", description="Grams from the last local epoch's training passes, or an extra no-grad pass after it"
    )
    client_pull: Literal["station", "global"] = Field(
        "station", description="clients start each station round from their station's model, or from the global one"
    )
    dp_epsilon: float | None = Field(None, gt=0, description="ε of the Gaussian mechanism on each Gram; null = no DP")
    dp_delta: float = Field(1e-5, gt=0, lt=1)
    dp_clip: float = Field(1.0, gt=0, description="per-sample L2 clip C of a linear layer's input (sensitivity C²)")
    dp_mechanism: Literal["analytic", "classic"] = "analytic"


# ------------------------------------------------------------------------------- client Grams


class GramRecorder:
    """Eq. 8 on the client: ``G = X^T X`` of the input of every ``nn.Linear``, summed over one pass
    over the client's data (the last pass that ran in training mode), each batch counted once.

    Forward pre-hooks see each layer's input; a pass starts with every ``ctx.batches()`` call of a
    context from :meth:`track`. With ``clip``, each input row is clipped to that L2 norm (DP).
    """

    def __init__(self, model: nn.Module, clip: float | None = None) -> None:
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.clip = clip
        self.current: dict[str, Tensor] = {}
        self.last: dict[str, Tensor] = {}
        self.seen: set[str] = set()
        self.eval_mode = False
        self.handles: list[Any] = []

    def __enter__(self) -> GramRecorder:
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in self.layers.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, name: str):  # noqa: ANN202
        def record(module: nn.Linear, args: tuple[Tensor, ...]) -> None:
            if name in self.seen or not (module.training or self.eval_mode):
                return
            self.seen.add(name)  # a second forward of the same batch is not counted again
            x = args[0].detach().reshape(-1, module.in_features).double()
            if self.clip is not None:
                x = clip_rows(x, self.clip)
            g = x.T @ x
            self.current[name] = self.current[name] + g if name in self.current else g

        return record

    def new_pass(self) -> None:
        if self.current:
            self.last, self.current = self.current, {}

    def new_batch(self) -> None:
        self.seen = set()

    def track(self, ctx: ClientContext) -> ClientContext:
        """``ctx`` whose ``batches()`` marks passes and batches for this recorder."""
        return _TrackedContext(**{f.name: getattr(ctx, f.name) for f in fields(ctx)}, recorder=self)

    def extra_pass(self, model: nn.Module, ctx: ClientContext) -> None:
        """Grams from one no-grad pass in eval mode after training (``gram_pass: after``)."""
        model.eval()
        self.eval_mode = True
        with self, torch.no_grad():
            for x, _ in self.track(ctx).batches(shuffle=False, train=False):
                model(x)
        self.eval_mode = False

    def grams(self) -> dict[str, Tensor]:
        self.new_pass()
        return self.last


@dataclass
class _TrackedContext(ClientContext):
    recorder: GramRecorder | None = None

    def batches(self, *, shuffle: bool = True, train: bool = True) -> Iterator[tuple[Tensor, Tensor]]:
        assert self.recorder is not None
        self.recorder.new_pass()
        for batch in super().batches(shuffle=shuffle, train=train):
            self.recorder.new_batch()
            yield batch


# ------------------------------------------------------------------------------- the merge


def merge_stations(
    weights: Sequence[Message],
    grams: Sequence[dict[str, np.ndarray]] | None,
    gammas: Sequence[float],
    spec: PermutationSpec | None,
    params: MergeParams,
) -> tuple[Message, dict[str, float]]:
    """Merge station models (``w/`` messages) into the global model; returns it and diagnostics.

    ``spec`` given: FOT-align stations 2.. to station 1 (and permute their Grams). ``grams`` given:
    RegMean (eq. 12) for every linear weight with a Gram at every station. Everything else: the
    γ-weighted mean (eq. 7).
    """
    states = [
        {k[len(WEIGHT_PREFIX) :]: torch.from_numpy(np.asarray(v)) for k, v in w.items() if k.startswith(WEIGHT_PREFIX)}
        for w in weights
    ]
    metrics: dict[str, float] = {}
    if spec is not None and len(states) > 1:
        t0 = time.perf_counter()
        al = align_to_reference(states[0], states[1:], spec, params.solver, params.lambda_ot, params.sinkhorn_iters)
        states = [states[0], *al.states]
        if grams is not None:
            grams = [grams[0]] + [
                {k: v.numpy() for k, v in permute_grams({k: torch.from_numpy(v) for k, v in g.items()}, spec, p).items()}
                for g, p in zip(grams[1:], al.perms, strict=True)
            ]
        metrics["hfl/time_fot_s"] = time.perf_counter() - t0
        metrics["fot/passes"] = al.passes
        metrics["fot/moved"] = float(np.mean(list(al.moved.values())))
        for g in spec.groups:
            metrics[f"fot/{g.name}/moved"] = al.moved[g.name]
            metrics[f"fot/{g.name}/cost_before"] = al.cost_before[g.name]
            metrics[f"fot/{g.name}/cost_after"] = al.cost_after[g.name]
    layers = set.intersection(*(set(g) for g in grams)) if grams else set()
    merged: dict[str, np.ndarray] = {}
    regmean_s, fallbacks = 0.0, 0
    for key in states[0]:
        layer = key.removesuffix(".weight")
        arrays = [s[key].numpy() for s in states]
        if key.endswith(".weight") and layer in layers:
            assert grams is not None
            t0 = time.perf_counter()
            res = regmean(arrays, [g[layer] for g in grams], gammas, layer)
            regmean_s += time.perf_counter() - t0
            merged[key] = res.weight
            metrics[f"regmean/{layer}/cond"] = res.cond
            metrics[f"regmean/{layer}/fallback"] = float(res.fallback)
            metrics[f"regmean/{layer}/dead_inputs"] = float(res.dead_inputs)
            fallbacks += res.fallback
        else:
            merged[key] = weighted_mean(arrays, gammas)
    if layers:
        metrics["hfl/time_regmean_s"] = regmean_s
        metrics["regmean/fallbacks"] = float(fallbacks)
    return {WEIGHT_PREFIX + k: v for k, v in merged.items()}, metrics


# ------------------------------------------------------------------------------- the wrapper


class Hierarchical(Method):
    """Runs ``inner`` inside stations and merges stations every ``N`` station rounds (module docstring)."""

    name = "hierarchical"
    Params = MergeParams

    def __init__(self, inner: Method, topology: Topology, merge: str = "avg", params: MergeParams | None = None) -> None:
        super().__init__(params)
        if merge not in MERGES:
            raise ValueError(f"unknown merge {merge!r}; expected one of {MERGES}")
        self.inner, self.topology, self.merge = inner, topology, merge
        self.personalized = inner.personalized  # type: ignore[misc]
        self.use_fot = merge in ("hfedatm", "hfedatm-no-regmean")
        self.use_regmean = merge in ("hfedatm", "hfedatm-no-fot")
        self.spec: PermutationSpec | None = None
        p = self.merge_params
        self.dp_sigma: float | None = None
        if p.dp_epsilon is not None and self.use_regmean:
            self.dp_sigma = gaussian_sigma(p.dp_epsilon, p.dp_delta, gram_sensitivity(p.dp_clip), p.dp_mechanism)

    @property
    def merge_params(self) -> MergeParams:
        assert isinstance(self.params, MergeParams)
        return self.params

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = self.inner.prepare_model(model)
        if self.use_fot:
            self.spec = permutation_spec(model)
        return model

    # --- server half -------------------------------------------------------------------
    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        station = self.inner.server_init(model, ctx)
        stations = [copy.deepcopy(station) for _ in range(self.topology.num_stations)]
        return {"weights": weights_of(model), "stations": stations, "round": 0, "metrics": {}}

    def sample_clients(self, round: int, client_fraction: float, seed: int) -> list[int]:
        """The engine's client sampling under a hierarchy (see :meth:`Topology.sample`)."""
        return self.topology.sample(round, client_fraction, seed)

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        station = state["stations"][self.topology.station_of[client_id]]
        if self.merge_params.client_pull == "global":
            station = {**station, "weights": state["weights"]}
        msg = self.inner.client_config(station, client_id, round)
        if self.use_regmean and self.topology.station_round(round) == self.topology.station_rounds:
            msg = {**msg, GRAM_FLAG: 1}
        return msg

    def aggregate(self, state: ServerState, replies: list[Reply]) -> ServerState:
        t = state["round"] + 1
        topo = self.topology
        t0 = time.perf_counter()
        by_station: dict[int, list[Reply]] = defaultdict(list)
        for r in replies:
            by_station[int(topo.station_of[r.client_id])].append(r)
        stations = list(state["stations"])
        for e, reps in sorted(by_station.items()):
            stations[e] = self.inner.aggregate(stations[e], [Reply(r.client_id, _without_grams(r.message)) for r in reps])
        metrics: dict[str, float] = {
            "hfl/server_round": topo.server_round(t),
            "hfl/station_round": topo.station_round(t),
            "hfl/active_stations": len(by_station),
            "hfl/time_station_agg_s": time.perf_counter() - t0,
            "hfl/bytes_client_gram_up": sum(_gram_nbytes(r.message) for r in replies),
        }
        inner_metrics = [self.inner.round_metrics(stations[e]) for e in by_station]
        for key in sorted(set().union(*inner_metrics)):  # the client method's own metrics, mean over stations
            metrics[key] = float(np.mean([m[key] for m in inner_metrics if key in m]))
        new = {**state, "round": t, "stations": stations}
        if topo.station_round(t) == topo.station_rounds and by_station:
            new = self._merge(new, dict(sorted(by_station.items())), metrics)
        new["metrics"] = metrics
        return new

    def _merge(self, state: ServerState, by_station: dict[int, list[Reply]], metrics: dict[str, float]) -> ServerState:
        t0 = time.perf_counter()
        active = list(by_station)
        weights = [state["stations"][e]["weights"] for e in active]
        grams = [self._station_grams(by_station[e]) for e in active] if self.use_regmean else None
        gammas = [len(by_station[e]) for e in active]  # γ_e = active clients (eq. 7)
        merged, merge_metrics = merge_stations(weights, grams, gammas, self.spec if self.use_fot else None, self.merge_params)
        metrics.update(merge_metrics)
        metrics["hfl/time_merge_s"] = time.perf_counter() - t0
        metrics["hfl/bytes_station_up"] = sum(message_nbytes(w) for w in weights) + sum(
            message_nbytes({GRAM_PREFIX + k: v for k, v in g.items()}) for g in grams or []
        )
        perm_bytes = sum(8 * g.size for g in self.spec.groups) * (len(active) - 1) if self.use_fot and self.spec else 0
        metrics["hfl/bytes_station_down"] = self.topology.num_stations * message_nbytes(merged) + perm_bytes
        stations = [{**s, "weights": merged} for s in state["stations"]]
        return {**state, "weights": merged, "stations": stations}

    def _station_grams(self, replies: list[Reply]) -> dict[str, np.ndarray]:
        """Eq. 9 (mean over the station's active clients), PSD projection under DP, then eq. 10."""
        keys = set.intersection(*({k for k in r.message if k.startswith(GRAM_PREFIX)} for r in replies))
        out = {}
        for key in sorted(keys):
            g = station_gram([np.asarray(r.message[key]) for r in replies])
            if self.dp_sigma is not None:
                g = psd_project(g)
            out[key[len(GRAM_PREFIX) :]] = shrink(g, self.merge_params.alpha)
        return out

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        return dict(state["metrics"])

    def eval_weights(self, state: ServerState, client_id: int | None = None) -> Message:
        if client_id is None:
            return state["weights"]
        return self.inner.eval_weights(state["stations"][self.topology.station_of[client_id]], client_id)

    # --- client half -------------------------------------------------------------------
    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        if not msg.get(GRAM_FLAG):
            return self.inner.client_update(model, msg, client_state, ctx)
        msg = {k: v for k, v in msg.items() if k != GRAM_FLAG}
        recorder = GramRecorder(model, self.merge_params.dp_clip if self.dp_sigma is not None else None)
        if self.merge_params.gram_pass == "last_epoch":
            with recorder:
                reply, client_state = self.inner.client_update(model, msg, client_state, recorder.track(ctx))
        else:
            reply, client_state = self.inner.client_update(model, msg, client_state, ctx)
            recorder.extra_pass(model, ctx)
        grams = recorder.grams()
        if self.dp_sigma is not None:
            grams = {k: privatize_gram(g, self.dp_sigma, ctx.generator) for k, g in grams.items()}
        return {**reply, **{GRAM_PREFIX + k: g.float().numpy() for k, g in grams.items()}}, client_state

    def predict(self, model: nn.Module, x: Tensor) -> Tensor:
        return self.inner.predict(model, x)

    # --- one-time setup: the same global exchange, applied to every station -------------
    def setup_request(self, state: ServerState) -> Message | None:
        return self.inner.setup_request(state["stations"][0])

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        return self.inner.client_setup(model, msg, client_state, ctx)

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        return {**state, "stations": [self.inner.server_setup(s, replies) for s in state["stations"]]}

    # --- results.json ------------------------------------------------------------------
    def summary(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """What the run was and what it cost per *server* round (Table 3 of the paper), plus DP."""
        n = self.topology.station_rounds
        per: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for row in rows:
            acc = per[self.topology.server_round(row["round"])]
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
        p = self.merge_params
        out: dict[str, Any] = {
            "client_method": self.inner.name,
            "merge": self.merge,
            "stations": self.topology.num_stations,
            "station_rounds": n,
            "server_rounds": len(done),
            "per_server_round": {k: float(np.mean([acc[k] for acc in done])) for k in keys} if done else {},
            "fot_moved_mean": _mean_of(rows, "fot/moved"),
            "regmean_fallbacks": int(sum(row.get("regmean/fallbacks", 0) for row in rows)),
            "dp_epsilon": p.dp_epsilon if self.dp_sigma is not None else None,
        }
        if self.dp_sigma is not None:
            assert p.dp_epsilon is not None
            eps_total, delta_total = basic_composition(p.dp_epsilon, p.dp_delta, len(done) * gram_layers)
            out.update(
                dp_delta=p.dp_delta, dp_clip=p.dp_clip, dp_mechanism=p.dp_mechanism, dp_sigma=self.dp_sigma,
                dp_gram_releases=len(done) * gram_layers, dp_epsilon_total_basic=eps_total,
                dp_delta_total_basic=delta_total,
            )
        return out


def _without_grams(msg: Message) -> Message:
    return {k: v for k, v in msg.items() if not k.startswith(GRAM_PREFIX)}


def _gram_nbytes(msg: Message) -> int:
    return message_nbytes({k: v for k, v in msg.items() if k.startswith(GRAM_PREFIX)})


def _mean_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if key in r]
    return float(np.mean(vals)) if vals else None


def build_hierarchy(inner: Method, cfg: HierarchyConfig, client_domains: Sequence[Sequence[int]]) -> Hierarchical:
    """Wrap ``inner`` in the hierarchy of ``cfg`` (the ``hierarchy:`` config section)."""
    topology = Topology(assign_stations(cfg.assignment, cfg.stations, client_domains), cfg.station_rounds, cfg.station_fraction)
    return Hierarchical(inner, topology, cfg.merge, MergeParams(**cfg.params))


def sweep_results(out_dir: str | Path) -> list[dict[str, Any]]:
    """The results.json of every run of a finished ``feddg sweep`` (listed in its runs.jsonl)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "runs.jsonl").read_text().splitlines() if line]
    return [json.loads((Path(r["run_dir"]) / "results.json").read_text()) for r in rows]


def overhead_table(results: Sequence[dict[str, Any]]) -> str:
    """Paper Table 3 from runs' results.json: mean time per server round with Avg vs HFedATM and the
    increase, per client method (runs with other merges are ignored). For a sweep:
    ``overhead_table(sweep_results("runs/hfedatm-digits-table"))``."""
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    for res in results:
        h = res.get("hierarchy")
        if h and h["merge"] in ("avg", "hfedatm") and "time_s" in h["per_server_round"]:
            times[(h["client_method"], h["merge"])].append(h["per_server_round"]["time_s"])
    lines = ["| client method | Avg (s/round) | HFedATM (s/round) | increase (%) |", "|---|---|---|---|"]
    for method in dict.fromkeys(m for m, _ in times):
        avg, atm = np.mean(times.get((method, "avg"), [np.nan])), np.mean(times.get((method, "hfedatm"), [np.nan]))
        lines.append(f"| {method} | {avg:.3f} | {atm:.3f} | {100 * (atm - avg) / avg:.1f} |")
    return "\n".join(lines)
