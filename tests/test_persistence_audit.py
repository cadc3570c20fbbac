"""Run persistence pinned where a mutation audit found it untested: checkpoint durability (the fsyncs, the file
descriptors, directories that cannot be synced), the reasons a checkpoint is refused, provenance.json's hash
excludes, input stamps, resume records and git state, and a few edges of integrity.py and rounds.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

import feddg
from feddg.algorithms.base import Reply
from feddg.config import build_config, dump_config
from feddg.federation import provenance
from feddg.federation.checkpoint import (
    CHECKPOINT,
    PREVIOUS,
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from feddg.federation.integrity import NormBound, cap_examples, robust_problem, robust_replies, weights_norm
from feddg.federation.rounds import round_half_up, sample_members

# --- checkpoint.py ---------------------------------------------------------------------------------------------------


def test_save_fsyncs_the_whole_file_then_the_directory_and_returns_the_latest(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is fsynced with every byte handed to the OS (flushed first), the directory after the renames."""
    real_fsync = os.fsync
    synced: list[tuple[bool, int, int]] = []  # (is a directory, inode, size) at each fsync

    def recording_fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((stat.S_ISDIR(st.st_mode), st.st_ino, st.st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    latest = save_checkpoint(tmp_path, {"round": 1})  # small: all of it sits in Python's write buffer until flushed
    monkeypatch.undo()
    assert latest == tmp_path / CHECKPOINT
    size = latest.stat().st_size
    assert [(d, s) for d, _, s in synced[:1]] == [(False, size)]  # the checkpoint file, complete
    assert synced[1:] and synced[-1][:2] == (True, tmp_path.stat().st_ino)  # then the run directory


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd to count open descriptors")
def test_save_leaves_no_file_descriptor_open(tmp_path: Path) -> None:
    """The directory opened to fsync the renames is closed again: a long run saves many checkpoints."""
    save_checkpoint(tmp_path, {"round": 0})  # first use: whatever torch opens once
    before = len(os.listdir("/proc/self/fd"))
    for r in range(1, 6):
        save_checkpoint(tmp_path, {"round": r})
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_directory_that_cannot_be_opened_or_synced_does_not_fail_the_save(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """_fsync_dir is a no-op where directories cannot be opened, and ignores a directory fsync the platform refuses."""
    real_open, real_fsync = os.open, os.fsync

    def open_no_dirs(path: str | os.PathLike[str], flags: int, *args: int, **kwargs: int) -> int:
        if Path(path).is_dir():
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_no_dirs)
    save_checkpoint(tmp_path, {"round": 1})
    monkeypatch.setattr(os, "open", real_open)

    def fsync_no_dirs(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_no_dirs)
    save_checkpoint(tmp_path, {"round": 2})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path) == {"round": 2} and read_checkpoint(tmp_path / PREVIOUS) == {"round": 1}


def test_a_checkpoint_whose_file_cannot_even_be_created_names_the_path(tmp_path: Path) -> None:
    """When the temporary file was never created (here: no run directory) the error is still the one that names
    the checkpoint, not a failure to clean up."""
    gone = tmp_path / "gone"
    with pytest.raises(OSError, match="while writing the checkpoint") as err:
        save_checkpoint(gone, {"round": 1})
    assert err.value.errno == errno.ENOENT and str(gone / CHECKPOINT) in str(err.value)


def test_the_fallback_warning_points_at_the_caller_of_load_checkpoint(tmp_path: Path) -> None:
    """stacklevel=2: the warning names the code that resumed, not checkpoint.py."""
    for r in (1, 2):
        save_checkpoint(tmp_path, {"round": r})
    (tmp_path / CHECKPOINT).write_bytes(b"\x00" * 64)
    with pytest.warns(CheckpointWarning) as record:
        assert load_checkpoint(tmp_path) == {"round": 1}
    assert Path(record[0].filename).resolve() == Path(__file__).resolve()


def test_a_path_that_cannot_be_read_and_a_foreign_file_are_named_with_their_reason(tmp_path: Path) -> None:
    """Any OSError reading the file (here: it is a directory) is a CheckpointError, not a crash; an unknown header
    reports the file's size."""
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="cannot be read") as err:
        read_checkpoint(folder)
    assert str(folder) in str(err.value)
    foreign = tmp_path / "notes.pt"
    foreign.write_bytes(b"not a checkpoint")  # 16 bytes
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(foreign)
    assert str(err.value) == f"{foreign} is not a feddg checkpoint (16 bytes, unknown header)"


def test_a_missing_latest_is_reported_as_missing(tmp_path: Path) -> None:
    """A crash between the two renames leaves only the previous: the warning says the latest is missing."""
    for r in (1, 2):
        save_checkpoint(tmp_path, {"round": r})
    (tmp_path / CHECKPOINT).unlink()
    with pytest.warns(CheckpointWarning, match=r"checkpoint\.pt is missing \(a crash between two renames\)"):
        assert load_checkpoint(tmp_path) == {"round": 1}


def test_a_file_of_another_format_version_is_not_taken_for_a_damaged_one(tmp_path: Path) -> None:
    """Only the whole v1 header marks a v1 checkpoint: a v2 file has an unknown header, not a bad checksum."""
    v1 = save_checkpoint(tmp_path, {"round": 1}).read_bytes()
    assert v1.startswith(b"feddg-checkpoint-v1\n")
    v2 = tmp_path / "v2.pt"
    v2.write_bytes(b"feddg-checkpoint-v2\n" + v1[len(b"feddg-checkpoint-v1\n"):])
    with pytest.raises(CheckpointError, match="is not a feddg checkpoint"):
        read_checkpoint(v2)


# --- provenance.py ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("same", [
    ["data.cache_dir=/tmp/elsewhere"],
    ["federation.workers=2", "federation.client_timeout_s=30"],  # workers is excluded too; the limit needs >= 2
    ["flower.node_wait_s=5"],
    ["flower.client_num_gpus=0.5"],
    ["flower.ray_num_cpus=2"],
    ["reproducibility=portable"],
])
def test_each_excluded_key_leaves_the_hash_unchanged(same: list[str]) -> None:
    """Where or how fast a run computes (HASH_EXCLUDES) is not what it computes."""
    cfg = build_config({}, same)
    assert cfg.model_dump() != build_config({}).model_dump()  # the override took
    assert provenance.config_hash(cfg) == provenance.config_hash(build_config({}))


def test_the_hash_does_not_depend_on_the_order_keys_are_written_in() -> None:
    """Canonical JSON sorts keys: a parameter dict written in another order is the same computation."""
    one = build_config({"partition": {"kind": "d_allocation", "params": {"shuffle_clients": True, "d": 2}}})
    two = build_config({"partition": {"kind": "d_allocation", "params": {"d": 2, "shuffle_clients": True}}})
    assert list(one.partition.params) != list(two.partition.params)  # the order survives into the config
    assert provenance.config_hash(one) == provenance.config_hash(two)


def test_a_model_directory_and_an_extra_eval_root_are_stamped_inputs(tmp_path: Path) -> None:
    """input_paths covers model.path and every eval.extra root, keyed by config key."""
    (extra := tmp_path / "extra").mkdir()
    (extra / "a.png").write_bytes(b"x")
    cfg = build_config({"model": {"path": str(tmp_path / "no-model")},
                        "eval": {"extra": [{"name": "far", "dataset": "folder", "root": str(extra)}]}})
    stamp = provenance.inputs_stamp(cfg)
    assert sorted(stamp) == ["eval.extra.far.root", "model.path"]
    assert stamp["model.path"] == "missing" and len(stamp["eval.extra.far.root"]) == 64


def test_the_inputs_stamp_covers_each_files_size_and_relative_path(tmp_path: Path) -> None:
    """A file rewritten to another size with its time kept, or renamed, is a changed input."""
    (data := tmp_path / "data").mkdir()
    image = data / "a.png"
    image.write_bytes(b"xy")
    cfg = build_config({"data": {"root": str(data)}})
    first = provenance.inputs_stamp(cfg)
    st = image.stat()
    image.write_bytes(b"xyz")
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = provenance.inputs_stamp(cfg)
    assert second != first
    image.rename(data / "b.png")  # same size and time, another name
    assert provenance.inputs_stamp(cfg) != second


def test_an_input_under_the_home_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``~/…`` input paths are expanded: such an input is stamped, not reported missing."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.png").write_bytes(b"x")
    stamp = provenance.inputs_stamp(build_config({"data": {"root": "~/data"}}))
    assert stamp["data.root"] != "missing" and len(stamp["data.root"]) == 64


def test_a_fresh_record_lists_no_resume_and_a_run_without_one_gets_none_written(tmp_path: Path) -> None:
    """provenance.json starts with ``resumed: []``, when it was created and flwr's version; a run from before
    provenance.json is left without one."""
    cfg = build_config({}, ["device=cpu"])
    provenance.write_provenance(tmp_path, cfg)
    record = json.loads((tmp_path / provenance.PROVENANCE).read_text())
    assert record["resumed"] == []
    time.strptime(record["created"], "%Y-%m-%dT%H:%M:%S%z")  # a full local timestamp with its UTC offset
    try:
        flwr: str | None = metadata.version("flwr")
    except metadata.PackageNotFoundError:
        flwr = None
    assert record["flwr"] == flwr
    (old := tmp_path / "old").mkdir()
    provenance.record_resume(old, cfg, ["federation.rounds=20"])
    assert list(old.iterdir()) == []


def test_the_record_is_replaced_whole_never_rewritten_in_place(tmp_path: Path) -> None:
    """_write goes through a temporary file and a rename: another link to the old file keeps the old record."""
    cfg = build_config({}, ["device=cpu"])
    path = provenance.write_provenance(tmp_path, cfg)
    os.link(path, tmp_path / "snapshot.json")
    old = path.read_text()
    provenance.record_resume(tmp_path, cfg, ["federation.rounds=20"])
    assert (tmp_path / "snapshot.json").read_text() == old
    assert [r["overrides"] for r in json.loads(path.read_text())["resumed"]] == [["federation.rounds=20"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [provenance.PROVENANCE, "snapshot.json"]


def test_every_resume_is_kept_with_the_kernels_it_ran_with(tmp_path: Path) -> None:
    """A second resume appends to ``resumed``; each entry records the feddg version, commit and kernels."""
    cfg = build_config({}, ["device=cpu"])
    path = provenance.write_provenance(tmp_path, cfg)
    fresh = json.loads(path.read_text())
    provenance.record_resume(tmp_path, cfg, ["federation.rounds=20"])
    provenance.record_resume(tmp_path, cfg, ["federation.rounds=30"])
    resumed = json.loads(path.read_text())["resumed"]
    assert [r["overrides"] for r in resumed] == [["federation.rounds=20"], ["federation.rounds=30"]]
    assert all(r["reproducibility"] == fresh["reproducibility"] for r in resumed)
    assert all(r["feddg"] == feddg.__version__ and r["git_commit"] == fresh["git_commit"] for r in resumed)


def test_changed_inputs_of_a_record_without_inputs_is_none_and_an_input_dropped_counts(tmp_path: Path) -> None:
    """A run from before the inputs stamp reports nothing changed; an input the run read but the config no longer
    names is a change."""
    weights = tmp_path / "start.pth"
    weights.write_bytes(b"w")
    cfg = build_config({"model": {"weights": str(weights)}})
    (run := tmp_path / "run").mkdir()
    (run / provenance.PROVENANCE).write_text(json.dumps({"config_hash": provenance.config_hash(cfg)}))
    assert provenance.changed_inputs(run, cfg) == []
    provenance.write_provenance(run, cfg)
    assert provenance.changed_inputs(run, cfg) == []
    assert provenance.changed_inputs(run, build_config({})) == ["model.weights"]


def test_a_record_without_a_string_hash_falls_back_to_config_yaml_and_a_non_object_is_no_record(tmp_path: Path) -> None:
    """stored_config_hash takes provenance.json's hash only where it is a string; a JSON list is no record."""
    cfg = build_config({}, ["seed=5"])
    (tmp_path / provenance.CONFIG).write_text(dump_config(cfg))
    (tmp_path / provenance.PROVENANCE).write_text(json.dumps({"config_hash": None}))
    assert provenance.stored_config_hash(tmp_path) == provenance.config_hash(cfg)
    (tmp_path / provenance.CONFIG).unlink()
    (tmp_path / provenance.PROVENANCE).write_text("[1, 2]")
    assert provenance.stored_config_hash(tmp_path) is None


def test_an_enclosing_repositorys_commit_is_not_feddgs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where feddg's __init__.py is not tracked, git_state records no commit, whatever HEAD git finds above."""
    def fake_git(cwd: Path, *args: str) -> str | None:
        return None if args[0] == "ls-files" else "0123abcd"

    monkeypatch.setattr(provenance, "_git", fake_git)
    assert provenance.git_state() == {"git_commit": None, "git_dirty": None}


def test_a_git_that_hangs_records_no_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A git that times out is treated as no git: the run starts, with no commit recorded."""
    def hang(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(cmd, 10)

    monkeypatch.setattr(provenance.subprocess, "run", hang)
    assert provenance.git_state() == {"git_commit": None, "git_dirty": None}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_dirty_counts_changed_tracked_files_of_the_package_only(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """git_dirty is about feddg's own tracked files: an untracked file in the package (a notebook, an output) or a
    changed tracked file elsewhere in the repository (a note, a benchmark) is no change to the source."""
    (pkg := tmp_path / "pkg").mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    (tmp_path / "NOTES.md").write_text("one\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                              cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "pkg/__init__.py", "NOTES.md")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(feddg, "__file__", str(pkg / "__init__.py"))
    (pkg / "scratch.txt").write_text("untracked")
    (tmp_path / "NOTES.md").write_text("two\n")
    state = provenance.git_state()
    assert state == {"git_commit": git("rev-parse", "HEAD"), "git_dirty": False}
    (pkg / "__init__.py").write_text("x = 2\n")
    assert provenance.git_state()["git_dirty"] is True


def test_device_auto_is_recorded_as_the_device_it_resolved_to() -> None:
    """provenance.json's machine.device is what ``auto`` picked, never the word ``auto``."""
    device = provenance.provenance(build_config({}, ["device=auto"]))["machine"]["device"]
    assert device.startswith("cuda (") if torch.cuda.is_available() else device == "cpu"


# --- integrity.py ----------------------------------------------------------------------------------------------------

INTEGRITY_BASE = {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
                  "federation": {"rounds": 3, "batch_size": 16, "workers": 1}, "device": "cpu"}


def test_multi_krum_keeps_the_one_reply_a_round_of_failures_left() -> None:
    """With krum_keep 0 (n − f) and f ≥ n the kept count is clamped to 1, not 0 (which krum_select refuses)."""
    fc = build_config(INTEGRITY_BASE, ["federation.aggregation=multi_krum", "federation.krum_malicious=1"]).federation
    reply = Reply(2, {"w/a": np.array([1.0], np.float32), "num_examples": 5})
    assert robust_replies([reply], fc) == ([reply], {})


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean"])
def test_krum_malicious_is_no_concern_of_a_rule_other_than_krum(rule: str) -> None:
    """The honest-majority check is Krum's: a krum_malicious left set under another rule stops no run."""
    fc = build_config(INTEGRITY_BASE, [f"federation.aggregation={rule}", "federation.krum_malicious=2",
                                       "federation.trim_fraction=0.34"]).federation
    assert robust_problem(fc, 3) is None  # int(0.34 x 3) = 1 trimmed from each end


def test_the_weights_norm_is_over_every_weight_array_together() -> None:
    """``‖w‖`` of several ``w/`` arrays is the norm of their concatenation: sqrt(3² + 4² + 12²) = 13."""
    assert weights_norm({"w/a": np.array([3.0], np.float32), "w/b": np.array([[4.0, 12.0]])}) == 13.0


def test_a_capped_reply_is_still_the_same_clients() -> None:
    """cap_examples changes num_examples only: the client id and the arrays are the reply's own."""
    w = np.ones(2, np.float32)
    capped, claim = cap_examples(Reply(7, {"num_examples": 100, "w/a": w}), 10)
    assert capped.client_id == 7 and capped.message["w/a"] is w and capped.num_examples == 10 and claim == 100


def test_a_zero_median_reference_is_named_as_the_sent_weights_in_the_refusal() -> None:
    """With a median of 0 the bound is ``factor × |w_sent|``, and the reason says so."""
    bound = NormBound(10.0, reference=0.0)
    sent = {"w/a": np.array([3.0, 4.0], np.float32)}  # |w_sent| = 5
    assert bound.check(51.0, sent) == "update norm 51 > 10 x |w_sent| (federation.update_norm_factor)"


# --- rounds.py -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("x", "expected"), [(0.5, 1), (1.5, 2), (2.5, 3), (2.4999, 2), (-0.5, 0), (3.0, 3)])
def test_round_half_up_rounds_halves_up_not_to_even(x: float, expected: int) -> None:
    """Halves go up (Python's round() would give 0, 2, 2 for 0.5, 1.5, 2.5)."""
    assert round_half_up(x) == expected


def test_all_members_come_back_sorted_when_the_fraction_is_one() -> None:
    """sample_members returns its members sorted whether it draws or takes them all."""
    members = np.array([7, 2, 5])
    assert sample_members(members, 1.0, np.random.default_rng(0)) == [2, 5, 7]
    assert sample_members(members, 0.99, np.random.default_rng(0)) == [2, 5, 7]  # round_half_up(2.97) = 3: all
