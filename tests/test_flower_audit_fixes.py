"""Flower engine fixes from a deployment audit: a rolled-back round on Flower (it crashed the run; its nodes kept the
discarded client states), a reply whose .npy header claims more than it carries, SecAgg+ on a deployment's config,
one-line refusals of the run-config writer, the executor and the ServerApp, and (from a test audit) the executor's
restarts and shutdown, the worker's polling and task handling, and the launcher's and run marks' edge cases."""

import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SubStatus
from flwr.common.serde import context_from_proto
from flwr.supercore.task_identity import TaskIdentity
from test_flower import LoopbackGrid, server_config_text, toy_config, toy_federation_of
from test_flower_units import TaskRuntime, sent_message, supervise_on_a_fake_clock

from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.registry import METHODS
from feddg.config import SECAGG_NEEDS_FLOWER, build_config, load_config
from feddg.engines.flower import app, executor, launch, worker
from feddg.engines.flower.client import committed_state, make_client_app
from feddg.engines.flower.records import put_message
from feddg.engines.flower.server import collect, round_metrics, run_on_grid
from feddg.engines.inprocess import run_inprocess
from feddg.experiment import run_experiment
from feddg.federation.server import Server

CONFIGS = Path(__file__).parents[1] / "configs"


class CountingFlip(FedAvg):
    """FedAvg whose clients count their updates in their client state; client 3's round-3 reply has its classifier
    × −3: within the update-norm bound, but it explodes the holdout loss (docs/reliability.md, "Rollback")."""

    name = "countingflip"

    def client_update(self, model, msg, client_state, ctx):
        reply, _ = super().client_update(model, msg, client_state, ctx)
        if ctx.round == 3 and ctx.client_id == 3:
            reply["w/classifier.weight"] = -3 * reply["w/classifier.weight"]
        return reply, {"updates": int(client_state.get("updates", 0)) + 1}


@pytest.mark.parametrize("secure", [(), ("federation.engine=flower", "flower.secure_aggregation=secaggplus")],
                         ids=["plain", "secaggplus"])
@pytest.mark.usefixtures("task_identity")
def test_a_rolled_back_round_on_flower_keeps_the_previous_client_states_as_in_process(tmp_path, monkeypatch, secure):
    monkeypatch.setitem(METHODS, CountingFlip.name, CountingFlip)
    cfg = toy_config("method.name=countingflip", "federation.rounds=4", "federation.rollback_loss_factor=2", *secure)
    ref = Server(toy_federation_of(cfg), tmp_path / "inprocess")
    run_inprocess(ref)
    server = Server(toy_federation_of(cfg), tmp_path / "flower")
    grid = LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation_of), 4)
    run_on_grid(server, grid)  # the rolled-back row's bool crashed Flower's MetricRecord

    assert [r.get("rolled_back", False) for r in server.metrics] == [False, False, True, False]
    assert [r.get("rolled_back", False) for r in ref.metrics] == [False, False, True, False]
    nodes = {p: committed_state(context_from_proto(grid.contexts[1000 + p]).state, p, 4) for p in range(4)}
    assert {p: s["updates"] for p, s in nodes.items()} == {c: s["updates"] for c, s in ref.client_states.items()}
    assert all(s["updates"] == 3 for s in nodes.values())  # round 3's states were discarded


def test_a_rolled_back_rows_flag_reaches_flowers_metric_record_as_1():
    record = round_metrics({"round": 3, "train_loss": 0.5, "rolled_back": True, "rollback_reason": "NaN or Inf"})
    assert dict(record) == {"round": 3, "train_loss": 0.5, "rolled_back": 1} and type(record["rolled_back"]) is int


def npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def one_reply(data: bytes | None = None) -> tuple[dict[int, Message], list[Message]]:
    """What client 0 was sent and its reply, whose array ``w/x`` holds ``data`` as its .npy bytes."""
    sent = Message(RecordDict({"route": ConfigRecord({"client-id": 0})}), 1000, "train")
    sent.metadata.__dict__["_message_id"] = "m1"
    content = put_message(RecordDict(), {"w/x": np.zeros((2, 2), np.float32), "num_examples": 3})
    if data is not None:
        content.array_records["arrays"]["w/x"] = Array(dtype="float32", shape=(2, 2), stype="numpy.ndarray", data=data)
    return {0: sent}, [Message(content, reply_to=sent)]


@pytest.mark.parametrize(("data", "why"), [
    (npy_header((10**15,)) + bytes(16), r"declares shape \(1000000000000000,\) of float64 \(8000000000000000 bytes\), "
                                        "but 16 bytes follow it"),  # a MemoryError (8 PB) before
    (npy_header((2, 2), "<f4") + bytes(12), r"declares shape \(2, 2\) of float32 \(16 bytes\), but 12 bytes follow"),
])
@pytest.mark.usefixtures("task_identity")
def test_a_reply_whose_npy_header_claims_other_bytes_than_it_carries_fails_its_client(data, why):
    sent, replies = one_reply(data)
    got, failed = collect(sent, replies, 10)
    assert got == [] and list(failed) == [0]
    assert failed[0].startswith("node 1000: unreadable reply (ValueError: an array's .npy header")
    assert re.search(why, failed[0])


@pytest.mark.usefixtures("task_identity")
def test_a_reply_that_runs_out_of_memory_in_decoding_fails_its_client(monkeypatch):
    def too_big(records):
        raise MemoryError("Unable to allocate 7.11 PiB")

    monkeypatch.setattr("feddg.engines.flower.server.get_message", too_big)
    got, failed = collect(*one_reply(), 10)
    assert got == [] and failed == {0: "node 1000: unreadable reply (MemoryError: Unable to allocate 7.11 PiB)"}


@pytest.mark.usefixtures("task_identity")
def test_an_intact_reply_still_decodes():
    got, failed = collect(*one_reply(), 10)
    assert failed == {} and np.array_equal(got[0].message["w/x"], np.zeros((2, 2), np.float32))


def test_secaggplus_loads_with_a_deployments_config_and_feddg_run_in_process_refuses_it(tmp_path):
    # `feddg flower run configs/demo.yaml -o flower.secure_aggregation=secaggplus`: federation.engine is the default
    cfg = load_config(CONFIGS / "demo.yaml", ["flower.secure_aggregation=secaggplus"])
    assert cfg.federation.engine == "inprocess" and cfg.flower.secure_aggregation == "secaggplus"
    with pytest.raises(ValueError) as err:
        run_experiment(cfg, tmp_path / "run")
    assert str(err.value) == SECAGG_NEEDS_FLOWER and "\n" not in SECAGG_NEEDS_FLOWER
    assert not (tmp_path / "run").exists()
    # the method checks stay at load
    with pytest.raises(ValueError, match="secaggplus is for Flower runs of methods .* not local, which does not"):
        build_config({"method": {"name": "local"}, "flower": {"secure_aggregation": "secaggplus"}})


@pytest.mark.parametrize(("args", "error"), [
    (["{configs}/absent.yaml"], "error: config file not found: {configs}/absent.yaml"),
    (["{configs}/demo.yaml", "-o", "federation.roundz=2"],
     "error: federation.roundz: unknown key; did you mean federation.rounds?"),
])
def test_the_run_config_writer_refuses_bad_input_in_one_line(monkeypatch, capsys, args, error):
    monkeypatch.setattr(sys, "argv", ["app", *(a.format(configs=CONFIGS) for a in args)])
    with pytest.raises(SystemExit) as exit:
        app.cli()
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == "" and err == error.format(configs=CONFIGS) + "\n"


def test_the_executor_refuses_a_parent_pid_that_is_not_running(monkeypatch):
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(sys, "argv", ["executor", "--runtime-api-address", "127.0.0.1:9", "--insecure",
                                      "--parent-pid", str(gone.pid)])
    with pytest.raises(SystemExit, match=rf"^feddg executor: --parent-pid {gone.pid}: no such process"):
        executor.main()


def test_the_server_app_refuses_an_empty_config_in_one_line(tmp_path):
    used = tmp_path / "run"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    context = SimpleNamespace(run_config={"config": " \n", "run-dir": str(used), "resume": False})
    with pytest.raises(ValueError, match=r"^no experiment config: pass the YAML text as run config 'config'"):
        app.main(None, context)


def test_a_process_of_another_user_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    def kill(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")  # it runs, but is not ours to signal

    monkeypatch.setattr(executor.os, "kill", kill)
    assert executor.alive(1)


def test_the_executor_s_pause_doubles_up_to_a_minute(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ends = 2 + 4 + 8 + 16 + 32 + 60 + 1
    supervise_on_a_fake_clock(monkeypatch, 8 * [0.0], lambda clock, started: clock < ends)  # dies at once, 7 times
    pauses = [line.split("starts in ")[1] for line in capsys.readouterr().err.splitlines()]
    assert pauses == ["2 s", "4 s", "8 s", "16 s", "32 s", "60 s", "60 s"]


def test_the_executor_ends_its_worker_when_the_supernode_ends(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    clock, _, children = supervise_on_a_fake_clock(monkeypatch, [100.0], lambda clock, started: clock < 5.2)
    assert clock == 5.5 and [c.terminated for c in children] == [True]  # polled every 0.5 s
    assert capsys.readouterr().err == ""  # not restarted


def test_the_executor_ends_during_a_pause_when_the_supernode_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # pauses 2 s, then 4 s: the SuperNode ends in the second
    clock, _, children = supervise_on_a_fake_clock(monkeypatch, [0.0, 0.0, 100.0], lambda clock, started: clock < 3.2)
    assert clock == 3.5 and len(children) == 2 and not any(c.terminated for c in children)


@pytest.mark.parametrize(("status", "why"), [("failed", "run failed: ValueError: x"), ("stopped", "run stopped: by flwr stop"),
                                             ("completed", "run completed")])  # completed, but no results.json
def test_the_launcher_reports_a_settled_mark_without_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            status: str, why: str) -> None:
    app.mark(tmp_path, status, {"failed": "ValueError: x", "stopped": "by flwr stop"}.get(status, ""))
    monkeypatch.setattr(launch.time, "sleep", lambda s: pytest.fail("waited for a mark that had settled"))
    assert launch.settled_outcome(tmp_path, wait_s=30) == f"{tmp_path}: {why}"


def test_only_an_insecure_true_connection_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('[superlink.off]\naddress = "h:9093"\ninsecure = false\n'
                                          '[superlink.on]\naddress = "h:9093"\ninsecure = true\n')
    assert launch.insecure_warning("off") is None
    assert launch.insecure_warning("on") is not None


def test_a_connection_that_config_toml_does_not_name_is_refused_before_flwr_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flwr printed its own boxed error and feddg a second line; now one line names the connections there are."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "pyproject.toml").write_text("")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "flwr_command", lambda: "/opt/flwr")
    monkeypatch.setattr(launch.subprocess, "run", lambda argv: pytest.fail("flwr ran for an unknown connection"))
    (tmp_path / "config.toml").write_text('[superlink]\ndefault = "lab"\n[superlink.lab]\naddress = "h:9093"\n'
                                          '[superlink.local]\naddress = "127.0.0.1:9093"\n')
    with pytest.raises(ValueError) as err:
        launch.submit(build_config({}), tmp_path / "run", "nosuch", tmp_path / "app")
    assert str(err.value) == (f"--connection nosuch: {tmp_path / 'config.toml'} has no SuperLink connection of that "
                              "name (it has: lab, local); nothing was submitted")
    app_dir = tmp_path / "app"
    assert launch.unknown_connection("lab", app_dir) is None and launch.unknown_connection("local", app_dir) is None
    (app_dir / "pyproject.toml").write_text('[tool.flwr.federations.nosuch]\naddress = "h:9093"\n')
    assert launch.unknown_connection("nosuch", app_dir) is None  # flwr run moves legacy federations into config.toml
    (app_dir / "pyproject.toml").write_text("")
    (tmp_path / "config.toml").write_text("[superlink.lab\n")  # flwr reports a file that does not parse
    assert launch.unknown_connection("nosuch", app_dir) is None
    (tmp_path / "config.toml").unlink()  # and makes one that is absent
    assert launch.unknown_connection("nosuch", app_dir) is None


def test_a_run_mark_keeps_the_first_500_characters_of_the_error_on_one_line(tmp_path: Path) -> None:
    app.mark(tmp_path, "failed", "E" * 300 + "\n\n" + "F" * 300)
    assert json.loads((tmp_path / app.STATUS).read_text())["error"] == "E" * 300 + " " + "F" * 199


def test_the_run_config_carries_a_run_directory_with_characters_beyond_the_basic_plane(tmp_path: Path) -> None:
    run_dir = tmp_path / "Zürich 😀"  # JSON's ASCII escape of 😀 is a surrogate pair, which TOML refuses
    assert tomllib.loads(app.run_config_toml(build_config({}), run_dir))["run-dir"] == str(run_dir.resolve())


@pytest.mark.parametrize("code", [-2, 1])  # -2: flwr killed by SIGINT
def test_the_launcher_warns_of_an_insecure_connection_and_reports_flwr_s_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], code: int) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "pyproject.toml").write_text("")
    (tmp_path / "config.toml").write_text('[superlink.lab]\naddress = "h:9093"\ninsecure = true\n')
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "flwr_command", lambda: "/opt/flwr")
    monkeypatch.setattr(launch.subprocess, "run", lambda argv: SimpleNamespace(returncode=code))
    assert launch.submit(build_config({}), tmp_path / "run", "lab", tmp_path / "app") == f"`flwr run` exited with {code}"
    assert capsys.readouterr().err.startswith("feddg: warning: connection 'lab' is insecure (no TLS)")


def test_the_worker_polls_at_its_interval_and_runs_only_tasks_with_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    responses = [SimpleNamespace(HasField=lambda f: has, token=token) for has, token in
                 ((False, ""), (True, "t1"), (True, ""), (True, "t2"))]
    events: list[Any] = []

    def acquire(request: Any) -> SimpleNamespace:
        if not responses:
            raise InterruptedError  # ends serve's loop
        return responses.pop(0)

    monkeypatch.setattr(worker, "runtime_client", lambda address, ca: SimpleNamespace(AcquireTask=acquire))
    monkeypatch.setattr(worker, "run_task", lambda address, ca, token, apps: events.append((address, ca, token)))
    monkeypatch.setattr(worker.time, "sleep", events.append)
    with pytest.raises(InterruptedError):
        worker.serve("127.0.0.1:9", b"CA", 0.25)
    assert events == [0.25, ("127.0.0.1:9", b"CA", "t1"), 0.25, ("127.0.0.1:9", b"CA", "t2")]


def test_the_worker_ends_with_its_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    watched: list[int] = []
    monkeypatch.setattr(worker, "start_parent_process_monitor", watched.append)
    monkeypatch.setattr(worker, "warm_up", lambda: None)
    monkeypatch.setattr(worker, "serve", lambda *args: None)
    monkeypatch.setattr(sys, "argv", ["worker", "--runtime-api-address", "127.0.0.1:9", "--insecure", "--parent-pid", "42"])
    worker.main()
    assert watched == [42]


@pytest.mark.usefixtures("task_identity")
def test_a_worker_task_stops_its_heartbeat_before_it_reports_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    message = sent_message(0, 1000)
    TaskRuntime(monkeypatch, message, "h1")
    events: list[str] = []
    monkeypatch.setattr(worker, "HeartbeatSender", lambda fn: SimpleNamespace(
        start=lambda: events.append("start"), stop=lambda: events.append("stop"), is_running=True))
    monkeypatch.setattr(worker, "push_task_output", lambda client, context, sub_status, details: events.append(sub_status))

    def ok(message: Message, context: Context) -> Message:
        return Message(RecordDict(), reply_to=message)

    worker.run_task("127.0.0.1:9", None, "token", {"h1": ok})  # type: ignore[dict-item]
    assert events == ["start", "stop", SubStatus.COMPLETED]  # a beat after the end would SIGINT the worker


@pytest.mark.usefixtures("task_identity")
def test_a_pulled_task_s_message_gets_its_object_id_and_one_without_a_message_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    res = SimpleNamespace(task_id=5, run=SimpleNamespace(run_id=2), context=SimpleNamespace(node_id=1000), fab="fab")
    trees = [SimpleNamespace(object_id="obj-7")]
    client = SimpleNamespace(PullTaskInput=lambda request: res, PullObject=None, ConfirmMessageReceived=None,
                             PullMessages=lambda request: SimpleNamespace(messages_list=trees, message_object_trees=trees))
    pulls: list[dict[str, Any]] = []

    def inflate(tree: Any, pull: Any, confirm: Any, **kwargs: Any) -> Message:
        pulls.append(kwargs)
        return Message(RecordDict(), 1000, "train")  # as deflated: no message id

    monkeypatch.setattr(worker, "context_from_proto", lambda c: Context(run_id=2, node_id=c.node_id, node_config={},
                                                                         state=RecordDict(), run_config={}))
    monkeypatch.setattr(worker, "run_from_proto", lambda run: run)
    monkeypatch.setattr(worker, "fab_from_proto", lambda fab: fab)
    monkeypatch.setattr(worker, "make_pull_object_fn_protobuf", lambda *args: None)
    monkeypatch.setattr(worker, "make_confirm_message_received_fn_protobuf", lambda *args: None)
    monkeypatch.setattr(worker, "pull_and_inflate_object_from_tree", inflate)
    message, context, run, fab = worker.pull_task_input(client)  # type: ignore[arg-type]
    assert message.metadata.message_id == "obj-7" and (context.node_id, run, fab) == (1000, res.run, "fab")
    assert (TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id) == (5, 2, 1000)
    assert pulls == [{"return_type": Message, "initial_backoff": 0.05, "backoff_cap": 0.5, "max_tries_per_object": None}]
    trees.clear()
    with pytest.raises(RuntimeError, match="^No messages received from Runtime API$"):
        worker.pull_task_input(client)  # type: ignore[arg-type]
