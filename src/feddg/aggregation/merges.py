"""Station → server merges of a station topology (HFedATM §3, Algorithm 1 step 3), selected by name.

A merge is a pure function of the station models (``w/`` messages), the stations' Gram matrices
(``None`` when the merge does not use them) and the weights γ_e (active clients, eq. 7)::

    merged, metrics = fn(weights, grams, gammas, spec, solver=..., lambda_ot=..., sinkhorn_iters=...)

``uses_grams`` asks the topology to collect client Grams (eq. 8) in the last station round and pass
them; ``uses_alignment`` asks it to pass the model's permutation spec (FOT); otherwise it passes
``None``. ``avg`` is HFedAvg (the γ-weighted mean); ``hfedatm`` is FOT alignment (eqs. 2–6) then
RegMean (eqs. 11–12) for linear weights and the γ-weighted mean for everything else;
``hfedatm-no-fot`` / ``hfedatm-no-regmean`` are Table 4's ablations. A new merge is one function and
one line in :data:`MERGES`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, model_validator

from feddg.aggregation.dp import gaussian_sigma, gram_sensitivity
from feddg.aggregation.fot import Solver, align_to_reference
from feddg.aggregation.mean import weighted_mean
from feddg.aggregation.regmean import regmean
from feddg.aggregation.threads import map_on_threads
from feddg.messages import WEIGHT_PREFIX, Message, subset
from feddg.models.permutation import PermutationSpec, RowGather, permute_grams, row_indices
from feddg.settings import Settings

logger = logging.getLogger(__name__)

Grams = dict[str, np.ndarray]  # nn.Linear module name -> G (its inputs' X^T X)
GRAM_FLAG = "collect_gram"  # server -> client: also send Grams this round
GRAM_PREFIX = "gram/"  # client -> station: "gram/<nn.Linear module name>" = X^T X of its inputs


class StationParams(Settings):
    """``hierarchy.params`` of every station topology (the ``avg`` merge takes only these)."""

    model_config = ConfigDict(frozen=True)  # and Settings's extra="forbid"

    client_pull: Literal["station", "global"] = Field(
        "station", description="clients start each station round from their station's model, or from the global one"
    )


class HFedATMParams(StationParams):
    """``hierarchy.params``: the station topology's and its merge's hyper-parameters (defaults: HFedATM
    supplement Table 1)."""

    lambda_ot: float = Field(0.05, gt=0, description="λ_OT, Sinkhorn entropic regulariser (eq. 4)")
    sinkhorn_iters: int = Field(25, ge=1, description="n_iter, Sinkhorn iterations")
    solver: Literal["sinkhorn", "hungarian"] = Field("sinkhorn", description="OT solver; hungarian = exact assignment")
    alpha: float = Field(0.75, ge=0, le=1, description="RegMean shrinkage α (eq. 10)")
    gram_pass: Literal["last_epoch", "after"] = Field(
        "last_epoch", description="Grams from the last local epoch's training passes, or an extra no-grad pass after it"
    )
    dp_epsilon: float | None = Field(None, gt=0, description="ε of the Gaussian mechanism on each Gram; null = no DP")
    dp_delta: float = Field(1e-5, gt=0, lt=1)
    dp_clip: float = Field(1.0, gt=0, description="clip C of each sample's input rows of a linear layer together "
                           "(Frobenius norm; sensitivity C²)")
    dp_mechanism: Literal["analytic", "classic"] = "analytic"
    dp_accountant: Literal["rdp", "pld"] = Field("rdp", description="composes the run's Gram releases into one ε")

    @model_validator(mode="after")
    def _dp_needs_a_fixed_feature_map(self) -> HFedATMParams:
        """A Gram is private as a function of the data with the feature map fixed: the weights the client sends. The
        last epoch's passes run through every intermediate weight of training, which is never sent."""
        if self.dp_epsilon is not None and self.gram_pass == "last_epoch":
            raise ValueError("dp_epsilon needs gram_pass: after (the Grams of the sent weights); last_epoch records "
                             "them through the intermediate weights of training, which the DP guarantee does not fix")
        return self

    @model_validator(mode="after")
    def _classic_gives_the_guarantee(self) -> HFedATMParams:
        """The classic σ = √(2 ln(1.25/δ))·Δ/ε is proven for ε < 1 (Dwork & Roth, Thm A.1); above, it gives (ε, δ)-DP
        only while it is at least the analytic Gaussian's exact least σ (up to ε ≈ 8 at δ = 1e-5)."""
        if self.dp_epsilon is None or self.dp_mechanism == "analytic":
            return self
        classic, least = (gaussian_sigma(self.dp_epsilon, self.dp_delta, 1.0, m) for m in ("classic", "analytic"))
        if classic < least:
            raise ValueError(f"dp_mechanism: classic's noise at ε={self.dp_epsilon:g}, δ={self.dp_delta:g} is "
                             f"{classic:.4g}·Δ, below the {least:.4g}·Δ that (ε, δ)-DP needs: use analytic")
        return self

    def dp_sigma(self) -> float | None:
        """σ of the Gaussian noise on every Gram entry, or ``None`` without DP."""
        if self.dp_epsilon is None:
            return None
        return gaussian_sigma(self.dp_epsilon, self.dp_delta, gram_sensitivity(self.dp_clip), self.dp_mechanism)


MergeFn = Callable[..., tuple[Message, dict[str, float]]]


def merge_stations(
    weights: Sequence[Message],
    grams: Sequence[Grams] | None,
    gammas: Sequence[float],
    spec: PermutationSpec | None,
    *,
    solver: Solver = "sinkhorn",
    lambda_ot: float = 0.05,
    sinkhorn_iters: int = 25,
    device: str = "cpu",
    **_: Any,
) -> tuple[Message, dict[str, float]]:
    """Merge station models into the global model; returns it and diagnostics.

    ``spec`` given: FOT-align stations 2.. to station 1 (and permute their Grams). ``grams`` given:
    RegMean (eq. 12) for every linear weight with a Gram at every station (a layer some station lacks is averaged,
    with a warning and ``regmean/layers_without_grams``). Everything else: the
    γ-weighted mean (eq. 7). ``device``: where FOT's cost GEMMs run (the assignments and means stay on the CPU).
    """
    host = [{k: np.asarray(v) for k, v in subset(w, WEIGHT_PREFIX).items()} for w in weights]
    metrics: dict[str, float] = {}
    rows: list[dict[str, RowGather]] = [{} for _ in host]  # per station: key -> its tensor's permutation
    if spec is not None and len(host) > 1:
        t0 = time.perf_counter()
        states = [{k: torch.from_numpy(v).to(device) for k, v in h.items()} for h in host]  # FOT's GEMMs only
        al = align_to_reference(states[0], states[1:], spec, solver, lambda_ot, sinkhorn_iters)
        # eq. 5 is applied inside the mean (and RegMean's gathers): the permuted states are never written
        rows = [{}] + [row_indices({k: v.shape for k, v in h.items()}, spec, p)
                       for h, p in zip(host[1:], al.perms, strict=True)]
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
    if grams and (partial := set().union(*(set(g) for g in grams)) - layers):
        # a station whose clients sent no Gram of a layer (a reply may omit them): that layer is averaged (eq. 7)
        logger.warning("RegMean: %d layer(s) lack a Gram at some station (%s); they take the weighted mean",
                       len(partial), ", ".join(sorted(partial)))
        metrics["regmean/layers_without_grams"] = float(len(partial))
    regmean_s, fallbacks = 0.0, 0
    arrays_of = {key: [h[key] for h in host] for key in host[0]}  # the messages' arrays: nothing copied back
    solved = [k for k in host[0] if k.endswith(".weight") and k.removesuffix(".weight") in layers]  # RegMean's
    merged = _means([k for k in host[0] if k not in solved], arrays_of, gammas, rows)
    for key in solved:
        assert grams is not None
        layer, arrays, index = key.removesuffix(".weight"), arrays_of[key], [r.get(key) for r in rows]
        t0 = time.perf_counter()
        shape = arrays[0].shape  # a 1×1 conv's [out, in, 1, 1] is solved as the linear layer [out, in]
        if any(d != 1 for d in shape[2:]):
            raise ValueError(f"RegMean: {key} of shape {list(shape)} is not a linear layer's weight")
        arrays = [a if i is None else i.apply(a) for a, i in zip(arrays, index, strict=True)]
        res = regmean([a.reshape(shape[0], -1) for a in arrays], [g[layer] for g in grams], gammas, layer)
        regmean_s += time.perf_counter() - t0
        merged[key] = res.weight.reshape(shape)
        metrics[f"regmean/{layer}/cond"] = res.cond
        metrics[f"regmean/{layer}/fallback"] = float(res.fallback)
        metrics[f"regmean/{layer}/dead_inputs"] = float(res.dead_inputs)
        fallbacks += res.fallback
    if layers:
        metrics["hfl/time_regmean_s"] = regmean_s
        metrics["regmean/fallbacks"] = float(fallbacks)
    return {WEIGHT_PREFIX + k: merged[k] for k in host[0]}, metrics


def _means(
    keys: Sequence[str], arrays: dict[str, list[np.ndarray]], gammas: Sequence[float], rows: list[dict[str, RowGather]]
) -> dict[str, np.ndarray]:
    """Eq. 7 for each key (each station's rows gathered by its permutation), on as many threads as torch's: the keys
    are independent and numpy's gathers and float64 arithmetic release the GIL; the largest tensors first, so the
    threads finish together. Each key's result is the serial one's, bit for bit."""
    def mean(key: str) -> np.ndarray:
        return weighted_mean(arrays[key], gammas, [r.get(key) for r in rows])

    ordered = sorted(keys, key=lambda k: -arrays[k][0].size)
    return dict(zip(ordered, map_on_threads(mean, ordered, "feddg-mean"), strict=True))


@dataclass(frozen=True)
class StationMerge:
    """A registered merge: the function, what it needs the topology to collect, and its ``hierarchy.params``."""

    fn: MergeFn
    uses_grams: bool = False
    uses_alignment: bool = False
    params: type[StationParams] = StationParams


#: the topology passes Grams only to merges that use them and the spec only to merges that align
MERGES: dict[str, StationMerge] = {
    "avg": StationMerge(merge_stations),
    "hfedatm": StationMerge(merge_stations, uses_grams=True, uses_alignment=True, params=HFedATMParams),
    "hfedatm-no-fot": StationMerge(merge_stations, uses_grams=True, params=HFedATMParams),
    "hfedatm-no-regmean": StationMerge(merge_stations, uses_alignment=True, params=HFedATMParams),
}


def station_merge(name: str) -> StationMerge:
    if name not in MERGES:
        raise ValueError(f"unknown station merge {name!r}; available: {sorted(MERGES)}")
    return MERGES[name]
