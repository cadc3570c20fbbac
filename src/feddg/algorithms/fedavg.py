"""FedAvg (McMahan et al., 2017): local SGD, then the ``num_examples``-weighted mean of weights."""

from __future__ import annotations

from torch import nn

from feddg.algorithms.base import ClientContext, ClientState, Method, weights_reply
from feddg.algorithms.components.local import train_local
from feddg.messages import Message, load_weights


class FedAvg(Method):
    """Clients train E local epochs with cross-entropy and return their weights."""

    name = "fedavg"

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        loss = train_local(model, ctx, lr=float(msg["lr"]))
        return weights_reply(model, ctx.num_examples, loss), client_state
