"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

Control variates correct the client drift: the server keeps ``c``, each client ``i`` its own ``c_i``
(client state, persisted and checkpointed; zero at first). Algorithm 1, with local learning rate ``η``,
``K`` local steps from the global model ``x``, server learning rate ``η_g``, ``N`` clients, ``S`` sampled:

    y   ← y − η (g_i(y) − c_i + c)                                   (every local step)
    c_i⁺ = c_i − c + (x − y) / (K η)                                  (option II; ``control: option2``)
    c_i⁺ = ∇f_i(x)                                                    (option I; ``control: option1``)
    x   ← x + η_g · Σ_{i∈S} (n_i / n_S) (y_i − x)                     (trainable parameters)
    c   ← c + (1/N) Σ_{i∈S} (c_i⁺ − c_i)                              (= c + |S|/N · mean Δc)

The paper averages ``Δy`` uniformly over ``S``; here by ``n_i`` as FedAvg does (the same for equal-size
clients), so that at ``c = c_i = 0`` and ``η_g = 1`` the first round is FedAvg's. Buffers (BatchNorm
statistics) are FedAvg-averaged. Option II recovers the mean corrected gradient only for plain SGD steps:
with momentum or Adam it is refused (use option I, one extra gradient pass at ``x`` over the client's data,
valid under any optimiser). ``g`` includes the optimiser's weight decay (an L2 term), so option I adds it too.
The server folds running sums of the weights and of ``Δc``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

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
from feddg.algorithms.components.local import LossFn, gradient_batches, task_loss, train_steps
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, like_slot, load_weights, weights_of

CONTROL = "c/"  # server -> client: c per trainable parameter
DELTA = "dc/"  # client -> server: Δc_i = c_i⁺ − c_i
OWN = "ci/"  # client state: c_i


class ScaffoldParams(Params):
    server_lr: float = Field(1.0, gt=0.0, description="η_g, the server learning rate")
    control: Literal["option2", "option1"] = Field(
        "option2", description="c_i⁺: option2 = c_i − c + (x − y)/(Kη) (plain SGD only), option1 = ∇f_i(x)"
    )


def option2(ci: np.ndarray, c: np.ndarray, x: np.ndarray, y: np.ndarray, steps: int, lr: float) -> np.ndarray:
    """``c_i⁺ = c_i − c + (x − y) / (K η)``."""
    return (ci - c + (x.astype(np.float64) - y) / (steps * lr)).astype(ci.dtype)


def corrected_training(model: nn.Module, ctx: ClientContext, lr: float, correction: list[Tensor],
                       loss_fn: LossFn | None = None) -> tuple[float, int]:
    """``train_local`` with each parameter's gradient ``g`` replaced by ``g + correction`` (``= g − c_i + c``), added
    to the unscaled gradient (under ``optim.amp: fp16`` too); returns the mean loss and ``K``, the optimiser steps
    taken (a step fp16 skipped moved nothing, so it is not one of them)."""
    params = list(model.parameters())

    def correct() -> None:
        for p, d in zip(params, correction, strict=True):
            if p.grad is not None:
                p.grad.add_(d)

    return train_steps(model, ctx, lr, loss_fn, edit_grads=correct)


def full_gradient(model: nn.Module, ctx: ClientContext, loss_fn: LossFn | None = None) -> list[np.ndarray] | None:
    """``∇f_i(x)``: the gradient of the client's mean loss over the data it trains on (train mode as in training,
    in order, no augmentation, a single-sample batch skipped under BatchNorm as training skips it; BatchNorm
    statistics restored after) plus the optimiser's L2 term ``wd · x``; ``None`` when no batch is left."""
    params = list(model.parameters())
    objective = loss_fn or task_loss(ctx)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    total = [torch.zeros_like(p) for p in params]
    samples = 0
    model.train()
    for x, y in gradient_batches(model, ctx):
        grads = torch.autograd.grad(objective(model, x, y) * len(y), params)
        total = [t + g for t, g in zip(total, grads, strict=True)]
        samples += len(y)
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    if samples == 0:
        return None
    wd = ctx.optim.weight_decay
    return [(t / samples + wd * p.detach()).cpu().numpy() for t, p in zip(total, params, strict=True)]


class Scaffold(Method):
    """Drift-corrected local SGD; the server updates the global model and its control variate."""

    name = "scaffold"
    Params = ScaffoldParams
    params: ScaffoldParams
    search_space: ClassVar[dict[str, list[Any]]] = {"server_lr": [0.5, 1.0]}
    loss_fn: LossFn | None = None  # the local objective f_i: the task's loss (tests swap in a quadratic)


    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        control = {n: np.zeros_like(p.detach().cpu().numpy()) for n, p in model.named_parameters()}
        return {"weights": weights_of(model), "control": control, "num_clients": ctx.num_clients}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        return {**state["weights"], **{CONTROL + n: v for n, v in state["control"].items()}}

    @classmethod
    def optim_problem(cls, params: Any, optim_name: str, momentum: float) -> str | None:
        if params.control == "option2" and (optim_name != "sgd" or momentum != 0):
            return ("SCAFFOLD option II assumes plain SGD local steps: set optim.name=sgd and optim.momentum=0, "
                    "or method.params.control=option1")
        return None

    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        if problem := self.optim_problem(self.params, ctx.optim.name, ctx.optim.momentum):
            raise ValueError(problem)
        load_weights(model, msg)
        lr = float(msg["lr"])
        names = [n for n, _ in model.named_parameters()]
        c = [np.asarray(msg[CONTROL + n]) for n in names]
        ci = [np.asarray(client_state.get(OWN + n, np.zeros_like(v))) for n, v in zip(names, c, strict=True)]
        x = [np.asarray(msg[WEIGHT_PREFIX + n]) for n in names]
        grad_x = full_gradient(model, ctx, self.loss_fn) if self.params.control == "option1" else None
        correction = [torch.from_numpy(cc - cic).to(ctx.device) for cc, cic in zip(c, ci, strict=True)]
        loss, steps = corrected_training(model, ctx, lr, correction, self.loss_fn)
        reply = weights_reply(model, ctx.num_examples, loss)
        if self.params.control == "option1":
            new = ci if grad_x is None else [g.astype(v.dtype) for g, v in zip(grad_x, ci, strict=True)]
        elif steps == 0:  # no local step (fp16 skipped every one): nothing to estimate
            new = ci
        else:
            new = [option2(cic, cc, xx, np.asarray(reply[WEIGHT_PREFIX + n]), steps, lr)
                   for n, cic, cc, xx in zip(names, ci, c, x, strict=True)]
        delta = {DELTA + n: nv - cic for n, nv, cic in zip(names, new, ci, strict=True)}
        return {**reply, **delta}, {OWN + n: nv for n, nv in zip(names, new, strict=True)}

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """Δc_i per trainable parameter, as the control c sent."""
        return {DELTA + k[len(CONTROL) :]: like_slot(v) for k, v in sent.items() if k.startswith(CONTROL)}

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        """FedAvg's running sum of the weights, plus the running ``Σ_{i∈S} Δc_i``."""
        acc = super().accumulate(acc, reply)
        acc.sums.setdefault(DELTA, WeightedSum(DELTA)).add(reply.message, 1.0)
        return acc

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        assert acc.weights is not None
        mean, old, eta = acc.weights.mean(), state["weights"], self.params.server_lr
        new = dict(mean)
        for n in state["control"]:
            k = WEIGHT_PREFIX + n  # x + η_g (ȳ − x), written as ȳ + (η_g − 1)(ȳ − x): exactly ȳ at η_g = 1
            new[k] = (mean[k] + (eta - 1.0) * (mean[k].astype(np.float64) - old[k])).astype(old[k].dtype)
        sums, n_all = acc.sums[DELTA].sums, int(state["num_clients"])
        control = {n: (c + sums[DELTA + n] / n_all).astype(c.dtype) for n, c in state["control"].items()}
        norm = float(np.sqrt(sum(float((c.astype(np.float64) ** 2).sum()) for c in control.values())))
        return {**state, "weights": new, "control": control}, {"scaffold/c_norm": norm}
