"""FedProx (Li et al., 2020): FedAvg plus a proximal term ``μ/2 ‖w − w_global‖²`` (their eq. 2):

    h_k(w) = F_k(w) + μ/2 ‖w − w^t‖²          F_k: the task's loss on client k's data
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, ClientState, Method, Params, weights_reply
from feddg.algorithms.components.local import train_local
from feddg.devices import Inputs
from feddg.messages import Message, load_weights


class FedProxParams(Params):
    mu: float = Field(0.01, ge=0.0, description="weight of the proximal term")


def proximal_term(model: nn.Module, anchor: list[Tensor]) -> Tensor | int:
    """``Σ_i ‖w_i − a_i‖²`` over the trainable parameters (the int 0 for a model without any)."""
    return sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))


class FedProx(Method):
    """Local objective ``task loss + μ/2 ‖w − w_global‖²``; FedAvg aggregation. At μ=0 it is FedAvg."""

    name = "fedprox"
    Params = FedProxParams
    params: FedProxParams
    search_space = {"mu": [1e-1, 1e-2, 1e-3]}  # hFedF paper, Table 10 (FedProx's "L2 regularizer" grid)

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        anchor = [p.detach().clone() for p in model.parameters()]
        mu = self.params.mu

        def loss_fn(m: nn.Module, x: Inputs, y: Tensor) -> Tensor:
            loss = ctx.task.loss(m(x), y)
            return loss + 0.5 * mu * proximal_term(m, anchor) if mu > 0 else loss

        loss = train_local(model, ctx, lr=float(msg["lr"]), loss_fn=loss_fn)
        return weights_reply(model, ctx.num_examples, loss), client_state



