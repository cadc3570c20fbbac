"""FedDG-GA (Zhang et al., "Federated Domain Generalization with Generalization Adjustment", CVPR 2023).

The server aggregates with weights ``a_k`` (uniform at the start) and moves them every round towards the
clients on which the global model generalises worst. With client ``k``'s generalisation gap

    G_k = L(θ; D_k) − L(θ_k; D_k)            (global model θ vs the client's trained model θ_k, on its data)

the round-``r`` adjustment, with a step that decays linearly over the ``R`` rounds, is

    d^r = d · (1 − r / R)
    a_k ← a_k + d^r · (G_k − Ḡ) / max_j |G_j − Ḡ|          (Ḡ = mean gap; ``centre_gaps: false``: Ḡ = 0,
                                                              as the official code)
    a   ← clip(a, 0, 1) / Σ clip(a, 0, 1)
    θ   ← Σ_k a_k θ_k / Σ_k a_k                              (the next round's aggregation)

One exchange per round: the client measures ``L(θ; D_k)`` on the model it receives, *before* training,
and ``L(θ_k; D_k)`` after (the official code measures the newly aggregated model, a second exchange).
Both losses are means over the client's training data in eval mode, without augmentation.

The fold: ``accumulate`` has no server state, so ``client_config`` sends each client its ``a_k``
(``ga_weight``) and the client echoes it; ``finish`` checks every echo against the server's ``a``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
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
from feddg.messages import WEIGHT_PREFIX, Message, load_weights, weights_of

WEIGHT = "ga_weight"  # server -> client -> server: the client's aggregation weight a_k (echoed)
GAP = "ga_gap"  # client -> server: G_k


class FedDGGAParams(Params):
    step: float = Field(0.2 / 3, ge=0.0, le=1.0, description="d, the first step (official code: 0.2 × a fixed 1/3)")
    centre_gaps: bool = Field(True, description="subtract the mean gap before normalising; false: the official code")
    metric: Literal["loss", "accuracy"] = Field(
        "loss", description="gap in loss, or in accuracy: G_k = acc(θ_k) − acc(θ) (the official script's default)"
    )


def adjust_weights(weights: np.ndarray, gaps: dict[int, float], step: float, centre: bool) -> np.ndarray:
    """``a_k += step · (G_k − Ḡ)/max_j|G_j − Ḡ|`` for the clients in ``gaps``, then clip to [0, 1] and
    renormalise over all clients. Equal gaps (or one client) leave ``a`` unchanged."""
    ids = np.array(sorted(gaps), dtype=np.int64)
    g = np.array([gaps[int(k)] for k in ids], dtype=np.float64)
    g = g - g.mean() if centre else g
    scale = np.abs(g).max()
    a = weights.astype(np.float64).copy()
    if scale > 0:
        a[ids] += step * g / scale
    a = np.clip(a, 0.0, 1.0)
    if a.sum() <= 0:
        raise ValueError(f"FedDG-GA: every aggregation weight was clipped to 0 (gaps {gaps}); lower method.params.step")
    return a / a.sum()


def loss_and_accuracy(model: nn.Module, ctx: ClientContext) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on the client's training data (eval mode, in order)."""
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in ctx.batches(shuffle=False, train=False):
            logits = model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            n += len(y)
    return loss / max(n, 1), correct / max(n, 1)


class FedDGGA(Method):
    """FedAvg's local training; aggregation weights adjusted by the clients' generalisation gaps."""

    name = "feddg_ga"
    Params = FedDGGAParams
    params: FedDGGAParams
    search_space: ClassVar[dict[str, list[Any]]] = {"step": [0.025, 0.05, 0.2 / 3, 0.1, 0.2]}

    @property
    def p(self) -> FedDGGAParams:
        assert isinstance(self.params, FedDGGAParams)
        return self.params

    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        a = np.full(ctx.num_clients, 1.0 / ctx.num_clients)
        return {"weights": weights_of(model), "ga_weights": a, "round": 0, "rounds": ctx.rounds}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        return {**state["weights"], WEIGHT: float(state["ga_weights"][client_id])}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        before = loss_and_accuracy(model, ctx)  # the global model θ on D_k
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        after = loss_and_accuracy(model, ctx)  # the local model θ_k on D_k
        gap = before[0] - after[0] if self.p.metric == "loss" else after[1] - before[1]
        return weights_reply(model, ctx.num_examples, loss, **{WEIGHT: float(msg[WEIGHT]), GAP: gap}), client_state

    def start(self, expected_examples: float) -> Accumulator:
        """A running ``Σ_k a_k θ_k`` (plain sums; ``finish`` divides by ``Σ_k a_k``)."""
        return Accumulator(WeightedSum(WEIGHT_PREFIX))

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        assert acc.weights is not None
        acc.weights.add(reply.message, float(reply.message[WEIGHT]))
        acc.kept.append(Reply(reply.client_id, self.keep(reply)))
        return acc

    def keep(self, reply: Reply) -> Message:
        return {WEIGHT: reply.message[WEIGHT], GAP: reply.message[GAP]}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        assert acc.weights is not None
        a = state["ga_weights"]
        for kept in acc.kept:
            if float(kept.message[WEIGHT]) != float(a[kept.client_id]):
                raise ValueError(f"FedDG-GA: client {kept.client_id} echoed weight {kept.message[WEIGHT]}, "
                                 f"sent {a[kept.client_id]}")
        skipped = acc.weights.total <= 0  # every sampled client's a_k was clipped to 0: the global model stays
        weights = state["weights"] if skipped else acc.weights.mean()
        r = int(state["round"]) + 1
        step = self.p.step * (1.0 - r / int(state["rounds"]))
        gaps = {kept.client_id: float(kept.message[GAP]) for kept in acc.kept}
        new_a = adjust_weights(a, gaps, step, self.p.centre_gaps)
        metrics = {"ga/step": step, "ga/gap_mean": float(np.mean(list(gaps.values()))), "ga/skipped": float(skipped),
                   "ga/weight_max": float(new_a.max()), "ga/weight_min": float(new_a.min())}
        return {**state, "weights": weights, "ga_weights": new_a, "round": r}, metrics
