"""FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021).

FedAvg for every layer except BatchNorm: a client's BN parameters *and* running statistics stay on the
client (its client state) and are never overwritten by the server (Algorithm 1: aggregate all but BN).

    w_non-BN ← Σ_k (n_k / N) w_k,non-BN                the server, for everyone
    w_k,BN   ← client k's own, trained locally           never averaged into a client's model

Evaluation (``personalized = True``): client ``k``'s model is the global non-BN weights with its own BN.
An unseen domain has no BN of its own; ``eval_weights(state, None)`` (``global_ood_acc``) gives it:

* ``unseen_bn: average`` (default) — the ``n_k``-weighted average of the clients' BN layers;
* ``unseen_bn: target`` — the average BN affine parameters, statistics recomputed on each test batch:
  the running statistics are reset (mean 0, variance 1, ``num_batches_tracked = 0``) and :meth:`predict`
  normalises every BN layer that has tracked no batch with the batch's own statistics.

Messages: the server sends the non-BN ``w/`` weights (and, once, the BN a new client starts from under
``bn/``); a client replies with its non-BN ``w/`` weights and its BN under ``bn/``, so that the server can
evaluate it and build the unseen-domain model (as Local-only uploads its model). The server keeps each
client's latest BN for that only and never sends it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
from pydantic import Field
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

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
from feddg.devices import Inputs
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, array_slot, load_weights, weights_of
from feddg.tasks import BATCHNORM

BN_PREFIX = "bn/"  # a client's own BN arrays (``bn/w/<key>``): server -> client once, client -> server each round


class FedBNParams(Params):
    unseen_bn: Literal["average", "target"] = Field(
        "average", description="BN of the unseen-domain model: the clients' average, or the test batch's statistics"
    )


def bn_keys(model: nn.Module) -> list[str]:
    """The ``w/`` keys of every BatchNorm parameter and buffer of ``model``."""
    keys = [WEIGHT_PREFIX + (f"{name}." if name else "") + k
            for name, m in model.named_modules() if isinstance(m, _BatchNorm) for k in m.state_dict()]
    if not keys:
        raise ValueError("FedBN needs a model with BatchNorm layers (without them it is FedAvg)")
    return keys


def without_statistics(weights: Message, keys: list[str]) -> Message:
    """``weights`` with every BN layer's running statistics reset and ``num_batches_tracked = 0``."""
    out = dict(weights)
    for k in keys:
        v = np.asarray(out[k])
        if k.endswith((".running_mean", ".num_batches_tracked")):
            out[k] = np.zeros_like(v)
        elif k.endswith(".running_var"):
            out[k] = np.ones_like(v)
    return out


@contextmanager
def batch_statistics(model: nn.Module) -> Iterator[None]:
    """BN layers that have tracked no batch normalise with the batch's statistics, even in eval mode."""
    fresh = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.num_batches_tracked is not None
             and int(m.num_batches_tracked) == 0]
    saved = [(m.running_mean, m.running_var) for m in fresh]
    for m in fresh:
        m.running_mean, m.running_var = None, None  # eval-mode forward then uses batch statistics
    try:
        yield
    finally:
        for m, (mean, var) in zip(fresh, saved, strict=True):
            m.running_mean, m.running_var = mean, var


class FedBN(Method):
    """FedAvg of all but BatchNorm; BN stays with each client."""

    name = "fedbn"
    Params = FedBNParams
    params: FedBNParams
    requires = frozenset({BATCHNORM})  # its BatchNorm layers stay local: without them it would be FedAvg
    personalized = True
    bn: list[str]  # the model's BN keys (``w/...``), set by prepare_model


    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Records the model's BN keys (the same on the server and every client)."""
        self.bn = bn_keys(model)
        return model

    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        return {"weights": weights_of(model), "clients": {}}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        """The global non-BN weights; for a client the server has not heard from yet (its first round) also
        the BN it starts from, under ``bn/``: the initial BN, or from round 2 on the clients' average."""
        bn = set(self.bn)
        msg = {k: v for k, v in state["weights"].items() if k not in bn}
        if client_id not in state["clients"]:
            msg.update({BN_PREFIX + k: state["weights"][k] for k in self.bn})
        return msg

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        own = client_state or {k: msg[BN_PREFIX + k] for k in self.bn}
        load_weights(model, {**msg, **own})
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        reply = weights_reply(model, ctx.num_examples, loss)
        new_bn = {k: reply.pop(k) for k in self.bn}
        return {**reply, **{BN_PREFIX + k: v for k, v in new_bn.items()}}, new_bn

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """The client's own BN arrays (``bn/w/<key>``), shaped as the model's."""
        return {BN_PREFIX + k: array_slot(*weights[k]) for k in self.bn}

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        """FedAvg's running sum of the non-BN weights, plus that of the clients' BN (the unseen-domain BN)."""
        acc = super().accumulate(acc, reply)
        assert acc.weights is not None
        acc.sums.setdefault(BN_PREFIX, WeightedSum(BN_PREFIX, acc.weights.scale)).add(reply.message, reply.num_examples)
        return acc

    def keep(self, reply: Reply) -> Message:
        """The client's BN layers, for its personalised evaluation."""
        return {k: reply.message[BN_PREFIX + k] for k in self.bn}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """The FedAvg of the non-BN weights, the clients' BN average (only for unseen domains), and each
        replying client's BN (only for its own evaluation)."""
        state, metrics = super().finish(state, acc)
        average = {k.removeprefix(BN_PREFIX): v for k, v in acc.sums[BN_PREFIX].mean().items()}
        clients = {**state["clients"], **{r.client_id: r.message for r in acc.kept}}
        return {**state, "weights": {**state["weights"], **average}, "clients": clients}, metrics

    def eval_weights(self, state: ServerState, client_id: int | None = None) -> Message:
        if client_id is not None and client_id in state["clients"]:
            return {**state["weights"], **state["clients"][client_id]}
        if self.params.unseen_bn == "target":
            return without_statistics(state["weights"], self.bn)
        return state["weights"]

    def predict(self, model: nn.Module, x: Inputs) -> Tensor:
        with batch_statistics(model):
            return model(x)
