"""Unit tests of the ClientApp's node side, called directly with hand-built Contexts and Messages: the federation
fingerprint and cache, the node's partition and thread count, and the identify, setup and train handlers' routing and
client-state commit rule (``run_client`` and ``run_client_setup`` stubbed, so no model trains)."""

import hashlib
import logging
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.compat.common import recorddict_compat as compat
from support.flower_messages import pushed
from test_flower import toy_config
from toy import toy_federation_of

from feddg.config import build_config, dump_config
from feddg.engines.flower import client as flower_client
from feddg.engines.flower.client import (
    IDENTIFY,
    ROUTE,
    SETUP,
    TRAIN,
    client_federation,
    fingerprint,
    make_client_app,
    node_federation,
    node_partition,
    node_threads,
)
from feddg.engines.flower.records import get_message, put_message
from feddg.engines.flower.secagg import to_fitins
from feddg.messages import Message as FeddgMessage


def node_context(partition: int = 0, **node_config: Any) -> Context:
    return Context(run_id=1, node_id=1000 + partition, state=RecordDict(), run_config={},
                   node_config={"partition-id": partition, "num-partitions": 4, **node_config})


def to_node(content: RecordDict, node: int, message_type: str) -> Message:
    """A message to ``node`` as a Grid pushes it."""
    return pushed(Message(content, node, message_type))


def train_message(cid: int, round: int, commit: int) -> Message:
    """Round ``round``'s train message to client ``cid``, saying its round-``commit`` reply was folded in."""
    route = ConfigRecord({"client-id": cid, "commit-round": commit})
    return to_node(put_message(RecordDict({ROUTE: route}), {"round": round}), 1000 + cid, TRAIN)


def fake_federation(cfg: Any) -> Any:
    """What the handlers read of a Federation when ``run_client`` is stubbed: the config and the device."""
    return SimpleNamespace(cfg=cfg, device=torch.device("cpu"))


@pytest.fixture
def updates(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, FeddgMessage]]:
    """The (client, round, state) of each stubbed ``run_client`` call; its new state is {"v": round}."""
    monkeypatch.setattr(flower_client, "_FEDERATIONS", OrderedDict())
    seen: list[tuple[int, int, FeddgMessage]] = []

    def run_client(fed: Any, cid: int, round: int, payload: FeddgMessage, state: FeddgMessage) -> Any:
        seen.append((cid, round, dict(state)))
        if round < 0:
            raise RuntimeError("bad round")
        return {"num_examples": 1}, {"v": round}

    monkeypatch.setattr(flower_client, "run_client", run_client)
    return seen


# --- the Federation a node builds ---------------------------------------------------------------
def test_the_fingerprint_hashes_the_config_the_dataset_size_and_every_client_s_index_arrays() -> None:
    cfg = toy_config()
    fed = toy_federation_of(cfg)
    h = hashlib.sha256(dump_config(cfg).encode() + str(len(fed.dataset)).encode())
    for c in fed.clients:
        for idx in (c.train_idx, c.holdout_idx):
            h.update(f"<i8{len(idx)}:".encode() + idx.astype("<i8").tobytes())
    assert fingerprint(fed) == h.hexdigest()
    assert fingerprint(toy_federation_of(toy_config())) == fingerprint(fed)  # another process, the same federation


def test_the_fingerprint_tells_a_sample_moved_from_a_client_s_train_set_to_its_holdout() -> None:
    fed = toy_federation_of(toy_config())
    before, c = fingerprint(fed), fed.clients[0]
    both = np.concatenate([c.train_idx, c.holdout_idx])  # the same bytes back to back, split 7 samples later
    fed.clients[0] = replace(c, train_idx=both[:len(c.train_idx) - 7], holdout_idx=both[len(c.train_idx) - 7:])
    assert fingerprint(fed) != before


def test_a_client_federation_leaves_out_the_extra_targets_but_keeps_the_whole_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Any] = []

    def build(cfg: Any) -> Any:
        built.append(cfg)
        return SimpleNamespace(cfg=cfg)

    monkeypatch.setattr(flower_client, "build_federation", build)
    cfg = build_config({}, ["eval.extra=[{name: f, dataset: folder, root: /nowhere}]"])
    fed = client_federation(cfg)
    assert [b.eval.extra for b in built] == [[]]  # the extra datasets are not loaded on a node
    assert fed.cfg is cfg and len(fed.cfg.eval.extra) == 1  # the fingerprint hashes the server's config


def test_the_federation_cache_keeps_one_federation_per_factory_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flower_client, "_FEDERATIONS", OrderedDict())
    text, made = dump_config(build_config({})), {f: SimpleNamespace(factory=f) for f in ("plain", "probe")}

    def plain(cfg: Any) -> Any:
        return made["plain"]

    def probe(cfg: Any) -> Any:  # another factory of the same config: another federation
        return made["probe"]

    assert [node_federation(text, f) for f in (plain, probe, plain)] == [made["plain"], made["probe"], made["plain"]]


# --- the node's configuration -------------------------------------------------------------------
@pytest.mark.parametrize("node_config", [{}, {"partition-id": 1}, {"num-partitions": 4}])
def test_a_node_without_both_its_partition_id_and_count_is_refused(node_config: dict[str, bool | float | int | str]
                                                                  ) -> None:
    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match=r"^start the SuperNode with --node-config 'partition-id=<p> num-partitions"):
        node_partition(context)


def test_a_node_s_thread_count_overrides_the_experiment_s_and_must_be_a_whole_number_from_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, torch.device]] = []

    def federation_threads(threads: Any, device: torch.device) -> AbstractContextManager[None]:
        calls.append((threads, device))
        return nullcontext()

    monkeypatch.setattr(flower_client, "federation_threads", federation_threads)
    fed = fake_federation(build_config({"federation": {"threads": 2}}))
    node_threads(node_context(), fed)
    node_threads(node_context(threads=3), fed)
    node_threads(node_context(threads=1), fed)
    assert calls == [(2, fed.device), (3, fed.device), (1, fed.device)]
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match=rf"^--node-config threads={bad!r}: expected a whole number of threads"):
            node_threads(node_context(threads=bad), fed)


# --- the handlers -------------------------------------------------------------------------------
@pytest.mark.usefixtures("task_identity")
def test_identify_reports_the_node_s_partition_and_its_federation_s_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flower_client, "_FEDERATIONS", OrderedDict())
    cfg = toy_config()
    app = make_client_app(dump_config(cfg), factory=toy_federation_of)
    ask = RecordDict({ROUTE: ConfigRecord({"node-id": 1002})})
    reply = app(to_node(ask, 1002, IDENTIFY), node_context(2))
    assert dict(reply.content.config_records[ROUTE]) == {
        "partition-id": 2, "num-partitions": 4, "fingerprint": fingerprint(toy_federation_of(cfg)), "keeps-state": False}
    kept = app(to_node(ask, 1002, IDENTIFY), node_context(2, **{"state-dir": "/srv/feddg"}))
    assert kept.content.config_records[ROUTE]["keeps-state"] is True
    with pytest.raises(ValueError, match=r"^--node-config threads=0: "):  # refused before any client works
        app(to_node(ask, 1002, IDENTIFY), node_context(2, threads=0))


@pytest.mark.usefixtures("task_identity")
def test_a_quiet_client_app_turns_flowers_info_lines_and_its_actors_routine_end_off_in_its_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    flwr_log = logging.getLogger("flwr")
    monkeypatch.setattr(flwr_log, "level", logging.INFO)  # restored after the test
    monkeypatch.setattr(flwr_log, "filters", [])
    ask = RecordDict({ROUTE: ConfigRecord({"node-id": 1002})})
    make_client_app(dump_config(toy_config()), factory=toy_federation_of)(to_node(ask, 1002, IDENTIFY), node_context(2))
    assert flwr_log.level == logging.INFO  # a deployment's SuperNode logs its builds
    make_client_app(dump_config(toy_config()), factory=toy_federation_of, quiet=True)(
        to_node(ask, 1002, IDENTIFY), node_context(2))
    assert flwr_log.level == logging.WARNING and len(flwr_log.filters) == 1

    def shown(msg: str) -> bool:
        return flwr_log.filter(logging.LogRecord("flwr", logging.WARNING, __file__, 1, msg, ("ClientAppActor",), None))

    assert not shown("Manually terminating %s") and shown("Actor %s died")  # an actor's normal end, not its failure


@pytest.mark.usefixtures("task_identity")
def test_a_node_keeps_a_client_s_new_state_aside_until_the_server_commits_its_round(
        updates: list[tuple[int, int, FeddgMessage]]) -> None:
    app, context = make_client_app(dump_config(build_config({})), factory=fake_federation), node_context(1)
    # (round, the last round the server folded in): round 2's reply is dropped, so round 3 starts from round 1's state
    for round, commit in ((1, 0), (2, 1), (3, 1), (4, 3)):
        reply = app(train_message(1, round, commit), context)
        assert dict(reply.content.config_records[ROUTE]) == {"client-id": 1} and get_message(reply.content) == {
            "num_examples": 1}
    assert updates == [(1, 1, {}), (1, 2, {"v": 1}), (1, 3, {"v": 1}), (1, 4, {"v": 3})]


@pytest.mark.usefixtures("task_identity")
def test_a_failed_update_leaves_no_pending_state_and_answers_with_the_client_s_error(
        updates: list[tuple[int, int, FeddgMessage]]) -> None:
    app, context = make_client_app(dump_config(build_config({})), factory=fake_federation), node_context(1)
    app(train_message(1, 1, 0), context)
    reply = app(train_message(1, -2, 0), context)  # the stub raises; the server cannot fold in a failed round
    assert (reply.error.code, reply.error.reason) == (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "RuntimeError: bad round")
    app(train_message(1, 3, 1), context)  # round 1's state is still the one waiting
    assert updates[-1] == (1, 3, {"v": 1})


@pytest.mark.usefixtures("task_identity")
def test_setup_s_state_is_the_client_s_state_at_once(updates: list[tuple[int, int, FeddgMessage]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flower_client, "run_client_setup",
                        lambda fed, cid, msg, state: ({"echo": msg["x"]}, {"v": 10 * cid, **state}))
    app, context = make_client_app(dump_config(build_config({})), factory=fake_federation), node_context(3)
    route = ConfigRecord({"client-id": 3})
    reply = app(to_node(put_message(RecordDict({ROUTE: route}), {"x": 7}), 1003, SETUP), context)
    assert get_message(reply.content) == {"echo": 7}
    app(train_message(3, 1, 0), context)  # no round committed yet: the setup's state
    assert updates == [(3, 1, {"v": 30})]


@pytest.mark.usefixtures("task_identity")
def test_a_roster_node_serves_the_client_its_key_was_bound_to_without_a_declared_partition(
        updates: list[tuple[int, int, FeddgMessage]]) -> None:
    """Under a roster the server bound the node to its client by its key (docs/flower.md): a node started with only
    ``auth-key`` (no partition-id) trains the client the server's messages name."""
    context = Context(run_id=1, node_id=1002, state=RecordDict(), run_config={}, node_config={"auth-key": "node2"})
    app = make_client_app(dump_config(build_config({})), factory=fake_federation)
    app(train_message(2, 1, 0), context)
    assert updates == [(2, 1, {})]


@pytest.mark.usefixtures("task_identity")
def test_train_refuses_a_plain_or_secagg_message_for_another_client(updates: list[tuple[int, int, FeddgMessage]]) -> None:
    app, context = make_client_app(dump_config(build_config({})), factory=fake_federation), node_context(0)
    with pytest.raises(ValueError, match="^a message for client 1 reached the SuperNode of partition 0$"):
        app(train_message(1, 1, 0), context)
    payload: FeddgMessage = {"round": 1, "w/x": np.zeros(2, np.float32)}  # SecAgg+'s stage-2 FitIns: the route in its config
    fitins = compat.fitins_to_recorddict(to_fitins(payload, {"client-id": 1, "commit-round": 0}), True)
    with pytest.raises(ValueError, match="^a message for client 1 reached the SuperNode of partition 0$"):
        app(to_node(fitins, 1000, TRAIN), context)
    assert updates == []
