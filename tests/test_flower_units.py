"""Unit tests of the Flower engine's pieces, each called directly against hand-built messages, fake grids and fake
processes: message routing and timeouts of the ServerApp half, the ClientApp's partition check and commit rule, the
ServerApp's run marks, the warm executor's and worker's process and TLS handling, and the launcher's command."""

import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.constant import ErrorCode, SubStatus
from support.flower_messages import pushed
from test_flower import LoopbackGrid, probe_federation, server_config_text, toy_config
from toy import toy_federation_of

from feddg.config import build_config, dump_config
from feddg.engines.flower import app, executor, launch, worker
from feddg.engines.flower import client as flower_client
from feddg.engines.flower import server as flower_server
from feddg.engines.flower.client import (
    ROUTE,
    SETUP,
    committed_state,
    config_from_text,
    make_client_app,
    node_federation,
    node_partition,
    pending_prefix,
    state_prefix,
)
from feddg.engines.flower.records import get_message, put_message
from feddg.engines.flower.routes import train_route
from feddg.engines.flower.server import (
    FeddgStrategy,
    PollingGrid,
    collect,
    declared_partition,
    discover_clients,
    outgoing,
    run_on_grid,
    run_setup,
)
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped


def sent_message(cid: int, node: int, message_type: str = "train") -> Message:
    """A message to client ``cid`` on ``node``, with the id Grid.push_messages gives it."""
    return pushed(Message(RecordDict({ROUTE: ConfigRecord({"client-id": cid})}), node, message_type))


def answer(to: Message, value: float) -> Message:
    """A readable reply to ``to`` carrying ``x`` = ``value``."""
    return Message(put_message(RecordDict(), {"x": value, "num_examples": 1}), reply_to=to)


# --- the ServerApp half ------------------------------------------------------------------------
@pytest.mark.usefixtures("task_identity")
def test_collect_returns_replies_in_the_order_sent_and_says_why_each_other_client_gave_none() -> None:
    sent = {cid: sent_message(cid, 1000 + cid) for cid in range(4)}
    replies = [answer(sent[2], 2.0), Message(Error(code=0, reason="ValueError: boom"), reply_to=sent[1]),
               answer(sent[0], 0.0)]  # arrival order 2, 1, 0; client 3 never answers
    got, failed = collect(sent, replies, 7.0)  # flower.round_timeout_s is a float: 7.0 s reads "7 s"
    assert [(r.client_id, r.message["x"]) for r in got] == [(0, 0.0), (2, 2.0)]
    assert failed == {1: "node 1001: ValueError: boom", 3: "no reply within 7 s (flower.round_timeout_s)"}


@pytest.mark.usefixtures("task_identity")
def test_an_error_reason_loses_its_colour_codes_and_line_breaks_and_is_cut_at_300_characters() -> None:
    sent = {5: sent_message(5, 1005)}
    reason = "\x1b[31mValueError\x1b[0m: bad\n  batch " + 400 * "x"  # as Ray writes it
    _, failed = collect(sent, [Message(Error(code=0, reason=reason), reply_to=sent[5])], 60.0)
    expected = "node 1005: ValueError: bad batch " + 400 * "x"
    assert failed == {5: expected[:300]} and len(failed[5]) == 300


@pytest.mark.usefixtures("task_identity")
def test_outgoing_addresses_each_client_s_node_with_its_last_accepted_round() -> None:
    server = SimpleNamespace(commits={2: 3}, saved_commits={2: 1}, run_key="ab12")
    out = outgoing({0: {"round": 4}, 2: {"round": 4}}, {0: 1005, 2: 1003}, "train", train_route(server))  # type: ignore[arg-type]
    assert {cid: m.metadata.dst_node_id for cid, m in out.items()} == {0: 1005, 2: 1003}
    routes = {cid: dict(m.content.config_records[ROUTE]) for cid, m in out.items()}
    assert routes == {0: {"client-id": 0, "commit-round": 0, "durable-round": 0, "run-key": "ab12"},  # 0: none yet
                      2: {"client-id": 2, "commit-round": 3, "durable-round": 1, "run-key": "ab12"}}
    assert all(get_message(m.content) == {"round": 4} for m in out.values())


@pytest.mark.usefixtures("task_identity")
def test_a_declared_partition_out_of_range_or_taken_is_refused() -> None:
    def declares(p: int, n: int) -> Message:
        return Message(RecordDict({ROUTE: ConfigRecord({"partition-id": p, "num-partitions": n})}),
                       reply_to=sent_message(0, 1009, "query.identify"))

    assert declared_partition(declares(3, 4), 4, {0: 1000}) == 3
    with pytest.raises(RuntimeError, match=r"node 1009 is partition 4 of 4; want one node per client, partitions 0\.\.3"):
        declared_partition(declares(4, 4), 4, {})
    with pytest.raises(RuntimeError, match=r"node 1009 is partition 1 of 4"):
        declared_partition(declares(1, 4), 4, {1: 1001})  # partition 1 has its node already
    with pytest.raises(RuntimeError, match=r"node 1009 is partition -1 of 4"):
        declared_partition(declares(-1, 4), 4, {})
    with pytest.raises(RuntimeError, match=r"node 1009 is partition 1 of 3"):  # a node of another federation's size
        declared_partition(declares(1, 3), 4, {})
    assert declared_partition(declares(0, 4), 4, {}) == 0


class IdentifyGrid:
    """Nodes without a roster key: node ``n`` declares partition ``declared[n]`` of 2 and federation ``prints[n]``."""

    def __init__(self, declared: dict[int, int], prints: dict[int, str]) -> None:
        self.declared, self.prints = declared, prints
        self.timeouts: list[float | None] = []

    def get_node_ids(self) -> list[int]:
        return list(self.declared)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        self.timeouts.append(timeout)
        out = []
        for m in messages:
            n = pushed(m).metadata.dst_node_id
            route = ConfigRecord({"partition-id": self.declared[n], "num-partitions": 2, "fingerprint": self.prints[n]})
            out.append(Message(RecordDict({ROUTE: route}), reply_to=m))
        return out


@pytest.mark.usefixtures("task_identity")
def test_discovery_maps_declared_partitions_waits_at_least_1_s_and_refuses_another_federation(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(flower_server, "fingerprint", lambda fed: "fed")
    server = SimpleNamespace(fed=SimpleNamespace(clients=[0, 1], cfg=SimpleNamespace(flower=SimpleNamespace(roster=None))),
                             round=0, rounds=3, run_dir=tmp_path)
    grid = IdentifyGrid({1000: 1, 1001: 0}, {1000: "fed", 1001: "fed"})
    assert discover_clients(grid, server, 30.0) == {0: 1001, 1: 1000}  # type: ignore[arg-type]
    grid0 = IdentifyGrid({1000: 1, 1001: 0}, {1000: "fed", 1001: "fed"})
    discover_clients(grid0, server, 0.0)  # type: ignore[arg-type]
    assert 29.0 < grid.timeouts[0] <= 30.0 and grid0.timeouts == [1.0]  # type: ignore[operator]  # what is left, >= 1 s
    with pytest.raises(RuntimeError, match=r"^node 1001 \(client 0\) built a different federation"):
        discover_clients(IdentifyGrid({1000: 1, 1001: 0}, {1000: "fed", 1001: "other"}), server, 30.0)  # type: ignore[arg-type]


def test_the_polling_grid_gives_up_at_the_timeout_and_returns_what_arrived() -> None:
    pulls: list[set[str]] = []

    def pull(ids: set[str]) -> list[SimpleNamespace]:
        pulls.append(set(ids))
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="b"))] if len(pulls) == 1 else []

    grid = SimpleNamespace(push_messages=lambda msgs: ["a", "b"], pull_messages=pull)
    got: list[list[Any]] = []
    sent: list[Any] = ["a", "b"]
    polling = PollingGrid(grid, interval=0.01)  # type: ignore[arg-type]
    waiter = threading.Thread(target=lambda: got.append(list(polling.send_and_receive(sent, timeout=0.3))),
                              daemon=True)  # a grid that never gives up must fail this test, not hang it
    t0 = time.monotonic()
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and 0.3 <= time.monotonic() - t0 < 10
    assert [[r.metadata.reply_to_message_id for r in replies] for replies in got] == [["b"]]
    assert pulls[0] == {"a", "b"} and all(p == {"a"} for p in pulls[1:])  # b's reply came: only a is awaited


class SetupGrid:
    """Answers every setup message, except client 1's: its node's ClientApp fails."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        self.timeouts.append(timeout)
        out = []
        for m in map(pushed, messages):
            cid = m.content.config_records[ROUTE]["client-id"]
            out.append(Message(Error(code=0, reason="no labels"), reply_to=m) if cid == 1 else answer(m, 1.0))
        return out


@pytest.mark.usefixtures("task_identity")
def test_a_setup_exchange_that_one_client_fails_stops_the_run_within_the_round_timeout() -> None:
    server = SimpleNamespace(setup_request=lambda: {"ask": "labels"}, run_key="k")
    grid = SetupGrid()
    with pytest.raises(RunStopped, match=r"^setup exchange: client 1: node 1001: no labels$"):
        run_setup(server, grid, {0: 1000, 1: 1001, 2: 1002}, 9.0)  # type: ignore[arg-type]
    assert grid.timeouts == [9.0]


@pytest.mark.usefixtures("task_identity")
def test_a_setup_exchange_hands_every_reply_to_the_server_and_one_without_a_request_sends_nothing() -> None:
    done: list[Any] = []
    server = SimpleNamespace(setup_request=lambda: {"ask": "labels"}, finish_setup=done.append,
                             mark_setup_done=lambda: done.append("marked"), run_key="k")
    grid = SetupGrid()
    run_setup(server, grid, {2: 1002, 0: 1000}, 9.0)  # type: ignore[arg-type]  # client 1 (whose node fails) is not in
    [replies] = done
    assert [(r.client_id, r.message) for r in replies] == [(2, {"x": 1.0, "num_examples": 1}),
                                                             (0, {"x": 1.0, "num_examples": 1})]
    done.clear()
    server.setup_request = lambda: None  # the method has no setup exchange, or it was done before a resume
    run_setup(server, grid, {0: 1000}, 9.0)  # type: ignore[arg-type]
    assert done == ["marked"] and grid.timeouts == [9.0]  # nothing sent the second time


class RecordingGrid(LoopbackGrid):
    """A LoopbackGrid that records each non-empty send: its message type, timeout and messages."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sends: list[tuple[str, float | None, list[Message]]] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if messages:
            self.sends.append((messages[0].metadata.message_type, timeout, messages))
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.usefixtures("task_identity")
def test_the_server_sends_each_round_once_with_its_number_commit_and_the_round_timeout(tmp_path: Path) -> None:
    cfg = toy_config("federation.rounds=2", "flower.round_timeout_s=7", "flower.node_wait_s=30")  # 4 clients, all
    server = Server(probe_federation(cfg), tmp_path / "run")
    grid = RecordingGrid(make_client_app(factory=probe_federation), 4, {"config": server_config_text(server)})
    run_on_grid(server, grid)
    kinds = [kind for kind, _, _ in grid.sends]
    assert kinds == ["query.identify", SETUP, "train", "train"]
    assert 1.0 <= grid.sends[0][1] <= 30  # type: ignore[operator]  # identify: what is left of node_wait_s
    assert [timeout for _, timeout, _ in grid.sends[1:]] == [7, 7, 7]
    for r, (_, _, msgs) in enumerate(grid.sends[2:], start=1):
        routes = [(m.metadata.dst_node_id, dict(m.content.config_records[ROUTE]), get_message(m.content)["round"])
                  for m in msgs]  # round r tells each node that its round r-1 reply was folded in
        key = {"run-key": server.run_key}  # round r-1 was checkpointed too (checkpoint_every: 1)
        assert routes == [(1000 + c, {"client-id": c, "commit-round": r - 1, "durable-round": r - 1, **key}, r)
                          for c in range(4)]


class ScriptedServer:
    """A feddg Server resumed after round 2 of 5 that sends clients 0 and 1 each round, accepts every reply it
    receives and rolls back round 4; it records the rounds it configures and finishes and each round's fold."""

    def __init__(self) -> None:
        self.round, self.rounds = 2, 5
        self.commits: dict[int, int] = {}  # as Server.finish_round keeps them: not for the rolled-back round 4
        self.saved_commits: dict[int, int] = {}
        self.run_key = "k"
        self.fed = SimpleNamespace(cfg=SimpleNamespace(flower=SimpleNamespace(round_timeout_s=5.0)))
        self.configured: list[int] = []
        self.finished: list[int] = []
        self.folds: list[SimpleNamespace] = []

    def configure(self, round: int) -> dict[int, dict[str, int]]:
        self.configured.append(round)
        return {0: {"round": round}, 1: {"round": round}}

    def start_round(self, sent: dict[int, Any]) -> SimpleNamespace:
        fold = SimpleNamespace(accepted=[], failed={})
        self.folds.append(fold)
        return fold

    def fail(self, fold: SimpleNamespace, cid: int, why: str) -> None:
        fold.failed[cid] = why

    def receive(self, fold: SimpleNamespace, reply: Any) -> None:
        fold.accepted.append(reply.client_id)

    def finish_round(self, round: int, fold: SimpleNamespace, timings: dict[str, float]) -> dict[str, Any]:
        self.finished.append(round)
        if round != 4:
            self.commits.update({cid: round for cid in fold.accepted})
        return {"round": round, "rolled_back": round == 4}


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_numbers_resumed_rounds_and_commits_only_accepted_replies_of_kept_rounds() -> None:
    server = ScriptedServer()
    strategy = FeddgStrategy(server, {0: 1000, 1: 1001})  # type: ignore[arg-type]
    commits, metrics = [], []
    for flower_round in (1, 2, 3):  # feddg rounds 3, 4 (rolled back), 5
        sent = strategy.configure_train(flower_round, ArrayRecord(), ConfigRecord(), None)  # type: ignore[arg-type]
        out = [pushed(m) for m in sent]
        commits.append([m.content.config_records[ROUTE]["commit-round"] for m in out])
        replies = [answer(out[0], 0.0), Message(Error(code=0, reason="died"), reply_to=out[1]) if flower_round == 1
                   else answer(out[1], 1.0)]  # client 1's round-3 reply is an error
        metrics.append(dict(strategy.aggregate_train(flower_round, replies)[1]))  # type: ignore[arg-type]
    assert server.configured == server.finished == [3, 4, 5]
    assert [(f.accepted, f.failed) for f in server.folds] == [([0], {1: "node 1001: died"}), ([0, 1], {}), ([0, 1], {})]
    assert commits == [[0, 0], [3, 0], [3, 0]]  # round 4 was rolled back: round 5 still commits round 3 only
    assert metrics == [{"round": 3, "rolled_back": 0}, {"round": 4, "rolled_back": 1}, {"round": 5, "rolled_back": 0}]


@pytest.mark.parametrize(("done", "starts"), [(2, [(3, 7.0)]), (5, [])])
def test_a_resumed_run_on_a_grid_starts_only_its_remaining_rounds(monkeypatch: pytest.MonkeyPatch, done: int,
                                                                  starts: list[tuple[int, float]]) -> None:
    flower = SimpleNamespace(node_wait_s=30.0, round_timeout_s=7.0, secure_aggregation=None)
    cfg = SimpleNamespace(flower=flower, federation=SimpleNamespace(threads="auto"), method=SimpleNamespace(name="fedavg"))
    server = SimpleNamespace(fed=SimpleNamespace(cfg=cfg, device=torch.device("cpu")), round=done, rounds=5,
                             write_results=lambda: {"done": True})
    started: list[tuple[int, float]] = []
    monkeypatch.setattr(flower_server, "discover_clients", lambda grid, server, wait_s: {0: 1000})
    monkeypatch.setattr(flower_server, "run_setup", lambda server, grid, nodes, timeout: None)
    monkeypatch.setattr(FeddgStrategy, "start", lambda self, grid, arrays, num_rounds, timeout:
                        started.append((num_rounds, timeout)))
    assert run_on_grid(server, None) == {"done": True}  # type: ignore[arg-type]
    assert started == starts  # rounds 3..5 of 5 after round 2; nothing once round 5 is done


# --- the ClientApp -----------------------------------------------------------------------------
@pytest.mark.usefixtures("task_identity")
def test_a_message_for_another_client_is_refused_by_a_node_without_a_roster_key() -> None:
    text = dump_config(toy_config())
    client_app = make_client_app(text, factory=toy_federation_of)
    context = Context(run_id=1, node_id=1000, node_config={"partition-id": 0, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    assert node_partition(context) == (0, 4)
    with pytest.raises(ValueError, match="^a message for client 1 reached the SuperNode of partition 0$"):
        client_app(sent_message(1, 1000, SETUP), context)


def test_the_federation_cache_evicts_the_config_least_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flower_client, "_FEDERATIONS", OrderedDict())
    built: list[int] = []

    def build(cfg: Any) -> Any:
        built.append(cfg.seed)
        return SimpleNamespace(seed=cfg.seed)

    a, b, c = (dump_config(build_config({"seed": s})) for s in (1, 2, 3))
    fed_a, fed_b = node_federation(a, build), node_federation(b, build)
    node_federation(a, build)  # a used again: b is now the least recently used
    node_federation(c, build)  # the cache holds MAX_FEDERATIONS = 2: b goes
    assert flower_client.MAX_FEDERATIONS == 2
    assert node_federation(a, build) is fed_a and built == [1, 2, 3]
    assert node_federation(b, build) is not fed_b and built == [1, 2, 3, 2]  # built again


def test_a_pending_client_state_becomes_the_state_only_once_its_round_is_committed() -> None:
    state = RecordDict()
    put_message(state, {"v": 1}, state_prefix(2))
    put_message(state, {"v": 2}, pending_prefix(2))
    state[pending_prefix(2) + "round"] = MetricRecord({"round": 3})
    assert committed_state(state, 2, 2) == {"v": 1}  # round 3's reply not folded in (yet): the old state
    assert get_message(state, state_prefix(2)) == {"v": 1}
    assert committed_state(state, 2, 3) == {"v": 2}
    assert get_message(state, state_prefix(2)) == {"v": 2}


# --- the ServerApp's marks and run config ------------------------------------------------------
def test_the_run_config_carries_resume_and_an_absolute_or_empty_run_dir(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rc = tomllib.loads(app.run_config_toml(build_config({}), "", resume=True))
    assert rc["resume"] is True and rc["run-dir"] == ""
    monkeypatch.chdir(tmp_path)  # the ServerApp runs elsewhere: a relative run directory is made absolute here
    rc = tomllib.loads(app.run_config_toml(build_config({}), "runs/a"))
    assert rc["resume"] is False and rc["run-dir"] == os.path.join(os.path.realpath(tmp_path), "runs", "a")


@pytest.mark.parametrize(("raised", "status", "error"), [
    (KeyboardInterrupt(), "stopped", "stopped from outside (KeyboardInterrupt) before the last round"),
    (RuntimeError("disk\nfull"), "failed", "RuntimeError: disk full"),
])
def test_the_server_app_marks_a_stopped_and_a_failed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          raised: BaseException, status: str, error: str) -> None:
    def build(cfg: Any) -> None:
        raise raised

    monkeypatch.setattr("feddg.federation.setup.build_federation", build)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1}\n')  # a used run directory: resume = true continues it
    context = SimpleNamespace(run_config={"config": dump_config(build_config({})), "run-dir": str(run), "resume": True})
    with pytest.raises(type(raised)):
        app.main(None, context)  # type: ignore[arg-type]
    record = json.loads((run / "status.json").read_text())
    assert (record["status"], record["error"], record["pid"]) == (status, error, os.getpid())


# --- the warm executor and worker --------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_exited_child_not_yet_reaped_is_not_alive() -> None:
    assert executor.alive(os.getpid())
    child = subprocess.Popen(["true"])
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not reaped: a zombie
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert not executor.alive(child.pid)
    child.wait()
    assert not executor.alive(child.pid)


def test_the_executor_refuses_parent_pid_0_which_would_signal_its_own_process_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def supervise(worker_args: list[str], parent_pid: int | None) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(executor, "supervise", supervise)
    monkeypatch.setattr(sys, "argv", ["executor", "--runtime-api-address", "127.0.0.1:9", "--insecure", "--parent-pid", "0"])
    with pytest.raises(SystemExit, match=r"^feddg executor: --parent-pid 0: no such process"):
        executor.main()


def test_the_worker_gets_the_resolved_ca_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ca.pem").write_text("CA")
    monkeypatch.chdir(tmp_path)
    assert executor.tls_args("ca.pem", False) == ["--root-certificates", os.path.realpath(tmp_path / "ca.pem")]


class FakeChild:
    """A worker process that lives ``life`` seconds of the fake clock and exits with 3, or with -15 when terminated."""

    def __init__(self, clock: list[float], life: float) -> None:
        self.clock, self.end = clock, clock[0] + life
        self.returncode: int | None = None
        self.terminated = False

    def poll(self) -> int | None:
        if self.clock[0] >= self.end:
            self.returncode = 3
        return self.returncode

    def terminate(self) -> None:
        self.terminated, self.returncode = True, -15

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


def supervise_on_a_fake_clock(monkeypatch: pytest.MonkeyPatch, lives: list[float],
                              supernode_alive: Callable[[float, int], bool]) -> tuple[float, list[list[str]],
                                                                                        list[FakeChild]]:
    """Run ``executor.supervise`` with time on a fake clock: its n-th worker lives ``lives[n]`` s, and
    ``supernode_alive(clock, workers started)`` says whether the SuperNode still runs. Returns the clock when it
    returned, the workers' command lines and the workers."""
    clock: list[float] = [0.0]
    argvs: list[list[str]] = []
    children: list[FakeChild] = []

    def popen(argv: list[str]) -> FakeChild:
        argvs.append(argv)
        children.append(FakeChild(clock, lives[len(children)]))
        return children[-1]

    def sleep(s: float) -> None:
        clock[0] += s

    monkeypatch.setattr(executor.signal, "signal", lambda *args: None)
    monkeypatch.setattr(executor.subprocess, "Popen", popen)
    monkeypatch.setattr(executor.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(executor.time, "sleep", sleep)
    monkeypatch.setattr(executor, "alive", lambda pid: supernode_alive(clock[0], len(children)))
    executor.supervise(["--insecure"], 42)
    return clock[0], argvs, children


def test_the_executor_doubles_its_pause_after_each_quick_death_and_resets_it_after_a_healthy_life(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lives = [0.0, 0.0, 0.0, executor.HEALTHY_S + 10, 0.0]
    _, argvs, _ = supervise_on_a_fake_clock(monkeypatch, lives, lambda clock, started: started < 5)  # ends at the 5th
    pauses = [line.split("starts in ")[1] for line in capsys.readouterr().err.splitlines()]
    assert pauses == ["2 s", "4 s", "8 s", "1 s", "2 s"]  # quick deaths: 2, 4, 8 s; after a healthy life: 1 s, 2 s
    assert argvs == 5 * [[sys.executable, "-m", executor.WORKER, "--insecure", "--parent-pid", str(os.getpid())]]


def test_the_worker_s_runtime_client_is_plain_http_only_without_a_ca(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "RuntimeHttpClient", SimpleNamespace(from_server_address=lambda **kw: kw))
    plain, tls = worker.runtime_client("127.0.0.1:9", None), worker.runtime_client("127.0.0.1:9", b"CA")
    assert (plain["insecure"], plain["root_certificates"]) == (True, None)  # type: ignore[index]
    assert (tls["insecure"], tls["root_certificates"]) == (False, b"CA")  # type: ignore[index]


@pytest.mark.parametrize(("tls", "ca"), [(["--root-certificates", "ca.pem"], b"CA PEM"), (["--insecure"], None)])
def test_the_worker_serves_with_the_ca_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tls: list[str], ca: bytes | None) -> None:
    (tmp_path / "ca.pem").write_bytes(b"CA PEM")
    monkeypatch.chdir(tmp_path)
    served: list[tuple[str, bytes | None, float]] = []
    monkeypatch.setattr(worker, "warm_up", lambda: None)
    monkeypatch.setattr(worker, "serve", lambda *args: served.append(args))
    monkeypatch.setattr(sys, "argv", ["worker", "--runtime-api-address", "127.0.0.1:9", "--poll-interval", "0.25", *tls])
    worker.main()
    assert served == [("127.0.0.1:9", ca, 0.25)]


class TaskRuntime:
    """Fakes of what ``worker.run_task`` talks to: the Runtime API client, the heartbeat and Flower's push functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, message: Message, fab_hash: str) -> None:
        self.pushed: list[Message] = []
        self.outputs: list[tuple[str, str]] = []
        client = SimpleNamespace(close=lambda: None)
        heartbeat = SimpleNamespace(start=lambda: None, stop=lambda: None, is_running=True)
        task = (message, Context(run_id=1, node_id=1000, node_config={}, state=RecordDict(), run_config={}),
                SimpleNamespace(fab_id="feddg", fab_version="1"), SimpleNamespace(hash_str=fab_hash, content=b""))
        monkeypatch.setattr(worker, "runtime_client", lambda *args: client)
        monkeypatch.setattr(worker, "RuntimeTokenHttpInterceptor", lambda token: token)
        monkeypatch.setattr(worker, "HeartbeatSender", lambda fn: heartbeat)
        monkeypatch.setattr(worker, "make_task_heartbeat_fn_http", lambda c: None)
        monkeypatch.setattr(worker, "pull_task_input", lambda c: task)
        monkeypatch.setattr(worker, "install_from_fab", lambda content, skip_prompt: None)
        monkeypatch.setattr(worker, "push_message", lambda c, reply, context: self.pushed.append(reply))
        monkeypatch.setattr(worker, "push_task_output", lambda client, context, sub_status, details:
                            self.outputs.append((sub_status, details)))


@pytest.mark.usefixtures("task_identity")
def test_a_worker_task_whose_client_app_raises_ends_failed_with_an_error_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    message = sent_message(0, 1000)
    runtime = TaskRuntime(monkeypatch, message, "h1")

    def failing(message: Message, context: Context) -> Message:
        raise ValueError("bad batch")

    worker.run_task("127.0.0.1:9", None, "token", {"h1": failing})  # type: ignore[dict-item]
    assert runtime.outputs == [(SubStatus.FAILED, "<class 'ValueError'>:<'bad batch'>")]
    [reply] = runtime.pushed
    assert reply.has_error() and reply.metadata.reply_to_message_id == message.metadata.message_id
    assert (reply.error.code, reply.error.reason) == (ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                                      "<class 'ValueError'>:<'bad batch'>")


@pytest.mark.usefixtures("task_identity")
def test_a_worker_loads_a_fab_s_client_app_once_and_reports_a_load_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    message = sent_message(0, 1000)
    runtime = TaskRuntime(monkeypatch, message, "h2")
    loads: list[str] = []

    def ok(message: Message, context: Context) -> Message:
        return answer(message, 5.0)

    def load(fab_id: str, fab_version: str, fab_hash: str) -> Any:
        loads.append(fab_hash)
        if fab_hash == "h2":
            return ok
        raise LoadClientAppError("no module")

    monkeypatch.setattr(worker, "get_load_client_app_fn", lambda *args, **kwargs: load)
    apps: dict[str, Any] = {}
    for _ in range(2):
        worker.run_task("127.0.0.1:9", None, "token", apps)
    assert loads == ["h2"] and apps == {"h2": ok}  # the second task reused the loaded app
    assert runtime.outputs == 2 * [(SubStatus.COMPLETED, "")]
    assert [get_message(r.content)["x"] for r in runtime.pushed] == [5.0, 5.0]
    runtime = TaskRuntime(monkeypatch, message, "h3")
    worker.run_task("127.0.0.1:9", None, "token", apps)
    [reply] = runtime.pushed
    load_failed = "An exception was raised when attempting to load `ClientApp`"
    assert (reply.error.code, reply.error.reason) == (ErrorCode.LOAD_CLIENT_APP_EXCEPTION, load_failed)
    assert runtime.outputs == [(SubStatus.FAILED, load_failed)]


# --- the launcher ------------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "why"), [(0, None), (2, "`flwr run` exited with 2")])
def test_the_launcher_streams_the_run_with_its_config_and_reports_flwr_s_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, why: str | None) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "pyproject.toml").write_text("")
    run_dir, cfg = tmp_path / "run", build_config({"name": "x"})
    calls: list[tuple[list[str], dict[str, Any]]] = []

    def flwr_run(argv: list[str]) -> SimpleNamespace:
        calls.append((argv, tomllib.loads(Path(argv[5]).read_text())))
        if code == 0:  # the ServerApp ran to its end
            app.mark(run_dir, "completed")
            (run_dir / "results.json").write_text("{}")
        return SimpleNamespace(returncode=code)

    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "flwr_command", lambda: "/opt/flwr")
    monkeypatch.setattr(launch.subprocess, "run", flwr_run)
    assert launch.submit(cfg, run_dir, "lab", tmp_path / "app") == why
    [(argv, rc)] = calls
    assert argv[:5] + argv[6:] == ["/opt/flwr", "run", str(tmp_path / "app"), "lab", "--run-config", "--stream"]
    assert rc["run-dir"] == str(run_dir.resolve()) and rc["resume"] is False
    assert config_from_text(rc["config"]) == cfg

