"""FedRC (Kou, Lin, Tang, Wang, Zhu, Wu, "FedRC: A Rapid-Converged Hierarchical Federated Learning Framework in
Street Scene Semantic Understanding", IROS 2024; also "FedGau", arXiv 2409.19560): a hierarchical baseline of
HFedATM's Fig. 2, on the station topology only.

Every image and every dataset is modelled as a Gaussian, and aggregation weights come from Bhattacharyya
distances instead of data volume alone. The paper's equations are not available offline and the authors'
code (WeibinKOU/FedGau) hard-codes the resulting weights, so the formulas below are this project's
reconstruction from the paper's description (docs/methods/fedrc.md):

    image m of client i:     N_m = N(μ_m, diag σ²_m), per-channel mean and variance of its pixels
    client i:                N_i = moment-matched mixture of its images;  ñ_i = Σ_m exp(−D_B(N_m, N_i)/τ)
    station j, all clients:  N_j, N_g = n-weighted moment-matched mixtures of the clients' Gaussians
    edge weight of i in j:   w_i ∝ ñ_i · exp(−D_B(N_i, N_j)/τ)
    cloud weight of j:       γ_j ∝ ñ_j · exp(−D_B(N_j, N_g)/τ),  ñ_j = Σ_{i∈j} ñ_i
    D_B(N_1, N_2) = Σ_c (μ_1 − μ_2)²/(4(σ²_1 + σ²_2)) + ½ ln((σ²_1 + σ²_2)/(2 σ_1 σ_2))   (diagonal Gaussians)

The moments ``(n_i, ñ_i, μ_i, σ²_i)`` are released once, in the setup exchange (the "distributional moments"
HFedATM calls a privacy risk); each station then sends its clients ``N_j`` and a client replies with its own
edge weight ``w_i`` beside FedAvg's reply. Local training is FedAvg's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Params,
    Reply,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import train_local
from feddg.devices import images
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights, number_slot
from feddg.tasks import IMAGES

MEAN, VAR, N, N_EFF = "fedrc/mean", "fedrc/var", "fedrc/n", "fedrc/n_eff"  # a client's Gaussian (setup reply)
STATION_MEAN, STATION_VAR = "fedrc/station_mean", "fedrc/station_var"  # station -> client: N_j
WEIGHT = "fedrc/weight"  # client -> station: w_i
EPS = 1e-6  # variance floor: a constant image (a blank digit) has σ² = 0


class FedRCParams(Params):
    image_weighting: bool = Field(
        True, description="count each image by exp(−D_B(image, its client)/τ) (false: each image counts 1)"
    )
    temperature: float = Field(1.0, gt=0, description="τ of exp(−D_B/τ); large τ tends to data-volume weights")


def image_gaussians(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-image, per-channel mean and variance of the pixels of a batch ``(B, C, H, W)``: two ``(B, C)``."""
    flat = x.flatten(2).double()
    return flat.mean(2), flat.var(2, unbiased=False)


def mixture(means: np.ndarray, variances: np.ndarray, weights: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The moment-matched Gaussian of a weighted mixture of diagonal Gaussians (rows of ``means``/``variances``)."""
    w = np.asarray(weights, dtype=np.float64)[:, None] / float(np.sum(weights))
    mean = (w * means).sum(0)
    return mean, (w * (variances + means**2)).sum(0) - mean**2


def bhattacharyya(mean1: np.ndarray, var1: np.ndarray, mean2: np.ndarray, var2: np.ndarray) -> np.ndarray:
    """``D_B`` of diagonal Gaussians, summed over the last axis (channels); broadcasts over leading axes."""
    v1, v2 = np.asarray(var1) + EPS, np.asarray(var2) + EPS
    s = v1 + v2
    return ((np.asarray(mean1) - mean2) ** 2 / (4 * s) + 0.5 * np.log(s / (2 * np.sqrt(v1 * v2)))).sum(-1)


class FedRC(Method):
    """FedAvg clients; stations and the server weight by Gaussian similarity × (image-weighted) volume."""

    name = "fedrc"
    reconstructed = True  # weights from the abstract: neither the paper text nor the authors' code gives a formula
    requires = frozenset({IMAGES})  # per-image pixel Gaussians
    Params = FedRCParams
    params: FedRCParams
    station_merges: ClassVar[tuple[str, ...]] = ("avg",)
    search_space: ClassVar[dict[str, list[object]]] = {"temperature": [0.3, 1.0, 3.0]}

    def similarity(self, distance: np.ndarray | float) -> np.ndarray:
        return np.exp(-np.asarray(distance) / self.params.temperature)

    def station_init(self, station: ServerState, members: list[int]) -> ServerState:
        return {**station, "members": members}

    # --- setup: every client's Gaussian, once ------------------------------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        return {"fedrc/request": 1}

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {N: number_slot(int), N_EFF: number_slot(), MEAN: array_slot((-1,), np.float64),
                VAR: array_slot((-1,), np.float64)}  # the client's Gaussian

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        means, variances = zip(*(image_gaussians(images(x).cpu()) for x, _ in ctx.batches(shuffle=False, train=False)),
                               strict=True)
        mu_m, var_m = torch.cat(means).numpy(), torch.cat(variances).numpy()
        mean, var = mixture(mu_m, var_m, np.ones(len(mu_m)))
        n_eff = float(self.similarity(bhattacharyya(mu_m, var_m, mean, var)).sum()) if self.params.image_weighting \
            else float(len(mu_m))
        reply: Message = {N: len(mu_m), N_EFF: n_eff, MEAN: mean, VAR: var}
        return reply, {**client_state, **reply}

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """The station's Gaussian ``N_j`` (sent to its clients) and its cloud weight ``γ_j``."""
        def gaussian(rs: list[Reply]) -> tuple[np.ndarray, np.ndarray]:
            return mixture(np.stack([np.asarray(r.message[MEAN]) for r in rs]),
                           np.stack([np.asarray(r.message[VAR]) for r in rs]),
                           [float(r.message[N]) for r in rs])

        members = set(state.get("members", [r.client_id for r in replies]))  # no station_init: every client
        own = [r for r in replies if r.client_id in members]
        mean, var = gaussian(own)
        cloud = float(sum(float(r.message[N_EFF]) for r in own) * self.similarity(bhattacharyya(mean, var,
                                                                                                 *gaussian(replies))))
        return {**state, "station_mean": mean, "station_var": var, "cloud_weight": cloud}

    # --- rounds ----------------------------------------------------------------------------
    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        return {**state["weights"], STATION_MEAN: state["station_mean"], STATION_VAR: state["station_var"]}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        distance = bhattacharyya(*(np.asarray(v) for v in (client_state[MEAN], client_state[VAR], msg[STATION_MEAN],
                                                           msg[STATION_VAR])))
        weight = float(client_state[N_EFF]) * float(self.similarity(distance))
        return weights_reply(model, ctx.num_examples, loss, **{WEIGHT: weight}), client_state

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        return {WEIGHT: number_slot()}  # w_i

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        """The station's mean weighted by ``w_i`` instead of ``n_i``."""
        assert acc.weights is not None
        acc.weights.add(reply.message, float(reply.message[WEIGHT]))
        return acc

    def station_weight(self, station: ServerState, active_clients: int) -> float:
        return float(station["cloud_weight"])
