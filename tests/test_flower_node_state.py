"""A node's client state on its own disk (``--node-config state-dir=DIR``): a Flower run resumed after a crash goes
on as the uninterrupted run, for every method, where before FedBN, FedRC and Local-only stopped (their clients' state
was gone) and SCAFFOLD, FedDG-GA, FedRobust, FedSR and MTGC went on from an empty one."""

from pathlib import Path

import numpy as np
import pytest
from test_flower import METHOD_OVERRIDES, NEEDS_CNN, LoopbackGrid, _untimed, server_config_text, toy_config
from test_flower import toy_federation_of as toy_federation
from test_flower_audit_fixes import CountingFlip
from toy_pixels import needs_masks, pixel_config, pixel_federation, registered

from feddg.algorithms.registry import METHODS, list_methods
from feddg.engines.flower.client import make_client_app
from feddg.engines.flower.node_state import NodeStateDir
from feddg.engines.flower.server import compact_ids, run_on_grid
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server

KEY = "0123456789abcdef"  # a run key as Server makes it


class Crash(Exception):
    """The ServerApp's process dies after a round that it did not checkpoint."""


def crash_after(round: int):
    def on_round(row):
        if row["round"] == round:
            raise Crash

    return on_round


@pytest.mark.parametrize("method", sorted(set(list_methods()) - NEEDS_CNN))
def test_every_method_resumed_on_flower_from_its_nodes_state_dirs_goes_on_as_the_uninterrupted_run(
        tmp_path, task_identity, method):
    # 6 engine rounds, checkpoints after rounds 3 and 6; the ServerApp dies after round 5: the nodes hold round-4 and
    # round-5 states that the resumed run (from round 3) must not use, and the round-3 ones that it must
    rounds = "federation.rounds=3" if method == "mtgc" else "federation.rounds=6"  # MTGC: 2 station rounds each
    overrides = [o for o in METHOD_OVERRIDES.get(method, []) if not o.startswith("federation.rounds=")]
    with registered():  # a method that needs dense masks runs on the pixel task
        dense = needs_masks(method)
        cfg = (pixel_config if dense else toy_config)(f"method.name={method}", rounds, "federation.checkpoint_every=3",
                                                      *overrides)
        factory = pixel_federation if dense else toy_federation
        ref = Server(factory(cfg), tmp_path / "ref")
        run_inprocess(ref)
        nodes = {"state-dir": str(tmp_path / "nodes")}
        first = Server(factory(cfg), tmp_path / "run")
        k = len(first.fed.clients)
        with pytest.raises(Crash):
            run_on_grid(first, LoopbackGrid(make_client_app(server_config_text(first), factory=factory), k,
                                            node_config=nodes), on_round=crash_after(5))
        resumed = Server(factory(cfg), tmp_path / "run", resume=True)
        assert resumed.round == 3 and resumed.run_key == first.run_key
        run_on_grid(resumed, LoopbackGrid(make_client_app(server_config_text(resumed), factory=factory), k,
                                          node_config=nodes))  # a new Flower run: fresh node Contexts
    assert _untimed(resumed.metrics) == _untimed(ref.metrics) and len(ref.metrics) == 6


@pytest.mark.parametrize("secure", [(), ("federation.engine=flower", "flower.secure_aggregation=secaggplus")],
                         ids=["plain", "secaggplus"])
@pytest.mark.usefixtures("task_identity")
def test_a_node_keeps_on_disk_the_states_of_the_commit_and_durable_rounds_and_never_a_rolled_back_one(
        tmp_path, monkeypatch, secure):
    # CountingFlip: each update counts itself in the client state; client 3 poisons round 3, which is rolled back
    monkeypatch.setitem(METHODS, CountingFlip.name, CountingFlip)
    cfg = toy_config("method.name=countingflip", "federation.rounds=4", "federation.rollback_loss_factor=2",
                     "federation.checkpoint_every=3", *secure)
    server = Server(toy_federation(cfg), tmp_path / "run")
    run_on_grid(server, LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation), 4,
                                     node_config={"state-dir": str(tmp_path / "nodes")}))
    assert [r.get("rolled_back", False) for r in server.metrics] == [False, False, True, False]
    assert server.commits == dict.fromkeys(range(4), 4)
    for cid in range(4):
        store = NodeStateDir(tmp_path / "nodes", server.run_key, cid)
        # round 4 was sent with commit round 2 (round 3 rolled back) and durable round 0 (no checkpoint yet)
        assert sorted(p.name for p in store.folder.iterdir()) == ["round-2.pb", "round-4.pb"]
        assert store.load(2) == {"updates": 2} and store.load(4) == {"updates": 3}


def test_a_state_crosses_the_disk_with_its_dtypes_shapes_and_scalars(tmp_path: Path) -> None:
    store = NodeStateDir(tmp_path, KEY, 3)
    state = {"c/w": np.arange(6, dtype=np.float16).reshape(2, 3), "n": np.array(7, dtype=np.int64),
             "empty": np.zeros((0, 4), np.float32), "steps": 12, "lr": 0.25, "style": "feature"}
    store.save(5, state)
    assert store.path(5) == tmp_path / KEY / "client-3" / "round-5.pb"
    back = store.load(5)
    assert back.keys() == state.keys() and back["steps"] == 12 and back["lr"] == 0.25 and back["style"] == "feature"
    for key in ("c/w", "n", "empty"):
        assert back[key].dtype == state[key].dtype and back[key].shape == state[key].shape
        assert np.array_equal(back[key], state[key])
    assert [p.name for p in store.folder.iterdir()] == ["round-5.pb"]  # no temporary file left
    assert store.path(5).stat().st_mode & 0o777 == 0o600  # the client's state: readable by the node's user only


def test_a_missing_state_is_none_before_any_round_and_one_line_after_a_commit(tmp_path: Path) -> None:
    store = NodeStateDir(tmp_path, KEY, 0)
    assert store.load(0) == {}  # no setup exchange, no accepted update yet
    with pytest.raises(FileNotFoundError, match=r"^the client state of round 4 is not in .*client-0 \(the server "
                                                r"folded that round's reply in\): this node's state-dir lost it$"):
        store.load(4)


def test_keep_only_removes_every_other_round(tmp_path: Path) -> None:
    store = NodeStateDir(tmp_path, KEY, 1)
    for r in (0, 2, 3, 5, 11):
        store.save(r, {"r": r})
    (store.folder / "round-x.pb").write_text("an operator's")
    store.keep_only({2, 5})
    assert sorted(p.name for p in store.folder.iterdir()) == ["round-2.pb", "round-5.pb", "round-x.pb"]
    assert NodeStateDir(tmp_path, "fedcba9876543210", 1).folder != store.folder  # another run's states are apart


@pytest.mark.parametrize("key", ["../../etc", "0123456789ABCDEF", "0123456789abcdef/..", ""])
def test_a_run_key_that_is_not_16_hex_digits_names_no_folder(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match=r"^run-key '.*' is not a run key \(16 hex digits\)$"):
        NodeStateDir(tmp_path / "nodes", key, 0)  # a server's route must not reach beyond the node's state-dir
    assert not (tmp_path / "nodes").exists()


@pytest.mark.parametrize(("ids", "text"), [([0, 1, 2, 3], "0-3"), ([0, 2, 3, 4, 9], "0, 2-4, 9"), ([5], "5")])
def test_client_ids_are_named_in_ranges(ids: list[int], text: str) -> None:
    assert compact_ids(ids) == text


def test_a_resume_whose_nodes_keep_state_dirs_warns_of_nothing(tmp_path, task_identity, caplog) -> None:
    cfg = toy_config()
    nodes = {"state-dir": str(tmp_path / "nodes")}
    first = Server(toy_federation(cfg), tmp_path / "run")
    with pytest.raises(Crash):
        run_on_grid(first, LoopbackGrid(make_client_app(server_config_text(first), factory=toy_federation), 4,
                                        node_config=nodes), on_round=crash_after(1))
    resumed = Server(toy_federation(cfg), tmp_path / "run", resume=True)
    run_on_grid(resumed, LoopbackGrid(make_client_app(server_config_text(resumed), factory=toy_federation), 4,
                                      node_config=nodes))
    assert resumed.round == 3 and not [r for r in caplog.records if "resumed after round" in r.getMessage()]


def test_a_node_that_lost_its_client_state_fails_that_client_in_one_line(tmp_path, task_identity) -> None:
    cfg = toy_config("method.name=scaffold", "optim.momentum=0")
    nodes = {"state-dir": str(tmp_path / "nodes")}
    first = Server(toy_federation(cfg), tmp_path / "run")
    with pytest.raises(Crash):
        run_on_grid(first, LoopbackGrid(make_client_app(server_config_text(first), factory=toy_federation), 4,
                                        node_config=nodes), on_round=crash_after(1))
    lost = NodeStateDir(tmp_path / "nodes", first.run_key, 2)
    lost.path(1).unlink()  # client 2's node lost its disk
    resumed = Server(toy_federation(cfg), tmp_path / "run", resume=True)
    run_on_grid(resumed, LoopbackGrid(make_client_app(server_config_text(resumed), factory=toy_federation), 4,
                                      node_config=nodes))
    why = {"2": f"node 1002: FileNotFoundError: the client state of round 1 is not in {lost.folder} (the server "
                "folded that round's reply in): this node's state-dir lost it"}
    # no guess from an empty state: the client stays out, round after round, and the others go on
    assert [r.get("clients_failed_reasons") for r in resumed.metrics] == [None, why, why]
