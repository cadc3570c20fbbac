"""MTGC (Fang, Han, Chen, Wang, Brinton, "Hierarchical Federated Learning with Multi-Timescale Gradient
Correction", NeurIPS 2024): a hierarchical baseline of HFedATM's Fig. 2, on the station topology only.

Client ``i`` of station (group) ``j`` corrects every local gradient by two control variables: ``z_i`` pulls it
towards its station's gradient, ``y_j`` pulls the station's towards the global one. With ``H`` local steps
of size ``γ`` per station round, ``E`` station rounds per server round ``t``, and ``x̄`` the averages:

    x_i ← x_i − γ (∇F_i(x_i) + z_i + y_j)                              (every local step)
    z_i ← z_i + (x_i^{t,e,H} − x̄_j^{t,e+1}) / (H γ)                     (after each station aggregation)
    y_j ← y_j + (x̄_j^{t,E} − x̄^{t+1}) / (H E γ)                         (after each server aggregation)
    z_i = 0 at the start of every server round; y_j = 0 at the start of training.

So ``z_i`` becomes (station mean gradient − own gradient) over the last station round and ``y_j`` (global
mean gradient − station mean gradient) over the last server round — SCAFFOLD's option II at two timescales.
As in the authors' code (``train_MTGC``, wenzhifang/MTGC), ``z`` is reset every server round and the
correction enters the loss as ``⟨z + y, x⟩``. Choices (docs/methods/mtgc.md): the client learns
``x̄_j^{t,e+1}`` as the station model it receives next, so ``z_i`` is updated at the start of its next
station round (a client that missed the previous station round keeps its ``z_i``); ``Hγ`` is each client's own
step count × learning rate (``z_step: client``; ``station``: the station's ``n_i``-weighted mean ``Hγ`` of
its last round, so that a station's ``n_i``-weighted ``z_i`` sum to zero with unequal clients), and the station's
``HEγ`` the sum over its station rounds of the mean ``Hγ`` of its clients (= ``HEγ`` for equal clients and a
constant rate). Station averages are FedAvg's ``n_i``-weighted
ones (the paper's are uniform over equal-size clients). Plain SGD local steps only, as in the derivation.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

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
from feddg.algorithms.components.local import LossFn
from feddg.algorithms.scaffold import corrected_training
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, load_weights, number_slot, weights_of

Y = "mtgc/y/"  # station -> client: y_j per trainable parameter
Z = "mtgc/z/"  # client state: z_i
X = "mtgc/x/"  # client state: the client's model after its last local training
EPOCH = "mtgc/epoch"  # server rounds completed: a new value resets z
STEP = "mtgc/h_gamma"  # H·γ of a client's local training (reply and client state)
STATION_STEP = "mtgc/h_gamma_station"  # station -> client: the n-weighted mean H·γ of its last station round


class MTGCParams(Params):
    z_step: Literal["client", "station"] = Field(
        "client", description="Hγ dividing z_i's update: the client's own step count × rate, or its station's "
        "n-weighted mean over the last station round (equal for equal clients; with unequal ones only station keeps "
        "a station's n-weighted z_i summing to zero)")


def corrections_after(z: list[np.ndarray], x_last: list[np.ndarray], station: list[np.ndarray],
                      h_gamma: float) -> list[np.ndarray]:
    """``z_i + (x_i^{t,e,H} − x̄_j^{t,e+1}) / (Hγ)``."""
    return [(zz + (xx.astype(np.float64) - s) / h_gamma).astype(zz.dtype) for zz, xx, s in zip(z, x_last, station, strict=True)]


def station_correction(y: np.ndarray, station: np.ndarray, merged: np.ndarray, h_e_gamma: float) -> np.ndarray:
    """``y_j + (x̄_j^{t,E} − x̄^{t+1}) / (HEγ)``."""
    return (y + (station.astype(np.float64) - merged) / h_e_gamma).astype(y.dtype)


class MTGC(Method):
    """Local SGD corrected by ``z_i + y_j``; stations average (FedAvg); ``y_j`` updated at every server merge."""

    name = "mtgc"
    Params = MTGCParams
    params: MTGCParams
    station_merges: ClassVar[tuple[str, ...]] = ("avg",)
    loss_fn: LossFn | None = None  # the local objective F_i: the task's loss (tests swap in a quadratic)

    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        """One station's state (the topology copies it per station): its model, ``y_j``, ``Σ_e Hγ`` so far."""
        y = {n: np.zeros_like(p.detach().cpu().numpy()) for n, p in model.named_parameters()}
        return {"weights": weights_of(model), "y": y, "h_gamma_sum": 0.0, "h_gamma_station": 0.0, "epoch": 0}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        station_step = {STATION_STEP: state["h_gamma_station"]} if self.params.z_step == "station" else {}
        return {**state["weights"], **{Y + n: v for n, v in state["y"].items()}, EPOCH: state["epoch"], **station_step}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        if ctx.optim.name != "sgd" or ctx.optim.momentum != 0:
            raise ValueError("mtgc's corrections assume plain SGD local steps: set optim.name=sgd optim.momentum=0")
        load_weights(model, msg)
        names = [n for n, _ in model.named_parameters()]
        y = [np.asarray(msg[Y + n]) for n in names]
        z = [np.zeros_like(v) for v in y]
        if client_state.get(EPOCH) == msg[EPOCH]:  # same server round: z from the last station aggregation
            z = [np.asarray(client_state[Z + n]) for n in names]
            if client_state.get("round") == ctx.round - 1:
                x_last = [np.asarray(client_state[X + n]) for n in names]
                h_gamma = float(msg[STATION_STEP] if self.params.z_step == "station" else client_state[STEP])
                z = corrections_after(z, x_last, [np.asarray(msg[WEIGHT_PREFIX + n]) for n in names], h_gamma)
        correction = [torch.from_numpy(zz + yy).to(ctx.device) for zz, yy in zip(z, y, strict=True)]
        lr = float(msg["lr"])
        loss, steps = corrected_training(model, ctx, lr, correction, self.loss_fn)
        reply = weights_reply(model, ctx.num_examples, loss, **{STEP: steps * lr})
        state: ClientState = {EPOCH: msg[EPOCH], "round": ctx.round, STEP: steps * lr}
        state.update({Z + n: v for n, v in zip(names, z, strict=True)})
        state.update({X + n: np.asarray(reply[WEIGHT_PREFIX + n]) for n in names})
        return reply, (state if steps else {})  # no step taken (fp16 skipped every one): nothing to correct

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        return {STEP: number_slot()}  # H·γ

    def keep(self, reply: Reply) -> Message | None:
        return {STEP: reply.message[STEP], "num_examples": reply.num_examples}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """The station's FedAvg; adds this station round's mean ``Hγ`` to ``Σ_e Hγ`` and keeps its ``n_i``-weighted
        mean for the clients' next ``z_i`` (``z_step: station``)."""
        assert acc.weights is not None
        steps = [float(r.message[STEP]) for r in acc.kept]
        h_gamma = float(np.mean(steps))
        weighted = float(np.average(steps, weights=[r.num_examples for r in acc.kept]))
        return {**state, "weights": acc.weights.mean(), "h_gamma_sum": state["h_gamma_sum"] + h_gamma,
                "h_gamma_station": weighted}, {"mtgc/h_gamma": h_gamma}

    def station_merged(self, station: ServerState, merged: Message) -> ServerState:
        """After the server's average: ``y_j`` moves by the station's drift from it; a new server round."""
        y = station["y"]
        if station["h_gamma_sum"] > 0:  # the station trained this server round
            y = {n: station_correction(v, station["weights"][WEIGHT_PREFIX + n], np.asarray(merged[WEIGHT_PREFIX + n]),
                                       station["h_gamma_sum"]) for n, v in y.items()}
        return {**station, "weights": merged, "y": y, "h_gamma_sum": 0.0, "epoch": station["epoch"] + 1}
