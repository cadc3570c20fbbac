"""FedMix (Yoon, Shin, Hwang, Yang, "FedMix: Approximation of Mixup under Mean Augmented Federated Learning",
ICLR 2021, §3, eq. 4-5).

Once, before training (the setup exchange), every client ``k`` splits its data into random groups of ``M``
samples and uploads each group's mean image ``x̄`` and mean one-hot label ``ȳ``. Every round the server sends a
client the means of the *other* clients. A client never sees another's raw data, so it trains on the
first-order Taylor approximation in ``λ`` of mixup ``ℓ(f((1 − λ) x_i + λ x̄_j), (1 − λ) y_i + λ ȳ_j)``:

    ℓ_FedMix = (1 − λ) ℓ(f((1 − λ) x_i), y_i) + λ ℓ(f((1 − λ) x_i), ȳ_j) + λ ∂ℓ/∂x · x̄_j

where ``∂ℓ/∂x`` is the gradient of ``ℓ(f(x), y_i)`` at ``x = (1 − λ) x_i``, differentiated again for the
weights (double backpropagation), and ``j`` is drawn uniformly from the received means for every sample.

Privacy: what leaves a client is ``⌊n_k / M⌋`` mean images of ``M`` of its samples each and their class
proportions (``mix/x``, ``mix/y``), once; the server forwards them to every other client, every round.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, ClientState, Method, Params, Reply, ServerState, weights_reply
from feddg.algorithms.components.local import train_local
from feddg.devices import Inputs, images
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights
from feddg.tasks import CLASS_LABELS, IMAGES, Task

MEAN_X, MEAN_Y = "mix/x", "mix/y"  # [G, C, H, W] mean images, [G, classes] mean one-hot labels


class FedMixParams(Params):
    lam: float = Field(0.05, gt=0.0, lt=1.0, description="λ, the mixing weight of the global means")
    mean_size: int = Field(5, ge=2, description="M, the samples averaged into each uploaded mean")


def group_means(x: Tensor, onehot: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The means of consecutive groups of ``size`` rows of ``x`` and ``onehot`` (an incomplete last group dropped;
    a client with fewer than ``size`` samples uploads none)."""
    g = len(x) // size
    return (x[: g * size].reshape(g, size, *x.shape[1:]).mean(1),
            onehot[: g * size].reshape(g, size, *onehot.shape[1:]).mean(1))


def fedmix_loss(model: nn.Module, task: Task, x: Tensor, y: Tensor, x_bar: Tensor, y_bar: Tensor,
                lam: float) -> Tensor:
    """Eq. 5, averaged over the batch; ``x_bar``, ``y_bar`` are each sample's drawn global mean."""
    scaled = ((1.0 - lam) * x).detach().requires_grad_(True)
    out = model(scaled)
    own = task.loss(out, y)  # the batch mean of ℓ(f((1 − λ) x_i), y_i)
    (grad_x,) = torch.autograd.grad(own, scaled, create_graph=True)  # row i: (1/B) ∂ℓ_i/∂x
    return (1.0 - lam) * own + lam * task.loss(out, y_bar) + lam * (grad_x * x_bar).sum()


class FedMix(Method):
    """Mean-augmented FL: mixup approximated with the other clients' averaged data; FedAvg aggregation.
    Privacy note: it shares averaged raw data (see the module docstring), without DP."""

    name = "fedmix"
    Params = FedMixParams
    params: FedMixParams
    requires = frozenset({IMAGES, CLASS_LABELS})  # images to average, class labels to one-hot
    search_space: ClassVar[dict[str, list[Any]]] = {"lam": [0.01, 0.05, 0.1, 0.2], "mean_size": [2, 5, 10]}

    # --- setup exchange ------------------------------------------------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        return {"mean_size": self.params.mean_size}

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {MEAN_X: array_slot((-1, -1, -1, -1), np.float32), MEAN_Y: array_slot((-1, -1), np.float32)}

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """The means of random groups of ``M`` local samples: the reply is those and nothing else."""
        xs, ys = zip(*((images(x).cpu(), y.cpu()) for x, y in ctx.batches(shuffle=True, train=False)), strict=True)
        x_bar, y_bar = group_means(torch.cat(xs), F.one_hot(torch.cat(ys), ctx.task.num_classes).float(),
                                   int(msg["mean_size"]))
        return {MEAN_X: x_bar.numpy(), MEAN_Y: y_bar.numpy()}, client_state

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """The bank of every client's means, each tagged with its owner."""
        counts = [len(r.message[MEAN_X]) for r in replies]  # type: ignore[arg-type]  # arrays, by client_setup
        if sum(c > 0 for c in counts) < 2:
            raise ValueError(f"fedmix: needs the means of at least 2 clients, got {sum(c > 0 for c in counts)}; "
                             f"lower method.params.mean_size (clients with fewer than M samples send none)")
        return {**state, "bank_x": np.concatenate([np.asarray(r.message[MEAN_X]) for r in replies]),
                "bank_y": np.concatenate([np.asarray(r.message[MEAN_Y]) for r in replies]),
                "bank_owner": np.repeat([r.client_id for r in replies], counts)}

    # --- rounds --------------------------------------------------------------------------
    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        """The global weights and the other clients' means."""
        others = state["bank_owner"] != client_id
        return {**state["weights"], MEAN_X: state["bank_x"][others], MEAN_Y: state["bank_y"][others]}

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        bank_x = torch.as_tensor(np.asarray(msg[MEAN_X]), device=ctx.device)
        bank_y = torch.as_tensor(np.asarray(msg[MEAN_Y]), device=ctx.device)
        if len(bank_x) == 0:
            raise ValueError(f"fedmix: client {ctx.client_id} received no other client's means")
        lam = self.params.lam

        def loss_fn(m: nn.Module, inputs: Inputs, y: Tensor) -> Tensor:
            x = images(inputs)
            j = torch.randint(len(bank_x), (len(x),), generator=ctx.generator).to(ctx.device)
            return fedmix_loss(m, ctx.task, x, y, bank_x[j].to(x.dtype), bank_y[j], lam)

        loss = train_local(model, ctx, lr=float(msg["lr"]), loss_fn=loss_fn)
        return weights_reply(model, ctx.num_examples, loss), client_state
