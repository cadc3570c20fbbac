"""A test method that injects client faults, and the toy federation factory that worker processes and
Flower's ClientApps import by module path (importing this module registers the method there too).
Import it inside a test, under :func:`registered`, never at a test module's top."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import toy
from pydantic import Field

from feddg.algorithms.base import ClientContext, ClientState, Params
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.registry import METHODS
from feddg.config import ExperimentConfig
from feddg.federation.setup import Federation
from feddg.messages import Message


class FaultyParams(Params):
    #: ``"round:client"`` -> raise | nan | sleep | kill | scale | oversized
    faults: dict[str, str] = Field(default_factory=dict)
    sleep_s: float = 60.0
    blob_mb: float = 100.0  # oversized: the size of the extra array


class Faulty(FedAvg):
    """FedAvg whose client ``k`` misbehaves in the rounds ``params.faults`` names."""

    name = "faulty"
    Params = FaultyParams

    def client_update(
        self, model: torch.nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        fault = self.params.faults.get(f"{ctx.round}:{ctx.client_id}")
        if fault == "raise":
            raise RuntimeError(f"injected failure of client {ctx.client_id}")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "sleep":
            time.sleep(self.params.sleep_s)
        reply, state = super().client_update(model, msg, client_state, ctx)
        state = {"updates": int(client_state.get("updates", 0)) + 1}  # a client state to check it is not advanced
        if fault == "nan":
            key = next(k for k, v in reply.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f")
            reply[key] = np.full_like(reply[key], np.nan)
        if fault == "scale":
            reply = {k: v * 30 if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v for k, v in reply.items()}
        if fault == "oversized":
            reply["w/blob"] = np.zeros(int(self.params.blob_mb * 2**20) // 4, np.float32)
        return reply, state


METHODS.setdefault(Faulty.name, Faulty)  # on import: how spawned workers and Ray actors learn the method


@contextmanager
def registered() -> Iterator[None]:
    """``faulty`` in the test process's registry for the duration only: other tests enumerate the registry."""
    METHODS[Faulty.name] = Faulty
    try:
        yield
    finally:
        METHODS.pop(Faulty.name, None)


def toy_federation_of(cfg: ExperimentConfig) -> Federation:
    """:func:`toy.toy_federation_of` by this module's path: workers and ClientApps that unpickle it import this
    module, which registers ``faulty`` there."""
    return toy.toy_federation_of(cfg)


def broken_federation(cfg: ExperimentConfig) -> Federation:
    """A factory that fails in the worker, as a missing dataset would."""
    raise FileNotFoundError(f"no dataset for {cfg.name} on this worker")
