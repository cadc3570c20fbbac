"""Checkpoints: two kept, verified on load, a damaged latest falls back to the previous one."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from feddg.federation.checkpoint import (
    CHECKPOINT,
    PREVIOUS,
    CheckpointError,
    CheckpointWarning,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _save_two(run_dir) -> None:
    for r in (1, 2):
        save_checkpoint(run_dir, {"round": r, "w": np.full(1000, r, dtype=np.float32)})


def test_the_last_two_are_kept_and_the_latest_is_loaded(tmp_path):
    assert load_checkpoint(tmp_path) is None and not has_checkpoint(tmp_path)
    _save_two(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [PREVIOUS, CHECKPOINT]
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["round"] == 2 and np.array_equal(ckpt["w"], np.full(1000, 2, dtype=np.float32))


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "garbage", "delete"])
def test_a_damaged_latest_falls_back_to_the_previous_with_a_warning(tmp_path, damage):
    _save_two(tmp_path)
    latest = tmp_path / CHECKPOINT
    data = latest.read_bytes()
    if damage == "truncate":
        latest.write_bytes(data[: len(data) // 2])
    elif damage == "flip a byte":
        latest.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif damage == "garbage":
        latest.write_bytes(b"\x00" * 64)
    else:
        latest.unlink()  # a crash between the two renames of a rotation
        assert has_checkpoint(tmp_path)  # the previous alone is something to resume (feddg resume refuses none)
    with pytest.warns(CheckpointWarning) as record:
        ckpt = load_checkpoint(tmp_path)
    assert ckpt["round"] == 1
    msg = str(record[0].message)
    assert str(latest) in msg and str(tmp_path / PREVIOUS) in msg and "\n" not in msg


def test_no_readable_checkpoint_is_one_error_naming_every_file(tmp_path):
    save_checkpoint(tmp_path, {"round": 1})
    latest = tmp_path / CHECKPOINT
    latest.write_bytes(latest.read_bytes()[:-10])  # a truncated single checkpoint is detected
    with pytest.raises(CheckpointError, match="damaged") as err:
        load_checkpoint(tmp_path)
    assert str(latest) in str(err.value)
    _save_two(tmp_path)
    for name in (CHECKPOINT, PREVIOUS):
        (tmp_path / name).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert str(latest) in str(err.value) and str(tmp_path / PREVIOUS) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_plain_torch_archive_from_before_digests_still_loads(tmp_path):
    torch.save({"round": 7}, tmp_path / CHECKPOINT)
    assert load_checkpoint(tmp_path) == {"round": 7}
    (tmp_path / CHECKPOINT).write_bytes((tmp_path / CHECKPOINT).read_bytes()[:40])
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(tmp_path)


def test_a_failed_write_leaves_the_latest_and_previous_intact_and_no_temporary_file(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _save_two(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in (CHECKPOINT, PREVIOUS)}

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)  # the write of round 3 cannot reach the disk
    with pytest.raises(OSError, match="previous checkpoint is intact") as err:
        save_checkpoint(tmp_path, {"round": 3, "w": np.full(1000, 3, dtype=np.float32)})
    assert err.value.errno == errno.ENOSPC and str(tmp_path / CHECKPOINT) in str(err.value)
    monkeypatch.undo()
    # the files are byte for byte what rounds 2 and 1 wrote, and nothing else is left in the run directory
    assert sorted(p.name for p in tmp_path.iterdir()) == [PREVIOUS, CHECKPOINT]
    assert {name: (tmp_path / name).read_bytes() for name in (CHECKPOINT, PREVIOUS)} == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the latest loads, no fallback
        ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt["round"] == 2
