"""A real Flower deployment on 127.0.0.1: flower-superlink, 3 flower-supernode processes, `flwr run`.

Two rounds of FedAvg on a tiny Digits-DG config, with Flower's default isolation (a ClientApp
process per message) and with feddg's warm executor (one process per SuperNode); the run directory
must equal the in-process engine's, every listening socket of the deployment's processes must be on
loopback, and no process may survive the shutdown. Fast tests: the client-side build is reused
across messages, and the executor restarts a worker that dies.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import create_autospec

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid
from support.flower_local import LocalDeployment
from support.flower_messages import pushed
from toy import toy_federation_of

from feddg.config import build_config, dump_config
from feddg.engines.flower import client as flower_client
from feddg.engines.flower.client import (
    IDENTIFY,
    MAX_FEDERATIONS,
    ROUTE,
    client_federation,
    config_from_text,
    fingerprint,
    make_client_app,
    node_federation,
)
from feddg.engines.flower.records import get_message
from feddg.engines.flower.routes import train_route
from feddg.engines.flower.server import PollingGrid, outgoing
from feddg.experiment import run_experiment
from feddg.federation.checkpoint import load_checkpoint
from feddg.federation.server import Server
from feddg.federation.setup import Federation, build_federation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} address (32-bit words in host byte order) -> printable IP."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening_addresses(pids: set[int]) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state owned by ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # the process ended meanwhile
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                host, port = f[1].split(":")
                out.add((_address(host), int(port, 16)))
    return out


def program(pid: int) -> str:
    """The program a process runs (``flwr-clientapp``, ``python`` ...), "" once it has ended."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return os.path.basename(argv[1] if argv[0].endswith(b"python") and len(argv) > 1 else argv[0]).decode()


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1")


def test_listeners_of_a_process_are_found_and_decoded():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listening_addresses({os.getpid()})
    assert _address("0100007F") == "127.0.0.1" and _address("00000000") == "0.0.0.0"
    assert _address("0100007F") == "127.0.0.1" and _address("00000000") == "0.0.0.0"
    assert _address("0000000000000000FFFF00000100007F") == "::ffff:127.0.0.1"
    assert _address("00000000000000000000000001000000") == "::1"
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and is_loopback("::ffff:127.0.0.1")


BUILT: list[Federation] = []


def counted_toy_federation(cfg) -> Federation:
    """The toy federation of ``cfg``, remembered in ``BUILT`` (the build hook of the reuse test)."""
    BUILT.append(toy_federation_of(cfg))
    return BUILT[-1]


@pytest.fixture
def fresh_cache(monkeypatch, task_identity):
    """An empty federation cache and build log, and the task identity Flower Messages need."""
    monkeypatch.setattr(flower_client, "_FEDERATIONS", OrderedDict())
    BUILT.clear()


def toy_text(seed: int = 0) -> str:
    return dump_config(build_config(
        {"seed": seed, "partition": {"kind": "by_domain", "num_clients": 2}, "split": {"target": "c"},
         "federation": {"rounds": 2, "batch_size": 16}, "optim": {"lr": 0.1}, "device": "cpu"}))


def test_one_process_builds_the_client_federation_once_for_all_its_messages(tmp_path, fresh_cache):
    text = toy_text()
    app = make_client_app(text, factory=counted_toy_federation)
    node = {"partition-id": 1, "num-partitions": 2}

    def deliver(msg: Message) -> Message:  # each message comes with its own copy of the node's Context
        return app(pushed(msg), Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={}))

    hello = deliver(Message(RecordDict({ROUTE: ConfigRecord({"node-id": 7})}), 7, IDENTIFY))
    assert len(BUILT) == 1 and hello.content.config_records[ROUTE]["fingerprint"] == fingerprint(BUILT[0])
    server = Server(counted_toy_federation(config_from_text(text)), tmp_path / "run")
    sent = outgoing({1: server.configure(1)[1]}, {1: 7}, "train", train_route(server))
    reply = deliver(sent[1])
    assert not reply.has_error() and get_message(reply.content)["num_examples"] == len(BUILT[0].clients[1].train_idx)
    assert len(BUILT) == 2  # the second is the server's: the train message reused the identify message's build
    assert node_federation(text, counted_toy_federation) is BUILT[0]


def test_the_federation_cache_keeps_the_latest_configs(fresh_cache):
    texts = [toy_text(seed) for seed in range(MAX_FEDERATIONS + 1)]
    feds = [node_federation(t, counted_toy_federation) for t in texts]
    assert len(BUILT) == MAX_FEDERATIONS + 1 and len({id(f) for f in feds}) == MAX_FEDERATIONS + 1
    assert node_federation(texts[-1], counted_toy_federation) is feds[-1] and len(BUILT) == MAX_FEDERATIONS + 1
    assert node_federation(texts[0], counted_toy_federation) is not feds[0]  # evicted, built again
    assert len(BUILT) == MAX_FEDERATIONS + 2


def test_a_client_builds_no_extra_evaluation_data_and_the_server_s_fingerprint(cache_dir, monkeypatch):
    cfg = build_config(
        {"seed": 3, "device": "cpu", "data": {"dataset": "digits-dg", "max_per_domain": 40, "cache_dir": str(cache_dir)},
         "split": {"target": "synth"}, "partition": {"kind": "by_domain", "num_clients": 3}, "model": {"name": "cnn"},
         "eval": {"extra": [{"name": "again", "dataset": "digits-dg", "domains": ["synth"], "max_per_domain": 10}]}}
    )
    server_side = build_federation(cfg)
    assert [t.name for t in server_side.extra] == ["again"]

    def refuse(*args, **kwargs):
        raise AssertionError("a client loaded an eval.extra dataset")

    monkeypatch.setattr("feddg.federation.setup.load_extra_target", refuse)
    client_side = client_federation(cfg)
    assert client_side.extra == [] and client_side.cfg is cfg
    assert fingerprint(client_side) == fingerprint(server_side)


def test_the_executor_restarts_a_dead_worker_and_ends_with_its_supernode(tmp_path):
    pids = tmp_path / "pids"
    env = {**os.environ, "FEDDG_TEST_PIDS": str(pids),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    supernode = subprocess.Popen(["sleep", "5"])
    code = ("import sys, feddg.engines.flower.executor as e; e.WORKER = 'support.dying_worker'; "
            "e.supervise(['--runtime-api-address', '127.0.0.1:1'], int(sys.argv[1]))")
    t0 = time.monotonic()
    executor = subprocess.run([sys.executable, "-c", code, str(supernode.pid)], env=env, timeout=120,
                              capture_output=True, text=True)
    supernode.wait()
    assert executor.returncode == 0, executor.stderr
    assert time.monotonic() - t0 < 60
    assert len(set(pids.read_text().split())) >= 2, executor.stderr  # died, was started again
    assert "the worker exited with 3" in executor.stderr


def test_the_polling_grid_collects_every_reply_and_stops_at_the_timeout():
    grid = create_autospec(Grid, instance=True)
    grid.push_messages.return_value = ["a", "b"]
    reply = {k: SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=k)) for k in "ab"}
    grid.pull_messages.side_effect = [[], [reply["b"]], [], [reply["a"]]]
    assert PollingGrid(grid, interval=0.0).send_and_receive(["msg a", "msg b"]) == [reply["b"], reply["a"]]
    assert grid.pull_messages.call_count == 4 and grid.push_messages.call_args.args == (["msg a", "msg b"],)
    grid.pull_messages.side_effect = None
    grid.pull_messages.return_value = []
    t0 = time.monotonic()
    assert PollingGrid(grid, interval=0.01).send_and_receive(["msg a"], timeout=0.2) == []
    assert 0.2 <= time.monotonic() - t0 < 5


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["subprocess", "process"])
def test_two_rounds_on_a_superlink_and_three_supernodes(tmp_path, cache_dir, isolation):
    cfg = build_config(
        {"name": "deploy", "seed": 5, "device": "cpu",
         "data": {"dataset": "digits-dg", "max_per_domain": 120, "cache_dir": str(cache_dir)},
         "split": {"target": "synth"}, "partition": {"kind": "by_domain", "num_clients": 3},
         "model": {"name": "cnn"}, "federation": {"rounds": 2, "batch_size": 32}, "optim": {"lr": 0.05}}
    )
    run_dir = tmp_path / "run"
    listeners: set[tuple[str, int]] = set()
    commands: set[str] = set()
    stop = threading.Event()
    dep = LocalDeployment(tmp_path / "deployment", 3, env={"OMP_NUM_THREADS": "1"}, isolation=isolation)

    def watch() -> None:  # sample the listeners and programs of every deployment process while it runs
        while not stop.is_set():
            pids = {pid for pid, _ in dep.snapshot()}
            listeners.update(listening_addresses(pids))
            commands.update(program(pid) for pid in pids)
            stop.wait(1.0)

    with dep:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            proc = dep.run(cfg, run_dir, timeout=540)
        finally:
            stop.set()
            watcher.join()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        left = dep.stop()
    assert left == set(), f"processes outlived the deployment: {left}"
    assert ("127.0.0.1", dep.port) in listeners and {("127.0.0.1", p) for p in dep.node_ports} <= listeners
    assert all(is_loopback(ip) for ip, _ in listeners), listeners
    assert "feddg round 2" in proc.stdout  # the ServerApp's log, streamed by `flwr run --stream`
    if isolation == "process":  # identify + 2 train messages per node, all in one warm worker per node
        assert "flwr-clientapp" not in commands, commands
        for p in range(3):
            log = (dep.workdir / f"executor-{p}.log").read_text()
            assert log.count("serving the SuperNode") == 1 and log.count("built the federation") == 1, log

    # the same experiment in-process, with as many threads as each ClientApp process had
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(cfg, tmp_path / "inprocess", progress=False)
    finally:
        torch.set_num_threads(before)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(r) for r in (tmp_path / "inprocess" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and [r["clients"] for r in rows] == [3, 3]
    assert [r["bytes_up"] for r in rows] == [r["bytes_up"] for r in ref]
    assert [r["train_loss"] for r in rows] == pytest.approx([r["train_loss"] for r in ref], rel=1e-5)
    w, w_ref = (load_checkpoint(d)["server_state"]["weights"] for d in (run_dir, tmp_path / "inprocess"))
    assert max(float(np.abs(w[k].astype(np.float64) - w_ref[k]).max()) for k in w) <= 1e-5
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds"] == 2 and results["target"] == ["synth"] and "ood_acc" in results["final"]
    assert (run_dir / "curves.png").is_file() and (run_dir / "config.yaml").is_file()
