"""FedGMA (Tenison et al., "Gradient Masked Averaging for Federated Learning", TMLR 2023).

The server keeps, per coordinate ``j``, only the part of the averaged client update whose *direction*
the clients agree on. With the client updates ``Δ_k = w_k − w`` of the ``K`` clients of a round:

    A_j = |Σ_k sign(Δ_k,j)| / K                                  (sign agreement, in [0, 1])
    m_j = 1 if A_j ≥ τ else A_j                                  (the paper's soft mask; ``mask: paper``)
    m_j = 1 if A_j ≥ τ else 0                                    (a hard AND-mask; ``mask: port``)
    w  ← w + η_s · m ⊙ Σ_k (n_k / N) Δ_k                         (server learning rate η_s)

Only trainable parameters are masked; buffers (BatchNorm running statistics) are FedAvg-averaged.
Each client sends its weights (FedAvg's running sum gives ``Σ_k (n_k/N) Δ_k = mean_w − w``) and
``sign(Δ_k)`` as int8 arrays, folded into one running sum: the server holds O(model) during a round.
At ``τ = 0``, ``η_s = 1`` it is FedAvg.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field
from torch import nn

from feddg.aggregation.mean import WeightedSum
from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Metrics,
    Params,
    Reply,
    ServerContext,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import train_local
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, array_slot, load_weights, weights_of

SIGN_PREFIX = "sign/"  # client -> server: sign(w_k − w) per trainable parameter, int8


class FedGMAParams(Params):
    threshold: float = Field(0.4, ge=0.0, le=1.0, description="τ: agreement at and above which the mask is 1")
    server_lr: float = Field(1.0, gt=0.0, description="η_s, the server learning rate on the masked mean update")
    mask: Literal["paper", "port"] = Field(
        "paper", description="below τ: paper = the agreement A_j itself (soft; also declearn's and FedTHE's ports), "
        "port = 0 (a hard AND-mask)"
    )


def gradient_mask(sign_sum: np.ndarray, count: int, threshold: float, mode: str) -> np.ndarray:
    """``m = 1`` where ``A = |Σ_k sign(Δ_k)| / K ≥ τ``; elsewhere ``A`` (paper) or 0 (port)."""
    agreement = np.abs(sign_sum) / count
    below = agreement if mode == "paper" else np.zeros_like(agreement)
    return np.where(agreement >= threshold, 1.0, below)


class FedGMA(Method):
    """FedAvg's local training; the server masks the mean update coordinate-wise by sign agreement."""

    name = "fedgma"
    Params = FedGMAParams
    params: FedGMAParams
    search_space: ClassVar[dict[str, list[Any]]] = {"threshold": [0.3, 0.5, 0.7], "server_lr": [1.0, 0.1, 0.01]}  # hFedF Table 10


    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        return {"weights": weights_of(model), "params": [n for n, _ in model.named_parameters()]}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        reply = weights_reply(model, ctx.num_examples, loss)
        signs = {SIGN_PREFIX + n: np.sign(reply[WEIGHT_PREFIX + n] - np.asarray(msg[WEIGHT_PREFIX + n])).astype(np.int8)
                 for n, _ in model.named_parameters()}
        return {**reply, **signs}, client_state

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """sign(w_k − w) per trainable parameter, int8."""
        return {SIGN_PREFIX + n: array_slot(tuple(p.shape), np.int8) for n, p in model.named_parameters()}

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        """FedAvg's running sum of the weights, plus the running ``Σ_k sign(Δ_k)`` (each client counts 1)."""
        acc = super().accumulate(acc, reply)
        acc.sums.setdefault(SIGN_PREFIX, WeightedSum(SIGN_PREFIX)).add(reply.message, 1.0)
        return acc

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        assert acc.weights is not None
        mean, old = acc.weights.mean(), state["weights"]
        signs = acc.sums[SIGN_PREFIX]
        count = round(signs.total)
        new, masked, total = dict(mean), 0.0, 0
        for n in state["params"]:
            key = WEIGHT_PREFIX + n
            m = gradient_mask(signs.sums[SIGN_PREFIX + n], count, self.params.threshold, self.params.mask)
            # w + η_s m ⊙ (w̄ − w), written as w̄ + (η_s m − 1)(w̄ − w): exactly FedAvg's w̄ where η_s m = 1
            new[key] = (mean[key] + (self.params.server_lr * m - 1.0) * (mean[key].astype(np.float64) - old[key])).astype(
                old[key].dtype)
            masked, total = masked + float(m.sum()), total + m.size
        return {**state, "weights": new}, {"gma/mask_mean": masked / max(total, 1)}
