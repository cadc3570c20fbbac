"""The client store (issue 13): per-client state in RAM up to a budget, past it in write-once memory-mapped files;
a run is bit-identical whatever the budget and resumes exactly, also from the previous checkpoint."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
from toy import toy_federation

from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.checkpoint import (
    CHECKPOINT,
    PREVIOUS,
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from feddg.federation.client_store import STORE_DIR, ClientStore, ClientStores, restore, spilled_files
from feddg.federation.server import Server
from feddg.federation.spill import MAP_FROM_BYTES
from feddg.messages import message_nbytes

LOCAL = ("method.name=local", "partition.num_clients=4")
SPILL_ALL = "federation.client_state_budget_mb=0"


def _message() -> dict:
    nan_payload = np.array([0x7FF0000000000123, 0x8000000000000000], np.uint64).view(np.float64)  # NaN bits, -0.0
    return {
        "w/f16": np.arange(7, dtype=np.float16) / 3, "w/f32": np.linspace(-1, 1, 9, dtype=np.float32),
        "f64": np.concatenate([nan_payload, [np.inf, 5e-324]]), "i8": np.array([-128, 127], np.int8),
        "u64": np.array([2**64 - 1], np.uint64), "bool": np.array([True, False]),
        "c64": np.array([1 + 2j], np.complex64), "scalar-array": np.array(3, np.int64),
        "empty": np.zeros((0, 3), np.float32), "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        "strided": np.arange(20, dtype=np.int32)[::3], "big-endian": np.arange(5, dtype=">f4"),
        "text": np.array(["ab", "c"]), "record": np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
        "int": 3, "float": 0.1, "str": "x", "np.float32": np.float32(1.5), "np.int64": np.int64(-7),
    }


def _assert_same(a, b) -> None:
    """Same keys in the same order, same dtypes, shapes and bytes; scalars of the same type and value."""
    assert list(a) == list(b)
    for k, v in a.items():
        if isinstance(v, np.ndarray):
            assert (b[k].dtype, b[k].shape, b[k].tobytes()) == (v.dtype, v.shape, v.tobytes()), k
        else:
            assert type(b[k]) is type(v) and b[k] == v, k


def _mapped(a: np.ndarray) -> bool:
    while a is not None and not isinstance(a, np.memmap):
        a = getattr(a, "base", None)
    return a is not None


def test_entries_round_trip_bit_exactly_through_their_files(tmp_path):
    msg = _message()
    big = {**msg, "w/big": np.arange(MAP_FROM_BYTES, dtype=np.float32)}
    store = ClientStores(tmp_path, budget_bytes=0).open("s")
    store[0], store[1] = msg, big
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-0-v0.npy", "s-1-v1.npy"]  # nothing stayed in RAM
    small, mapped = store[0], store[1]
    _assert_same(msg, small)
    _assert_same(big, mapped)
    assert _mapped(mapped["w/big"]) and not _mapped(small["w/f32"])  # small entries are read into RAM
    mapped["w/big"][0], small["w/f32"][0] = -1, -1  # a read message is a copy: the files do not change
    _assert_same(msg, store[0])
    _assert_same(big, store[1])
    kept = ClientStores(tmp_path / "ram", budget_bytes=None).open("s")
    kept[0] = store[1]  # writing back copies out of the map
    assert not _mapped(kept[0]["w/big"])
    _assert_same(big, kept[0])


def test_the_least_recently_used_entries_spill_and_ram_stays_within_the_budget(tmp_path):
    size = message_nbytes({"w": np.zeros(1000, np.float32)})
    stores = ClientStores(tmp_path, budget_bytes=3 * size)
    a, b = stores.open("a"), stores.open("b")
    for cid in range(4):
        a[cid], b[cid] = {"w": np.full(1000, cid, np.float32)}, {"w": np.full(1000, -cid, np.float32)}
        assert stores.ram_bytes <= 3 * size
    assert list(stores.lru) == [("b", 2), ("a", 3), ("b", 3)]  # the three most recently written, across stores
    assert stores.ram_bytes == 3 * size
    assert a[2]["w"][0] == 2 and b[0]["w"][0] == 0  # spilled entries read back
    b[2]  # a read makes b[2] the most recently used: a[3] is the next to go
    a[9] = {"w": np.zeros(1000, np.float32)}
    assert list(stores.lru) == [("b", 3), ("b", 2), ("a", 9)]
    files = {p.name for p in tmp_path.iterdir()}
    assert len(files) == 8 - 3 + 1 and "a-3-v5.npy" in files
    a[0] = {"w": np.ones(1000, np.float32)}  # replaces a spilled entry: its file goes (no checkpoint names it)
    del a[1]
    gone = files - {p.name for p in tmp_path.iterdir()}
    assert gone == {"a-0-v0.npy", "a-1-v2.npy"}
    assert list(a) == [0, 2, 3, 9] and 1 not in a  # dict order: a replaced key keeps its place
    assert stores.ram_bytes == sum(stores.lru.values()) <= 3 * size
    in_ram = list(stores.lru)
    a[10] = {"w": np.zeros(4 * 1000, np.float32)}  # larger than the whole budget: straight to disk, nothing evicted
    assert list(stores.lru) == in_ram and "a-10-v7.npy" in {p.name for p in tmp_path.iterdir()}


def test_an_entry_of_exactly_the_budget_stays_in_ram(tmp_path: Path) -> None:
    # {"w": 1000 float32}: 1 key byte + 4000 array bytes, the whole budget: within it, so no file is written
    stores = ClientStores(tmp_path / "s", budget_bytes=4001)
    stores.open("s")[0] = {"w": np.zeros(1000, np.float32)}
    assert list(stores.lru.items()) == [(("s", 0), 4001)] and stores.ram_bytes == 4001
    assert not (tmp_path / "s").exists()


def test_a_deep_copy_shares_spilled_files_and_keeps_them_when_the_original_moves_on(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=0)
    store = stores.open("s")
    store[0] = {"w": np.arange(4, dtype=np.float32)}
    twin = copy.deepcopy(store)
    assert twin.name == "s.1" and stores.refs["s-0-v0.npy"] == 2  # one file, named by both
    store[0] = {"w": np.zeros(4, np.float32)}  # the original lets go of its file: the copy still names it
    np.testing.assert_array_equal(twin[0]["w"], [0, 1, 2, 3])
    del twin[0]  # the last reference: now the file goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-0-v1.npy"]


def test_unlimited_never_spills_and_bad_input_is_one_line(tmp_path):
    stores = ClientStores(tmp_path / "never", budget_bytes=None)
    store = stores.open("s")
    for cid in range(50):
        store[cid] = {"w": np.zeros(10_000, np.float32)}
    assert not (tmp_path / "never").exists() and len(stores.lru) == 50
    with pytest.raises(TypeError, match=r"^client store 's', client 0\['x'\] has type list"):
        store[0] = {"x": [1, 2]}
    with pytest.raises(ValueError, match="not an identifier"):
        stores.open("a/b")
    with pytest.raises(ValueError, match=">= 0 bytes"):
        ClientStores(tmp_path, budget_bytes=-1)
    with pytest.raises(TypeError, match="ClientStores.detach"):
        pickle.dumps(store)


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def _assert_same_run(a: Server, b: Server) -> None:
    """Same metrics (times aside), the same bits in every client's evaluated model and client state."""
    assert _strip(a.metrics) == _strip(b.metrics)
    method, clients = a.fed.method, range(len(a.fed.clients))
    for cid in [None, *clients]:
        _assert_same(method.eval_weights(a.state, cid), method.eval_weights(b.state, cid))
    assert list(a.client_states) == list(b.client_states)
    for cid in a.client_states:
        _assert_same(a.client_states[cid], b.client_states[cid])


@pytest.mark.parametrize("method", [("method.name=local",), ("method.name=pfedhn",), ("method.name=scaffold", "optim.momentum=0"),
                                    ("method.name=fedfa", "method.params.stages=[conv, bn]")])
def test_everything_spilled_gives_the_bits_of_everything_in_ram(tmp_path, method):
    over = ("partition.num_clients=4", "federation.rounds=2", *method)  # round 2 reads what round 1 spilled
    ram = Server(toy_federation(*over, "federation.client_state_budget_mb=null"), tmp_path / "ram")
    disk = Server(toy_federation(*over, SPILL_ALL), tmp_path / "disk")
    for server in (ram, disk):
        run_inprocess(server)
    assert ram.stores.ram_bytes > 0 and not (tmp_path / "ram" / STORE_DIR).exists()
    assert disk.stores.ram_bytes == 0 and len(list((tmp_path / "disk" / STORE_DIR).iterdir())) >= 3
    _assert_same_run(ram, disk)


class Killed(Exception):
    """The process dies: nothing after this point happens."""


def _kill() -> None:
    raise Killed


def test_a_run_killed_after_its_store_changed_resumes_bit_identically(tmp_path):
    over = (*LOCAL, "federation.rounds=4", SPILL_ALL)
    full = Server(toy_federation(*over), tmp_path / "full")
    run_inprocess(full)
    crashed = Server(toy_federation(*over), tmp_path / "crash")
    crashed.mark_setup_done()
    for r in (1, 2):
        run_round(crashed, r)
    crashed.checkpoint = _kill  # round 3 re-spills every client's entries, then dies before its checkpoint
    with pytest.raises(Killed):
        run_round(crashed, 3)
    resumed = Server(toy_federation(*over), tmp_path / "crash", resume=True)
    assert resumed.round == 2
    run_inprocess(resumed)
    _assert_same_run(full, resumed)


def test_a_corrupt_latest_checkpoint_falls_back_and_resumes_identically(tmp_path):
    over = (*LOCAL, "federation.rounds=4", SPILL_ALL)
    full = Server(toy_federation(*over), tmp_path / "full")
    run_inprocess(full)
    run = tmp_path / "crash"
    crashed = Server(toy_federation(*over), run)
    crashed.mark_setup_done()
    for r in (1, 2, 3):
        run_round(crashed, r)
    second, third = (spilled_files(read_checkpoint(run / f)["client_store"]) for f in (PREVIOUS, CHECKPOINT))
    assert second and not second & third  # round 3 wrote every entry anew: round 2's files are its own
    data = (run / CHECKPOINT).read_bytes()
    (run / CHECKPOINT).write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    with pytest.warns(CheckpointWarning):
        resumed = Server(toy_federation(*over), run, resume=True)
    assert resumed.round == 2
    run_inprocess(resumed)
    _assert_same_run(full, resumed)


def test_files_live_as_long_as_the_store_or_one_of_the_last_two_checkpoints_names_them(tmp_path):
    over = (*LOCAL, "federation.rounds=4", SPILL_ALL)
    run = tmp_path / "run"
    server = Server(toy_federation(*over), run)
    server.mark_setup_done()
    named: list[set[str]] = []
    for r in (1, 2, 3):
        run_round(server, r)
        named.append(spilled_files(load_checkpoint(run)["client_store"]))
        on_disk = {p.name for p in (run / STORE_DIR).iterdir()}
        assert on_disk == named[-1] | (named[-2] if r > 1 else set())  # round r - 2's files are gone
    (run / STORE_DIR / "clients-0-v999.npy").write_bytes(b"left by a killed process")
    resumed = Server(toy_federation(*over), run, resume=True)
    run_round(resumed, 4)
    on_disk = {p.name for p in (run / STORE_DIR).iterdir()}
    assert "clients-0-v999.npy" not in on_disk and on_disk == spilled_files(load_checkpoint(run)["client_store"]) | named[-1]
    assert min(int(n.split("-v")[1][:-4]) for n in on_disk - named[-1]) > 999  # a crashed run's names are not reused


def test_a_missing_store_file_is_one_error_at_resume(tmp_path):
    run = tmp_path / "run"
    server = Server(toy_federation(*LOCAL, SPILL_ALL), run)
    server.mark_setup_done()
    run_round(server, 1)
    lost = sorted(spilled_files(load_checkpoint(run)["client_store"]))[0]
    (run / STORE_DIR / lost).unlink()
    with pytest.raises(CheckpointError, match=f"^the checkpoint names 1 client-store files missing .*first: {lost}"):
        Server(toy_federation(*LOCAL, SPILL_ALL), run, resume=True)


def test_a_checkpoint_from_before_the_store_still_resumes(tmp_path):
    over = (*LOCAL, "federation.rounds=3")
    full = Server(toy_federation(*over), tmp_path / "full")
    run_inprocess(full)
    run = tmp_path / "old"
    old = Server(toy_federation(*over, "federation.client_state_budget_mb=null"), run)
    old.mark_setup_done()
    for r in (1, 2):
        run_round(old, r)
    ckpt = load_checkpoint(run)
    _, state, states = restore(ckpt, run)
    state["clients"] = dict(state["clients"].items())
    (run / CHECKPOINT).unlink()
    (run / PREVIOUS).unlink()
    save_checkpoint(run, {k: v for k, v in ckpt.items() if k != "client_store"}  # the format before the store
                    | {"server_state": state, "client_states": dict(states.items())})
    resumed = Server(toy_federation(*over, SPILL_ALL), run, resume=True)
    assert resumed.round == 2 and isinstance(resumed.client_states, ClientStore) and len(resumed.client_states) == 4
    run_inprocess(resumed)
    _assert_same_run(full, resumed)
