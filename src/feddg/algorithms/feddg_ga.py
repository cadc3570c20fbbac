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

When the gap is measured (``gap_at``; docs/methods/feddg_ga.md):

* ``aggregated`` (default, the official code): ``G_k^r = L(θ^{r+1}; D_k) − L(θ_k^r; D_k)``, the *newly
  aggregated* model against the client's model of the same round, and ``a`` moves before round ``r+1``'s
  aggregation. With one exchange per round the client measures ``L(θ^{r+1}; D_k)`` when θ^{r+1} reaches it
  (before its next training) and keeps ``L(θ_k^r; D_k)`` in its state; ``finish`` of round ``r+1`` adjusts ``a``
  by those gaps and then aggregates, so it holds the round's replies (O(clients × model)).
* ``received``: ``G_k = L(θ; D_k) − L(θ_k; D_k)`` with θ the model the client received this round: the gap is
  one aggregation older, the fold streams (O(model)).

Both losses (or accuracies) are means over the client's training data in eval mode, without augmentation.
The client echoes the ``a_k`` it was sent (``ga_weight``); a reply whose echo differs is dropped when it arrives
(:meth:`FedDGGA.reply_layout`, checked by the server's reply check).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch
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
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, entries, load_weights, number_slot, weights_of

WEIGHT = "ga_weight"  # server -> client -> server: the client's aggregation weight a_k (echoed)
GAP = "ga_gap"  # client -> server: G_k
HAS_GAP = "ga_has_gap"  # client -> server (gap_at: aggregated): 1 when ga_gap was measured this round
LOCAL = "ga/local"  # client state (gap_at: aggregated): [loss, score] of its last trained model
LOCAL_ROUND = "ga/local_round"  # ... and the round it was trained in


class FedDGGAParams(Params):
    step: float = Field(0.2 / 3, ge=0.0, le=1.0, description="d, the first step (official code: 0.2 × a fixed 1/3)")
    gap_at: Literal["aggregated", "received"] = Field(
        "aggregated", description="the global term: the newly aggregated model (official code; holds a round's "
        "replies) or the model the client received this round (one aggregation older; streams)"
    )
    centre_gaps: bool = Field(False, description="subtract the mean gap before normalising (false: the official code)")
    metric: Literal["score", "loss"] = Field(
        "score", description="gap in the task's metric, G_k = score(θ_k) − score(θ) (accuracy for classification: the "
        "official script's --fair acc), or in the task's loss, G_k = L(θ) − L(θ_k)"
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


def loss_and_score(model: nn.Module, ctx: ClientContext) -> tuple[float, float]:
    """The mean task loss and the task's metric (accuracy for classification, in %) of ``model`` on the client's
    training data (eval mode, in order)."""
    model.eval()
    loss, n = 0.0, 0
    tally = ctx.task.tally_zeros(1)
    with torch.no_grad():
        for x, y in ctx.batches(shuffle=False, train=False):
            out = model(x)
            loss += float(ctx.task.loss(out, y)) * len(y)
            tally += ctx.task.tally(out, y, np.zeros(len(y), dtype=np.int64), 1)
            n += len(y)
    return loss / max(n, 1), ctx.task.score(tally[0]) if n else 0.0


class FedDGGA(Method):
    """FedAvg's local training; aggregation weights adjusted by the clients' generalisation gaps."""

    name = "feddg_ga"
    rounds_in_state = True  # d_r = d (1 − r/R) decays over the run's R rounds
    Params = FedDGGAParams
    params: FedDGGAParams
    search_space: ClassVar[dict[str, list[Any]]] = {"step": [0.025, 0.05, 0.2 / 3, 0.1, 0.2]}


    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        a = np.full(ctx.num_clients, 1.0 / ctx.num_clients)
        return {"weights": weights_of(model), "ga_weights": a, "round": 0, "rounds": ctx.rounds}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        return {**state["weights"], WEIGHT: float(state["ga_weights"][client_id])}

    def gap(self, global_model: tuple[float, float], local_model: tuple[float, float]) -> float:
        """``G_k`` from the (loss, score) of the global and the local model on the client's data."""
        if self.params.metric == "loss":
            return global_model[0] - local_model[0]
        return local_model[1] - global_model[1]

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        received = loss_and_score(model, ctx)  # the global model θ on D_k
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        trained = loss_and_score(model, ctx)  # the local model θ_k on D_k
        echo = {WEIGHT: float(msg[WEIGHT])}
        if self.params.gap_at == "received":
            return weights_reply(model, ctx.num_examples, loss, **echo, **{GAP: self.gap(received, trained)}), client_state
        # θ received now is the aggregate of the round this client last trained in, if that was the last round
        fresh = client_state.get(LOCAL_ROUND) == ctx.round - 1
        last = tuple(float(v) for v in np.asarray(client_state[LOCAL])) if fresh else (0.0, 0.0)
        gap = {GAP: self.gap(received, (last[0], last[1])) if fresh else 0.0, HAS_GAP: int(fresh)}
        state: ClientState = {LOCAL: np.array(trained, dtype=np.float64), LOCAL_ROUND: ctx.round}
        return weights_reply(model, ctx.num_examples, loss, **echo, **gap), state

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """The weight a_k echoed as sent, the gap G_k, and (``gap_at: aggregated``) whether it was measured."""
        layout = {WEIGHT: number_slot(value=float(sent[WEIGHT])), GAP: number_slot()}
        return layout if self.params.gap_at == "received" else {**layout, HAS_GAP: number_slot(int)}

    def start(self, expected_examples: float) -> Accumulator:
        """``received``: a running ``Σ_k a_k θ_k`` (plain sums; ``finish`` divides by ``Σ_k a_k``). ``aggregated``:
        the replies are kept (their weights ``a`` are known only once the round's gaps are in)."""
        return Accumulator(WeightedSum(WEIGHT_PREFIX) if self.params.gap_at == "received" else None)

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        if acc.weights is not None:
            acc.weights.add(reply.message, float(reply.message[WEIGHT]))
        acc.kept.append(Reply(reply.client_id, self.keep(reply)))
        return acc

    def keep(self, reply: Reply) -> Message:
        kept = {k: v for k, v in reply.message.items() if k in (WEIGHT, GAP, HAS_GAP)}
        if self.params.gap_at == "aggregated":
            kept.update(entries(reply.message, WEIGHT_PREFIX))
        return kept

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        a = state["ga_weights"]  # every kept reply echoed its a_k as sent (reply_layout)
        r, rounds = int(state["round"]) + 1, int(state["rounds"])
        if self.params.gap_at == "received":  # this round's gaps set the next round's weights
            assert acc.weights is not None
            gap_round, weighted = r, acc.weights
        else:  # the gaps of round r − 1 (measured on its aggregate) set this round's weights
            gap_round, weighted = r - 1, None
        gaps = {k.client_id: float(k.message[GAP]) for k in acc.kept if k.message.get(HAS_GAP, 1)}
        step = self.params.step * (1.0 - gap_round / rounds)
        new_a = adjust_weights(a, gaps, step, self.params.centre_gaps) if gaps else a
        if weighted is None:
            weighted = WeightedSum(WEIGHT_PREFIX)
            for k in acc.kept:
                weighted.add(k.message, float(new_a[k.client_id]))
        skipped = weighted.total <= 0  # every sampled client's a_k is 0: the global model stays
        metrics = {"ga/step": step, "ga/gaps": float(len(gaps)), "ga/skipped": float(skipped),
                   "ga/weight_max": float(new_a.max()), "ga/weight_min": float(new_a.min())}
        metrics.update({"ga/gap_mean": float(np.mean(list(gaps.values())))} if gaps else {})
        weights = state["weights"] if skipped else weighted.mean()
        return {**state, "weights": weights, "ga_weights": new_a, "round": r}, metrics
