"""What each ServerApp message tells the node beside its payload (its ``route`` ConfigRecord; SecAgg+'s FitIns
carries the same keys): which client it is for and, for setup and training, which client state the node is to use
(:mod:`feddg.engines.flower.client`, :mod:`feddg.engines.flower.node_state`)."""

from __future__ import annotations

from collections.abc import Callable

from feddg.engines.flower.client import COMMIT
from feddg.engines.flower.node_state import DURABLE, RUN_KEY
from feddg.federation.server import Server

Route = Callable[[int], dict[str, int | str]]


def client_route(cid: int) -> dict[str, int | str]:
    return {"client-id": cid}


def setup_route(server: Server) -> Route:
    """A setup message's route: the client, and the run's key (a node keeps the state it sets up under it)."""
    return lambda cid: {"client-id": cid, RUN_KEY: server.run_key}


def train_route(server: Server) -> Route:
    """A train message's route: the client, the last round whose reply the server folded in and kept (its node
    then uses the client state of that round), that round as of the last checkpoint, and the run's key."""
    return lambda cid: {"client-id": cid, COMMIT: server.commits.get(cid, 0),
                        DURABLE: server.saved_commits.get(cid, 0), RUN_KEY: server.run_key}
