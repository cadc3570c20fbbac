"""The method API: a server half and a client half that talk only through messages.

An engine (through the server's topology) drives a :class:`Method` like this::

    state = method.server_init(model, server_ctx)
    [optional, once] request = method.setup_request(state)
                     replies = [method.client_setup(model, request, cstate_k, ctx_k) ...]
                     state   = method.server_setup(state, replies)
    for each round:
        acc = method.start(expected_examples)        # the sampled clients' example counts, summed
        for each sampled client k, as its reply arrives:
            msg             = method.client_config(state, k, round)                 # server -> client
            reply, cstate_k = method.client_update(model, msg, cstate_k, ctx_k)     # client -> server
            acc             = method.accumulate(acc, Reply(k, reply))              # fold it in
        state, metrics = method.finish(state, acc)
    weights = method.eval_weights(state, client_id)                                  # global or personal

Aggregation is a fold: by default the accumulator is one running ``num_examples``-weighted sum of
the weights (FedAvg), so the server holds O(model), not O(clients × model), during a round. What a
method needs of each reply beyond that sum it names in :meth:`Method.keep` (small payloads:
FedFA's statistics, FPL's prototypes); methods that need every reply whole (hFedF's hypernetwork
step) keep them and say so. What it reads beside the ``w/`` arrays it declares in
:meth:`Method.reply_layout`: the server checks every reply against it before the fold.

``ServerState`` is the method's own picklable dict (it never leaves the server); a
``ClientState`` is a :data:`~feddg.messages.Message` that never leaves its client (FedFA's
momentum statistics, FedSR's reference distribution, ...). The engine stores both and
checkpoints them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import ConfigDict
from torch import Tensor, nn

from feddg.aggregation.mean import WeightedSum
from feddg.data.base import DomainDataset, iterate_batches
from feddg.devices import Inputs, autocast, to_device
from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, weights_of
from feddg.settings import Settings
from feddg.tasks import Task

ServerState = dict[str, Any]
ClientState = Message
Metrics = dict[str, float]


class Params(Settings):
    """Base of every method's hyper-parameters: unknown keys are errors, and a boolean is not a number."""

    model_config = ConfigDict(frozen=True)  # and Settings's extra="forbid"


@dataclass(frozen=True)
class OptimSettings:
    """Client optimiser settings; the learning rate itself arrives in each round's message."""

    name: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    grad_clip: float | None = None  # global L2 norm of each step's gradient (None: no clipping)
    amp: str = "off"  # autocast dtype of the forward passes: off | bf16 | fp16 (ClientContext.autocast)
    channels_last: bool = False  # image batches in torch.channels_last memory format
    augment: tuple[dict[str, Any], ...] = ()  # optim.augment: local augmentations (components/augment.py)


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
    #: the dataset's task: ``ctx.task.loss(output, target)`` is the training loss of every method
    task: Task
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: the stream of the DP noise of a release (``dp_noise: secret``: keyed by the federation's secret
    #: ``noise_key``); ``None``: :attr:`generator` (``seeded``)
    dp_generator: torch.Generator | None = None

    @property
    def num_examples(self) -> int:
        return len(self.train_idx)

    @property
    def noise(self) -> torch.Generator:
        """Where a method draws the DP noise of what it releases (never the training stream when it is secret)."""
        return self.generator if self.dp_generator is None else self.dp_generator

    def batches(self, *, shuffle: bool = True, train: bool = True) -> Iterator[tuple[Inputs, Tensor]]:
        """One pass over the client's training data, on the client's device."""
        for x, y in iterate_batches(
            self.dataset, self.train_idx, self.batch_size, shuffle=shuffle, train=train, generator=self.generator
        ):
            yield to_device(x, self.device, self.optim.channels_last), y.to(self.device, non_blocking=True)

    def autocast(self) -> torch.autocast:
        """The configured mixed precision (``optim.amp``) for a forward pass; a no-op when it is off."""
        return autocast(self.device, self.optim.amp)


def in_memory(name: str) -> MutableMapping[int, Message]:
    """A per-client table held in a plain dict (``ServerContext.per_client`` outside a server)."""
    return {}


@dataclass(frozen=True)
class ServerContext:
    """Public facts the server knows when it starts, and where per-client server state is kept."""

    num_clients: int
    rounds: int
    seed: int
    #: a new ``client id -> Message`` table, by name, for per-client server state (models, statistics): the
    #: server gives a store that spills to disk past ``federation.client_state_budget_mb``; update it in place
    per_client: Callable[[str], MutableMapping[int, Message]] = in_memory
    #: one input of the dataset (a batch of one, on the model's device), for a method that must know its model's
    #: activation shapes before the first reply (FedFA's statistics); ``None`` where the server has none
    example: Inputs | None = None


@dataclass(frozen=True)
class Reply:
    """One client's answer, tagged with who sent it."""

    client_id: int
    message: Message

    @property
    def num_examples(self) -> int:
        return int(self.message["num_examples"])


@dataclass
class Accumulator:
    """One round's fold: the running weighted sum of the weights (``None`` for methods that do not
    average them) and what :meth:`Method.keep` kept of each reply, in arrival order."""

    weights: WeightedSum | None
    kept: list[Reply] = field(default_factory=list)
    #: further running sums a method folds in (FedIIR's gradient sums), by prefix
    sums: dict[str, WeightedSum] = field(default_factory=dict)


def weights_reply(model: nn.Module, num_examples: int, train_loss: float, **extra: Any) -> Message:
    """The usual client reply: all weights, ``num_examples`` (FedAvg's weight) and ``train_loss``."""
    return {**weights_of(model), "num_examples": num_examples, "train_loss": train_loss, **extra}


class Method(ABC):
    """Base class of every federated method (see the module docstring for the protocol)."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]] = Params
    #: hyper-parameter search ranges, DomainBed style: name -> candidate values (``feddg sweep``'s ``search:``)
    search_space: ClassVar[dict[str, list[Any]]] = {}
    #: False for methods whose server does not average the clients' weights (hypernetworks, local-only)
    averages_weights: ClassVar[bool] = True
    #: True when ``eval_weights`` differs per client
    personalized: ClassVar[bool] = False
    #: hierarchical methods (MTGC, FedRC) run only on a station topology whose merge is one of these
    station_merges: ClassVar[tuple[str, ...]] = ()
    #: True when the formulas are feddg's reconstruction, not a paper's (FedRC): listed, tabled and reported with
    #: " (reconstructed)" after the name (registry.method_label)
    reconstructed: ClassVar[bool] = False
    #: what the method needs of the task's batches and of the model (``feddg.tasks`` capabilities: images,
    #: class_labels, conv_stages, batchnorm, ...); a config that cannot serve it is refused at load
    requires: ClassVar[frozenset[str]] = frozenset()
    #: True when the server state depends on ``federation.rounds`` (FedDG-GA's step decay): a resume cannot grow it
    rounds_in_state: ClassVar[bool] = False
    #: False when the loss uses the labels beyond the task's loss (class-conditional terms, class prototypes):
    #: label-mixing augmentations, whose targets are soft, are refused with it
    takes_soft_targets: ClassVar[bool] = True

    @classmethod
    def requirements(cls, params: Params) -> frozenset[str]:  # type: ignore[valid-type]  # base of every Params
        """What this configuration of the method needs (default: :attr:`requires`)."""
        return cls.requires

    @classmethod
    def optim_problem(cls, params: Params, optim_name: str, momentum: float) -> str | None:  # type: ignore[valid-type]
        """Why this configuration of the method cannot train with the local optimiser, or ``None`` (the default)."""
        return None

    def __init__(self, params: Params | None = None) -> None:  # type: ignore[valid-type]  # base of every Params
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

    def reply_layout(self, model: nn.Module, sent: Message, weights: Shapes) -> Layout:
        """What the server reads of a reply to ``sent`` beside its ``w/`` arrays; a reply that differs is refused
        before it is folded (docs/reliability.md). ``model`` is the server's network, ``weights`` its ``w/`` shapes
        and dtypes. Default: nothing (every array beside ``w/`` is refused)."""
        return {}

    def keep(self, reply: Reply) -> Message | None:
        """What the server keeps of ``reply`` until :meth:`finish`, beyond the running sum (default: nothing)."""
        return None

    def start(self, expected_examples: float) -> Accumulator:
        """An empty round; ``expected_examples`` (Σ of the sampled clients' ``num_examples``) normalises
        the running sum as FedAvg's formula does (see :class:`~feddg.aggregation.mean.WeightedSum`)."""
        return Accumulator(WeightedSum(WEIGHT_PREFIX, expected_examples) if self.averages_weights else None)

    def accumulate(self, acc: Accumulator, reply: Reply) -> Accumulator:
        """Fold one reply into the round."""
        if acc.weights is not None:
            acc.weights.add(reply.message, reply.num_examples)
        kept = self.keep(reply)
        if kept is not None:
            acc.kept.append(Reply(reply.client_id, kept))
        return acc

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """The new server state and this round's diagnostics (default: FedAvg, no diagnostics)."""
        assert acc.weights is not None, f"{self.name} does not average weights: it must override finish"
        return {**state, "weights": acc.weights.mean()}, {}

    def aggregate(self, state: ServerState, replies: list[Reply]) -> tuple[ServerState, Metrics]:
        """A whole round at once: the fold over ``replies``, then :meth:`finish`."""
        if not replies:
            raise ValueError(f"{self.name}: a round needs at least one reply")
        acc = self.start(sum(r.num_examples for r in replies))
        for r in replies:
            acc = self.accumulate(acc, r)
        return self.finish(state, acc)

    def station_init(self, station: ServerState, members: list[int]) -> ServerState:
        """A station's initial state, told which clients it serves (station topology only; default: as is)."""
        return station

    def station_weight(self, station: ServerState, active_clients: int) -> float:
        """The station's weight in the server merge (station topology only; default: γ_e, its active clients,
        HFedATM eq. 7)."""
        return float(active_clients)

    def station_merged(self, station: ServerState, merged: Message) -> ServerState:
        """A station's state after the server merged the stations into ``merged`` (station topology only):
        by default every station restarts from the merged model."""
        return {**station, "weights": merged}

    def eval_weights(self, state: ServerState, client_id: int | None = None) -> Message:
        """Weights to evaluate: global (``client_id=None``) or personalised for a client."""
        return state["weights"]

    def privacy(self, rounds_done: int) -> dict[str, Any] | None:
        """results.json's ``privacy`` after ``rounds_done`` rounds: the run's ε of the statistics this method
        shares under DP (``docs/privacy.md``), or ``None`` when it shares none under DP (default)."""
        return None

    # --- client half -------------------------------------------------------------------
    @abstractmethod
    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """Local training; returns the reply (must contain ``num_examples``) and the new client state."""

    def predict(self, model: nn.Module, x: Inputs) -> Tensor:
        """The output that evaluation scores (FedSR overrides it with Monte-Carlo averaging)."""
        return model(x)

    # --- optional one-time setup exchange (PARDON's style upload, ...) -------------------
    def setup_request(self, state: ServerState) -> Message | None:
        """A message sent once to *every* client before round 1, or ``None`` for no setup."""
        return None

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        """What :meth:`server_setup` reads of each client's reply to ``request`` (as :meth:`reply_layout`; a -1 size
        may differ from the other clients' only in the first dimension); a reply that differs stops the run in one
        line. Default: nothing."""
        return {}

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        raise NotImplementedError(f"{self.name} asked for a setup exchange but has no client_setup")

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        raise NotImplementedError(f"{self.name} asked for a setup exchange but has no server_setup")
