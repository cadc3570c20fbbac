"""FedAvgM (Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", arXiv 1909.06335, 2019, §3): server momentum on the averaged update.

With the round's FedAvg mean ``w̄ = Σ_k (n_k/N) w_k`` and the pseudo-gradient ``Δ = w − w̄``:

    v ← β v + Δ                 server momentum β (``server_momentum``), v = 0 at the start
    w ← w − η_s v               server learning rate η_s (``server_lr``)

on the trainable parameters; buffers (BatchNorm running statistics) are FedAvg-averaged. ``v`` is server
state, so the checkpoint holds it and a resumed run is exact. At β = 0 and η_s = 1 it is FedAvg bit for bit.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from pydantic import Field
from torch import nn

from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Metrics,
    Params,
    ServerContext,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import train_local
from feddg.messages import WEIGHT_PREFIX, Message, load_weights, weights_of


class FedAvgMParams(Params):
    server_lr: float = Field(1.0, gt=0.0, description="η_s, the server learning rate on the momentum v")
    server_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="β, the server momentum (0: FedAvg at η_s=1)")


def momentum_step(w: np.ndarray, mean: np.ndarray, v: np.ndarray, lr: float, beta: float) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """``v⁺ = β v + (w − w̄)``, ``w⁺ = w − η_s v⁺``, written as ``w̄ + (1 − η_s)(w − w̄) − η_s β v`` (exactly ``w̄`` at
    β = 0, η_s = 1); float64 arithmetic, returned in ``w``'s dtype."""
    delta = w.astype(np.float64) - mean
    new_v = beta * v.astype(np.float64) + delta
    new_w = mean + (1.0 - lr) * delta - lr * beta * v.astype(np.float64)
    return new_w.astype(w.dtype), new_v.astype(v.dtype)


class FedAvgM(Method):
    """FedAvg's local training; the server applies heavy-ball momentum to the mean update."""

    name = "fedavgm"
    Params = FedAvgMParams
    params: FedAvgMParams
    search_space: ClassVar[dict[str, list[Any]]] = {"server_momentum": [0.0, 0.7, 0.9, 0.97], "server_lr": [0.5, 1.0]}

    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        velocity = {n: np.zeros_like(p.detach().cpu().numpy()) for n, p in model.named_parameters()}
        return {"weights": weights_of(model), "velocity": velocity}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        return weights_reply(model, ctx.num_examples, loss), client_state

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        assert acc.weights is not None
        mean, old, p = acc.weights.mean(), state["weights"], self.params
        new, velocity = dict(mean), {}
        for n, v in state["velocity"].items():
            key = WEIGHT_PREFIX + n
            new[key], velocity[n] = momentum_step(old[key], mean[key], v, p.server_lr, p.server_momentum)
        norm = float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in velocity.values())))
        return {**state, "weights": new, "velocity": velocity}, {"fedavgm/v_norm": norm}
