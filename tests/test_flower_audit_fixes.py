"""Flower engine fixes from a deployment audit: a rolled-back round on Flower (it crashed the run; its nodes kept the
discarded client states), a reply whose .npy header claims more than it carries, SecAgg+ on a deployment's config,
and one-line refusals of the run-config writer, the executor and the ServerApp."""

import io
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ConfigRecord, Message, RecordDict
from flwr.common.serde import context_from_proto
from test_flower import LoopbackGrid, server_config_text, toy_config, toy_federation_of

from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.registry import METHODS
from feddg.config import SECAGG_NEEDS_FLOWER, build_config, load_config
from feddg.engines.flower import app, executor
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
    (["{configs}/demo.yaml", "-o", "federation.roundz=2"], "error: federation.roundz: unknown key"),
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
