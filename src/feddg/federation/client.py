"""The client half as any engine runs it: seed, build the context, call the method, check the reply."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from feddg.algorithms.base import ClientContext
from feddg.federation.rounds import client_generator
from feddg.federation.setup import Federation
from feddg.messages import Message, validate_message
from feddg.seeds import derived_seed


def seed_torch(seed: int, device: torch.device) -> None:
    """``torch.manual_seed(seed)`` for a run on ``device``: the same streams, without its ~1.4 ms per call of
    seeding (lazily) every accelerator backend torch knows, which a CPU run never uses."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def client_context(fed: Federation, client_id: int, round: int) -> ClientContext:
    """Context of ``client_id`` in ``round``; its random stream depends only on (seed, round, id)."""
    cfg = fed.cfg
    seed_torch(derived_seed(cfg.seed, round, client_id, 1), fed.device)  # dropout, noise in the method
    return ClientContext(
        client_id=client_id,
        round=round,
        dataset=fed.dataset,
        train_idx=fed.clients[client_id].train_idx,
        batch_size=cfg.federation.batch_size,
        local_epochs=cfg.federation.local_epochs,
        optim=fed.optim,
        generator=client_generator(cfg.seed, round, client_id),
        task=fed.task,
        device=fed.device,
        dp_generator=None if cfg.dp_noise == "seeded" else client_generator(fed.noise_key, round, client_id),
    )


def run_client(
    fed: Federation, client_id: int, round: int, msg: Message, client_state: Message
) -> tuple[Message, Message]:
    """One client update; the reply and the new client state are checked against the contract."""
    ctx = client_context(fed, client_id, round)
    reply, new_state = fed.topology.client_update(fed.method, fed.model, msg, client_state, ctx)
    validate_message(reply, f"reply of client {client_id}")
    validate_message(new_state, f"state of client {client_id}")
    if "num_examples" not in reply:
        raise KeyError(f"{fed.method.name}: a client reply must contain 'num_examples'")
    return reply, new_state


@dataclass(frozen=True)
class Outcome:
    """One client update as an engine hands it to the server: the reply and new state, or why there is none."""

    reply: Message | None = None
    state: Message | None = None
    error: str | None = None


def describe(err: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception on one line, at most ``limit`` characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def try_client(fed: Federation, client_id: int, round: int, msg: Message, client_state: Message) -> Outcome:
    """:func:`run_client`, with an exception of the client turned into a failed :class:`Outcome`."""
    try:
        reply, new_state = run_client(fed, client_id, round, msg, client_state)
    except Exception as err:
        return Outcome(error=describe(err))
    return Outcome(reply, new_state)


def run_client_setup(
    fed: Federation, client_id: int, msg: Message, client_state: Message
) -> tuple[Message, Message]:
    """The one-time setup exchange of ``client_id`` (round 0)."""
    ctx = client_context(fed, client_id, 0)
    reply, new_state = fed.method.client_setup(fed.model, msg, client_state, ctx)
    validate_message(reply, f"setup reply of client {client_id}")
    validate_message(new_state, f"state of client {client_id}")
    return reply, new_state
