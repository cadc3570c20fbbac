"""The method API: a server half and a client half that talk only through messages.

An engine (the in-process simulator, or Flower) drives a :class:`Method` like this::

    state = method.server_init(model, server_ctx)
    [optional, once] request = method.setup_request(state)
                     replies = [method.client_setup(model, request, cstate_k, ctx_k) ...]
                     state   = method.server_setup(state, replies)
    for each round:
        for each sampled client k:
            msg            = method.client_config(state, k, round)      # server -> client
            reply, cstate_k = method.client_update(model, msg, cstate_k, ctx_k)  # client -> server
        state = method.aggregate(state, replies)
    weights = method.eval_weights(state, client_id)                      # global or personal

``ServerState`` is the method's own picklable dict (it never leaves the server); a
``ClientState`` is a :data:`~feddg.messages.Message` that never leaves its client (FedFA's
momentum statistics, FedSR's reference distribution, ...). The engine stores both and
checkpoints them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from feddg.aggregation.mean import weighted_mean_messages
from feddg.data.base import DomainDataset, iterate_batches
from feddg.messages import WEIGHT_PREFIX, Message, weights_of

ServerState = dict[str, Any]
ClientState = Message


class Params(BaseModel):
    """Base of every method's hyper-parameters: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class OptimSettings:
    """Client optimiser settings; the learning rate itself arrives in each round's message."""

    name: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4


@dataclass
class ClientContext:
    """What a client may touch during its update: its own data and its own random stream."""

    client_id: int
    round: int
    dataset: DomainDataset
    train_idx: np.ndarray
    batch_size: int
    local_epochs: int
    optim: OptimSettings
    generator: torch.Generator
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def num_examples(self) -> int:
        return int(len(self.train_idx))

    def batches(self, *, shuffle: bool = True, train: bool = True) -> Iterator[tuple[Tensor, Tensor]]:
        """One pass over the client's training data, on the client's device."""
        for x, y in iterate_batches(
            self.dataset, self.train_idx, self.batch_size, shuffle=shuffle, train=train, generator=self.generator
        ):
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


@dataclass(frozen=True)
class ServerContext:
    """Public facts the server knows when it starts."""

    num_clients: int
    rounds: int
    num_classes: int
    seed: int


@dataclass(frozen=True)
class Reply:
    """One client's answer, tagged with who sent it."""

    client_id: int
    message: Message

    @property
    def num_examples(self) -> int:
        return int(self.message["num_examples"])


class Method(ABC):
    """Base class of every federated method (see the module docstring for the protocol)."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]] = Params
    #: hyper-parameter search ranges, DomainBed style: name -> candidate values
    search_space: ClassVar[dict[str, list[Any]]] = {}
    #: True when ``eval_weights`` differs per client
    personalized: ClassVar[bool] = False

    def __init__(self, params: Params | None = None) -> None:
        self.params = params if params is not None else type(self).Params()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The network this method trains, built from a zoo model (FedSR wraps it, FedFA adds layers)."""
        return model

    # --- server half -------------------------------------------------------------------
    def server_init(self, model: nn.Module, ctx: ServerContext) -> ServerState:
        """Initial server state: the global weights of ``model``."""
        return {"weights": weights_of(model)}

    def client_config(self, state: ServerState, client_id: int, round: int) -> Message:
        """What client ``client_id`` receives in ``round`` (default: the global weights)."""
        return dict(state["weights"])

    def aggregate(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """Default: FedAvg — weights averaged with ``num_examples`` weights."""
        weights = weighted_mean_messages([r.message for r in replies], [r.num_examples for r in replies], WEIGHT_PREFIX)
        return {**state, "weights": weights}

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        """Diagnostics of the last aggregation (alignment cost, timings, bytes per tier...) for metrics.jsonl."""
        return {}

    def eval_weights(self, state: ServerState, client_id: int | None = None) -> Message:
        """Weights to evaluate: global (``client_id=None``) or personalised for a client."""
        return state["weights"]

    # --- client half -------------------------------------------------------------------
    @abstractmethod
    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """Local training; returns the reply (must contain ``num_examples``) and the new client state."""

    def predict(self, model: nn.Module, x: Tensor) -> Tensor:
        """Logits used for evaluation (FedSR overrides it with Monte-Carlo averaging)."""
        return model(x)

    # --- optional one-time setup exchange (PARDON's style upload, ...) -------------------
    def setup_request(self, state: ServerState) -> Message | None:
        """A message sent once to *every* client before round 1, or ``None`` for no setup."""
        return None

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        raise NotImplementedError(f"{self.name} asked for a setup exchange but has no client_setup")

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        raise NotImplementedError(f"{self.name} asked for a setup exchange but has no server_setup")
