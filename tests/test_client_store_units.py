"""The client store and its spill files unit by unit, against hand-computed byte layouts, file names, versions and
file lifetimes (tests/test_client_store.py runs them inside federations)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from feddg.federation.client_store import ClientStores, StoreRef
from feddg.federation.spill import MAP_FROM_BYTES, ArraySpec, write_entry
from feddg.messages import Value


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _array(msg: Mapping[str, Value], key: str) -> np.ndarray:
    value = msg[key]
    assert isinstance(value, np.ndarray)
    return value


def test_a_spill_file_holds_each_array_at_a_64_byte_offset_zero_padded(tmp_path: Path) -> None:
    a, b, c = np.array([1, 2, 3], np.uint8), np.arange(70, dtype=np.int8), np.array([2.5])
    rec = write_entry(tmp_path / "e.npy", {"a": a, "s": 1.5, "b": b, "c": c}, {})
    # 3 -> 64, 70 -> 128, 8 -> 64 bytes: offsets 0, 64, 192; 256 bytes in all
    assert rec.fields == (("a", ArraySpec(a.dtype, (3,), 0)), ("s", None), ("b", ArraySpec(b.dtype, (70,), 64)),
                          ("c", ArraySpec(c.dtype, (1,), 192)))
    assert (rec.file, rec.scalars, rec.nbytes) == ("e.npy", (1.5,), 256)
    raw = (tmp_path / "e.npy").read_bytes()
    header = len(raw) - 256
    assert header % 64 == 0 and np.load(tmp_path / "e.npy").shape == (256,)  # a 64-aligned .npy header
    data = raw[header:]
    assert data == a.tobytes() + bytes(61) + b.tobytes() + bytes(58) + c.tobytes() + bytes(56)


def test_a_spill_file_is_write_once(tmp_path: Path) -> None:
    write_entry(tmp_path / "e.npy", {"w": np.ones(4, np.float32)}, {})
    before = (tmp_path / "e.npy").read_bytes()
    with pytest.raises(FileExistsError):
        write_entry(tmp_path / "e.npy", {"w": np.zeros(4, np.float32)}, {})
    assert (tmp_path / "e.npy").read_bytes() == before


def test_entries_of_one_layout_share_one_fields_tuple(tmp_path: Path) -> None:
    layouts: dict = {}
    one = write_entry(tmp_path / "1.npy", {"w": np.ones(4, np.float32), "n": 1}, layouts)
    two = write_entry(tmp_path / "2.npy", {"w": np.zeros(4, np.float32), "n": 2}, layouts)
    other = write_entry(tmp_path / "3.npy", {"w": np.zeros(5, np.float32), "n": 2}, layouts)
    assert one.fields is two.fields and other.fields is not one.fields and len(layouts) == 2


def test_entries_are_mapped_from_exactly_map_from_bytes_padding_included(tmp_path: Path) -> None:
    store = ClientStores(tmp_path, budget_bytes=0).open("s")
    # 65472 + 1 array bytes, padded 65472 + 64 = MAP_FROM_BYTES: mapped; one 64-byte block less: read into RAM
    store[0] = {"w": np.arange(MAP_FROM_BYTES // 4 - 16, dtype=np.float32), "b": np.array([7], np.uint8)}
    store[1] = {"w": np.arange(MAP_FROM_BYTES // 4 - 16, dtype=np.float32)}
    mapped, in_ram = store[0], store[1]
    for msg in (mapped, in_ram):  # plain arrays either way (a memmap pickles as a map)
        assert all(type(v) is np.ndarray for v in msg.values())
    assert isinstance(_array(mapped, "w").base, np.memmap) and not isinstance(_array(in_ram, "w").base, np.memmap)
    np.testing.assert_array_equal(mapped["w"], np.arange(16368))
    assert _array(mapped, "b").tolist() == [7]


def test_a_deep_copy_owns_its_in_ram_arrays(tmp_path: Path) -> None:
    store = ClientStores(tmp_path, budget_bytes=None).open("s")
    store[0] = {"w": np.arange(4, dtype=np.float32)}
    twin = copy.deepcopy(store)
    _array(store[0], "w")[0] = 99  # an in-RAM read shares the stored array: this changes the original only
    assert _array(store[0], "w")[0] == 99 and _array(twin[0], "w").tolist() == [0, 1, 2, 3]


def test_changing_a_read_message_changes_nothing_in_the_store(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=None)
    store = stores.open("s")
    store[0] = {"w": np.zeros(4, np.float32), "n": 1}
    read = store[0]
    read["n"], read["extra"] = 2, np.zeros(100, np.float32)
    assert list(store[0]) == ["w", "n"] and store[0]["n"] == 1
    assert stores.ram_bytes == 1 + 16 + 1 + 8  # key bytes, array bytes, 8 for a number


def test_detach_and_attach_keep_dicts_lists_and_tuples(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=None)
    s, t = stores.open("s"), stores.open("t")
    tree = {"a": (s, [t, 1]), "b": [(2, s)], "c": "x"}
    ref_s, ref_t = StoreRef("s"), StoreRef("t")
    detached = stores.detach(tree)
    assert detached == {"a": (ref_s, [ref_t, 1]), "b": [(2, ref_s)], "c": "x"}  # a tuple never equals a list
    back = stores.attach(detached)
    assert type(back["a"]) is tuple and type(back["a"][1]) is list and type(back["b"][0]) is tuple
    assert back["a"][0] is s and back["a"][1][0] is t and back["b"][0][1] is s and back["c"] == "x"


def test_a_restored_store_continues_the_version_counter_of_its_index(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=0)
    store = stores.open("s")
    store[0], store[1] = {"w": np.ones(2)}, {"w": np.zeros(2)}
    del store[1]  # v1's file goes: only the index remembers that v1 was used
    index = stores.index()
    stores.saved(index)
    assert _files(tmp_path) == ["s-0-v0.npy"] and index["version"] == 2
    restored = ClientStores(tmp_path, budget_bytes=0, index=index)
    restored.stores["s"][5] = {"w": np.ones(2)}
    assert _files(tmp_path) == ["s-0-v0.npy", "s-5-v2.npy"]  # v1 is not named again


def test_saved_keeps_a_file_written_after_its_index(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=0)
    store = stores.open("s")
    store[0] = {"w": np.ones(2)}
    index = stores.index()
    store[1] = {"w": np.full(2, 3.0)}  # the live store names s-1-v1.npy, the checkpoint does not
    stores.saved(index)
    assert _files(tmp_path) == ["s-0-v0.npy", "s-1-v1.npy"] and _array(store[1], "w").tolist() == [3.0, 3.0]


def test_a_restored_spilled_entry_replaced_loses_its_file_once_two_checkpoints_pass(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=0)
    stores.open("s")[0] = {"w": np.ones(2)}
    index = stores.index()
    stores.saved(index)
    restored = ClientStores(tmp_path, budget_bytes=0, index=index)
    assert dict(restored.refs) == {"s-0-v0.npy": 1}
    restored.stores["s"][0] = {"w": np.zeros(2)}  # v0 stays: the checkpoint resumed from names it
    assert dict(restored.refs) == {"s-0-v1.npy": 1} and _files(tmp_path) == ["s-0-v0.npy", "s-0-v1.npy"]
    for _ in range(2):
        restored.saved(restored.index())
    assert _files(tmp_path) == ["s-0-v1.npy"]  # named by neither the store nor the last two checkpoints


def test_repr_counts_the_entries_on_disk(tmp_path: Path) -> None:
    stores = ClientStores(tmp_path, budget_bytes=17)  # "w" + 2 float64: one entry fits
    store = stores.open("s")
    for cid in range(3):
        store[cid] = {"w": np.full(2, cid)}
    assert repr(store) == "ClientStore('s': 3 clients, 2 on disk)"
