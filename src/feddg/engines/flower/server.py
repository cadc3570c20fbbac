"""The ServerApp side: a Flower ``Strategy`` whose every decision is the feddg :class:`Server`'s.

``run_on_grid(server, grid)`` is the whole server half on any Flower Grid (simulation or
SuperLink):

1. ``query.identify`` to every node until partitions 0..K-1 have all answered (client k is the
   node of partition k); each node's federation fingerprint must equal the server's (same
   config, same data, same partition). With ``flower.roster`` (a secure deployment) client k is
   the node that signs the server's challenge with client k's key; partition ids are ignored and
   unknown, forged and duplicate nodes are refused (one log line each) and never sent anything else.
2. ``query.setup`` to every client, once, if the method has a setup exchange.
3. :class:`FeddgStrategy` ``.start`` for the remaining rounds: ``configure_train`` asks
   ``Server.configure`` for per-client messages, ``aggregate_train`` hands the replies to
   ``Server.receive`` (checks, fold) and closes the round with ``Server.finish_round``
   (aggregation, evaluation, metrics.jsonl, checkpoint). A client's Error reply or a reply missing
   after ``flower.round_timeout_s`` is dropped (``Server.fail``), like a reply that fails the checks;
   each train message tells the client's node the last round whose reply was folded in and kept
   (``commit-round``; not a rolled-back round), so the node keeps only accepted updates' client state, and that
   round as of the last checkpoint (``durable-round``), so a node that keeps the state on disk (``state-dir``)
   keeps what a resume from the checkpoint will ask for (:mod:`feddg.engines.flower.node_state`). With
   ``flower.secure_aggregation: secaggplus`` each round is one call of Flower's SecAgg+ workflow instead
   (:mod:`feddg.engines.flower.secagg_server`): the server receives the round's weighted mean only.

Flower's built-in strategies check that a reply holds exactly one ArrayRecord; feddg replies
carry arrays *and* numbers and text (weights, statistics, Grams, histograms), hence the
subclass. Client-side evaluation is unused: the held-out domains are evaluated on the server,
exactly as in the in-process engine.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.run import Run

from feddg.algorithms.base import Reply
from feddg.config import one_line
from feddg.engines.flower.client import IDENTIFY, KEEPS_STATE, ROUTE, SETUP, TRAIN, fingerprint
from feddg.engines.flower.records import get_message, put_message, record_int
from feddg.engines.flower.routes import Route, client_route, setup_route, train_route
from feddg.engines.flower.secagg_server import run_secure_rounds
from feddg.engines.flower.security import (
    Roster,
    RosterEntry,
    identity_statement,
    key_fingerprint,
    load_public_key,
    verify,
)
from feddg.engines.workers import federation_threads
from feddg.federation.provenance import record_nodes
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped
from feddg.messages import Message as FeddgMessage

RoundCallback = Callable[[dict[str, Any]], None]
#: terminal colour codes (Ray's error reasons carry them)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class PollingGrid(Grid):
    """``grid`` whose ``send_and_receive`` asks for replies every ``interval`` seconds, and gives up when ``stop``
    is set (:class:`RunStopped`).

    Flower 1.41's deployment Grid (``HttpGrid``) waits 3 s between polls, which rounds every exchange
    up to a multiple of 3 s; this one pushes and pulls through the same ``grid``, more often. The simulation sets
    ``stop`` when its main thread is interrupted: Flower's in-memory Grid would wait out the round's timeout in the
    ServerApp's thread, and the process with it (an hour by default).
    """

    def __init__(self, grid: Grid, interval: float = 0.1, stop: threading.Event | None = None) -> None:
        self.grid, self.interval, self.stop = grid, interval, stop or threading.Event()

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``; pull replies until all arrived or ``timeout`` seconds passed (``None``: no limit)."""
        waiting = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            got = list(self.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                break
            if self.stop.wait(self.interval):
                raise RunStopped("interrupted while waiting for the clients' replies")
        return replies


def outgoing(msgs: dict[int, FeddgMessage], nodes: dict[int, int], message_type: str,
             route: Route = client_route) -> dict[int, Message]:
    """One Flower Message per client, addressed to that client's SuperNode, with its ``route``."""
    return {cid: Message(put_message(RecordDict({ROUTE: ConfigRecord(dict(route(cid)))}), msg), nodes[cid], message_type)
            for cid, msg in msgs.items()}


def collect(sent: dict[int, Message], replies: Iterable[Message], timeout: float) -> tuple[list[Reply], dict[int, str]]:
    """The replies as feddg ``Reply`` in the order sent, and why each other client gave none (its ClientApp
    failed, or no reply within ``timeout`` seconds)."""
    by_id = {m.metadata.message_id: cid for cid, m in sent.items()}
    got: dict[int, FeddgMessage] = {}
    failed: dict[int, str] = {}
    for r in replies:
        cid = by_id[r.metadata.reply_to_message_id]
        if r.has_error():
            failed[cid] = one_line(ANSI.sub("", f"node {r.metadata.src_node_id}: {r.error.reason}"))[:300]
            continue
        try:
            got[cid] = get_message(r.content)
        except (KeyError, TypeError, ValueError, MemoryError) as err:  # records that do not decode: this client's failure
            failed[cid] = one_line(f"node {r.metadata.src_node_id}: unreadable reply ({type(err).__name__}: {err})")[:300]
    for cid in sent:
        if cid not in got and cid not in failed:
            failed[cid] = f"no reply within {timeout:g} s (flower.round_timeout_s)"
    return [Reply(cid, got[cid]) for cid in sent if cid in got], failed


class Refused(ValueError):
    """A node that is not, or cannot prove it is, a client of the roster."""


def roster_identity(roster: Roster, reply: Message, challenge: str, nodes: dict[int, int]) -> RosterEntry:
    """The roster entry whose key signed ``reply``'s answer to ``challenge`` (:func:`identity_statement` of the
    challenge, the reply's node id and its federation fingerprint); :class:`Refused` names why there is none."""
    node = reply.metadata.src_node_id
    if reply.has_error():
        raise Refused(f"node {node} failed to identify: {one_line(str(reply.error.reason))[:200]}")
    info = reply.content.config_records.get(ROUTE)
    if info is None or "signature" not in info:
        raise Refused(f"node {node} sent no identity proof (start it with --node-config \"auth-key='KEY'\")")
    if missing := [k for k in ("public-key", "fingerprint") if k not in info]:
        raise Refused(f"node {node}: its identity proof lacks {', '.join(missing)}")
    try:
        key = load_public_key(str(info["public-key"]))
    except ValueError as err:
        raise Refused(f"node {node}: {err}") from None
    entry = roster.by_fingerprint.get(key_fingerprint(key))
    if entry is None:
        raise Refused(f"node {node}: key {key_fingerprint(key)} is not in the roster")
    if not verify(key, identity_statement(challenge, node, str(info["fingerprint"])), str(info["signature"])):
        raise Refused(f"node {node}: forged identity: its signature does not verify with {entry.name}'s key")
    if entry.client in nodes:
        raise Refused(f"node {node}: client {entry.client} ({entry.name}) is already node {nodes[entry.client]}")
    return entry


def declared_partition(reply: Message, k: int, nodes: dict[int, int]) -> int:
    """The partition an insecure node declares (``--node-config partition-id=...``): trusted as it is."""
    node = reply.metadata.src_node_id
    if reply.has_error():
        raise RuntimeError(f"node {node} failed to identify: {reply.error.reason}")
    info = reply.content.config_records[ROUTE]
    p, n = record_int(info["partition-id"]), record_int(info["num-partitions"])
    if n != k or not 0 <= p < k or p in nodes:
        raise RuntimeError(f"node {node} is partition {p} of {n}; want one node per client, partitions 0..{k - 1}")
    return p


def discover_clients(grid: Grid, server: Server, wait_s: float) -> dict[int, int]:
    """``client_id -> node_id``: ask every node who it is until clients 0..K-1 have all answered.

    Without ``flower.roster`` a node is the client of its declared partition; with it, the client whose
    roster key signed the node's answer to a fresh challenge (:func:`roster_identity`). One SuperNode per
    client: Flower runs a node's messages with copies of one Context, so two clients on one node could
    overwrite each other's state.
    """
    want, k = fingerprint(server.fed), len(server.fed.clients)
    roster_path = server.fed.cfg.flower.roster
    roster = Roster.load(Path(roster_path), k) if roster_path else None
    deadline = time.monotonic() + wait_s
    nodes: dict[int, int] = {}
    refused: dict[int, str] = {}
    challenges: dict[int, str] = {}
    who: dict[int, dict[str, Any]] = {}  # per client: its node and how it was identified (provenance.json)
    while len(nodes) < k:
        new = [n for n in grid.get_node_ids() if n not in nodes.values() and n not in refused]
        msgs = []
        for n in new:
            route = ConfigRecord({"node-id": n})
            if roster is not None:
                route["challenge"] = challenges[n] = secrets.token_hex(32)
            msgs.append(Message(RecordDict({ROUTE: route}), n, IDENTIFY))
        for r in grid.send_and_receive(msgs, timeout=max(deadline - time.monotonic(), 1.0)) if msgs else []:
            node = r.metadata.src_node_id
            if roster is None:
                p = declared_partition(r, k, nodes)
                identity: dict[str, Any] = {"by": "declared partition"}
            else:
                try:
                    entry = roster_identity(roster, r, challenges[node], nodes)
                except Refused as why:
                    refused[node] = str(why)
                    log(WARNING, "feddg: refused %s", why)
                    continue
                p, identity = entry.client, {"by": "roster key", "name": entry.name,
                                             "key": roster.fingerprint_of(entry)}
            if r.content.config_records[ROUTE]["fingerprint"] != want:
                raise RuntimeError(f"node {node} (client {p}) built a different federation: same config and data?")
            nodes[p] = node
            who[p] = {"node": node, **identity,
                      "state_dir": bool(r.content.config_records[ROUTE].get(KEEPS_STATE, False))}
        if len(nodes) < k:
            if time.monotonic() > deadline:
                missing = sorted(set(range(k)) - set(nodes))
                raise TimeoutError(f"clients {missing} did not connect within flower.node_wait_s={wait_s}"
                                   + (f"; refused {len(refused)} node(s): {'; '.join(refused.values())}" if refused else ""))
            time.sleep(0.5)
    log(INFO, "feddg: %d clients on %d SuperNodes%s", k, k, " (identified by the roster)" if roster else "")
    record_nodes(server.run_dir, server.round, who, list(refused.values()))
    forgetful = [cid for cid in sorted(who) if not who[cid]["state_dir"]]  # their nodes keep state in memory only
    if 0 < server.round < server.rounds and forgetful:
        log(WARNING, "feddg: resumed after round %d: the nodes of clients %s keep no state-dir, so what %s's clients "
            "keep between rounds (e.g. SCAFFOLD's control variates, FedBN's own BN) starts empty on them; a method "
            "that keeps none continues as an uninterrupted run would (docs/flower.md, 'Where client state lives')",
            server.round, compact_ids(forgetful), server.fed.cfg.method.name)
    return nodes


def compact_ids(ids: list[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7]."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def run_setup(server: Server, grid: Grid, nodes: dict[int, int], timeout: float) -> None:
    """The method's one-time setup exchange with every client, as ``query.setup`` messages."""
    request = server.setup_request()
    if request is None:
        server.mark_setup_done()
        return
    sent = outgoing({cid: request for cid in nodes}, nodes, SETUP, setup_route(server))
    replies, failed = collect(sent, grid.send_and_receive(list(sent.values()), timeout=timeout), timeout)
    if failed:  # the setup exchange needs every client
        raise RunStopped("setup exchange: " + "; ".join(f"client {cid}: {why}" for cid, why in sorted(failed.items())))
    server.finish_setup(replies)


def round_metrics(row: dict[str, Any]) -> MetricRecord:
    """The numbers of a metrics.jsonl row as Flower's MetricRecord, which refuses bools: ``rolled_back`` becomes 1."""
    return MetricRecord({k: int(v) if isinstance(v, bool) else v for k, v in row.items() if isinstance(v, (int, float))})


class FeddgStrategy(Strategy):
    """Delegates every round to ``server``; Flower's round r is feddg round ``server.round + r``."""

    def __init__(self, server: Server, nodes: dict[int, int], on_round: RoundCallback | None = None) -> None:
        self.server, self.nodes, self.on_round = server, nodes, on_round
        self.offset = server.round
        self.timeout = server.fed.cfg.flower.round_timeout_s
        self._sent: dict[int, FeddgMessage] = {}
        self._out: dict[int, Message] = {}
        self._t0 = 0.0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._t0 = time.perf_counter()
        self._sent = self.server.configure(server_round + self.offset)
        self._out = outgoing(self._sent, self.nodes, TRAIN, train_route(self.server))
        return list(self._out.values())

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Fold the round's replies in the order sent (Flower hands them over together); failed, late and
        unusable ones are dropped by the server."""
        round = server_round + self.offset
        fold = self.server.start_round(self._sent)
        got, failed = collect(self._out, replies, self.timeout)
        for cid, why in failed.items():
            self.server.fail(fold, cid, why)
        for reply in got:
            self.server.receive(fold, reply)
        timings = {"time_train_s": time.perf_counter() - self._t0}
        row = self.server.finish_round(round, fold, timings)  # commits the accepted clients' round (not rolled back)
        if self.on_round is not None:
            self.on_round(row)
        return None, round_metrics(row)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # evaluation runs in Server.finish_round, on the server's held-out domains

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        fed = self.server.fed
        log(INFO, "\t├── feddg method: %s, %d clients", fed.method.name, len(fed.clients))
        log(INFO, "\t└── rounds %d..%d", self.offset + 1, self.server.rounds)


def run_on_grid(server: Server, grid: Grid, on_round: RoundCallback | None = None) -> dict[str, Any]:
    """Identify nodes, run the setup exchange and the remaining rounds; returns results.json's content. The server's
    own work (aggregation, evaluation) runs under ``federation.threads``, as in-process (``auto``: one torch thread
    and one BLAS thread, so nothing of the server's spins beside the SuperNodes of a shared machine)."""
    fc = server.fed.cfg.flower
    with federation_threads(server.fed.cfg.federation.threads, server.fed.device):
        nodes = discover_clients(grid, server, fc.node_wait_s)
        run_setup(server, grid, nodes, fc.round_timeout_s)
        if fc.secure_aggregation == "secaggplus":  # Flower's legacy SecAgg+ workflow, one call per round
            run_secure_rounds(server, grid, nodes, on_round)
        elif server.round < server.rounds:
            FeddgStrategy(server, nodes, on_round).start(
                grid, ArrayRecord(), num_rounds=server.rounds - server.round, timeout=fc.round_timeout_s
            )
        return server.write_results()
