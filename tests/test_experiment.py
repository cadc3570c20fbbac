"""Run-directory rules, resume rules, interrupts, the progress line and the kernel record, checked against values
written out by hand: a file as run directory, a symlinked folder under --overwrite, every file feddg writes, the keys
a resume may change, a plain resume of a run that cannot grow, the interrupt's message and exit code, signal
handlers put back, and the record of torch's own capability."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from feddg.config import ConfigError, build_config, dump_config
from feddg.experiment import (
    Interrupted,
    RunDirError,
    _same_as_fresh,
    _status,
    clear_run_dir,
    resume_experiment,
    run_experiment,
    stop_signals,
)
from feddg.reproducibility import kernel_record
from feddg.tasks.classification import Classification


def test_a_run_directory_that_is_a_file_is_refused_as_a_file_and_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.write_text("not a folder")
    with pytest.raises(RunDirError, match=r"^run directory .*run is a file$"):
        run_experiment(build_config({}), target, overwrite=True, progress=False)
    assert target.read_text() == "not a folder"


def test_overwrite_removes_every_file_feddg_writes_and_keeps_every_other_name(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # what a run, its tracking, its report and its audits write (experiment.py's docs); folders end in "/"
    written = ["config.yaml", "provenance.json", "provenance.json.tmp", "metrics.jsonl", "results.json",
               "checkpoint.pt", "checkpoint.prev.pt", "checkpoint.pt.tmp", "client_store/", "curves.png",
               "domains.png", "styles.png", "report.html", "mlflow_run_id", "events.out.tfevents.17.host",
               "examples/", "audit/", "audit-1/", "audit-12/", "audit.partial/"]
    mine = ["audit-notes/", "config.yaml.bak", "my_results.json", "notes.txt"]
    for name in written + mine:
        if name.endswith("/"):
            (run / name).mkdir()
            (run / name / "inside.txt").write_text("x")
        else:
            (run / name).write_text("x")
    assert clear_run_dir(run) == [name.rstrip("/") for name in mine]
    assert sorted(p.name for p in run.iterdir()) == [name.rstrip("/") for name in mine]


def test_overwrite_unlinks_a_symlinked_store_and_keeps_the_folder_it_points_to(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "big_disk"
    run.mkdir()
    elsewhere.mkdir()
    (elsewhere / "client_0.pt").write_text("x")
    (run / "config.yaml").write_text("x")
    (run / "client_store").symlink_to(elsewhere, target_is_directory=True)
    assert clear_run_dir(run) == []
    assert list(run.iterdir()) == [] and (elsewhere / "client_0.pt").is_file()


@pytest.mark.parametrize("override", ["federation.rounds=5", "eval.every=2", "federation.checkpoint_every=2",
                                      "federation.workers=2", "device=cpu", "federation.client_timeout_s=30",
                                      "federation.client_state_budget_mb=64"])
def test_a_resume_may_change_each_key_that_keeps_the_trained_rounds_valid(tmp_path: Path, override: str) -> None:
    (tmp_path / "config.yaml").write_text(dump_config(build_config({"federation": {"rounds": 2}})))
    # past the key check, the resume stops at the missing checkpoint rather than at the override
    with pytest.raises(RunDirError, match="nothing to resume"):
        resume_experiment(tmp_path, [override], progress=False)


@pytest.mark.parametrize("raw", [{"optim": {"schedule": "cosine"}}, {"method": {"name": "feddg_ga"}}])
def test_a_plain_resume_of_a_run_that_cannot_grow_is_not_refused(tmp_path: Path, raw: dict[str, object]) -> None:
    (tmp_path / "config.yaml").write_text(dump_config(build_config({**raw, "federation": {"rounds": 2}})))
    for overrides in ([], ["eval.every=2"], ["federation.rounds=2"]):  # federation.rounds unchanged
        with pytest.raises(RunDirError, match="nothing to resume"):
            resume_experiment(tmp_path, overrides, progress=False)
    with pytest.raises(ConfigError, match="federation.rounds: cannot change on resume"):
        resume_experiment(tmp_path, ["federation.rounds=3"], progress=False)


def test_a_resume_without_any_change_is_the_same_computation_whatever_its_rounds() -> None:
    odd = build_config({"federation": {"rounds": 3}, "eval": {"every": 2}})  # 3 % 2 != 0, but nothing changed
    assert _same_as_fresh(odd, build_config({"federation": {"rounds": 3}, "eval": {"every": 2}}))


@pytest.mark.parametrize(("sig", "saved", "kept", "code"),
                         [(signal.SIGTERM, 3, "the last checkpoint is round 3", 143),
                          (signal.SIGINT, None, "nothing was checkpointed yet", 130)])
def test_an_interrupt_names_the_round_in_progress_the_last_checkpoint_and_the_shells_code(
    sig: signal.Signals, saved: int | None, kept: str, code: int
) -> None:
    err = Interrupted(sig, Path("/runs/a"), 4, saved)  # 4 rounds done: round 5 was in progress
    assert str(err) == f"{sig.name}: the run stopped during round 5 ({kept}); feddg run --resume /runs/a continues it"
    assert err.code == code


def test_stop_signals_turns_sigterm_into_an_interrupt_and_puts_the_handlers_back() -> None:
    def mine(sig: int, frame: object) -> None:
        raise AssertionError("the caller's handler ran inside the block")

    before = signal.signal(signal.SIGTERM, mine)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt), stop_signals() as received:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line
        assert received == {"signal": signal.SIGTERM}
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is sigint
    finally:
        signal.signal(signal.SIGTERM, before)


def test_stop_signals_leaves_the_handlers_alone_in_a_worker_thread() -> None:
    seen: list[object] = []

    def worker() -> None:
        with stop_signals() as received:
            seen.extend([signal.getsignal(signal.SIGTERM), received])

    sigterm = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [sigterm, {}]


def test_the_progress_line_gives_the_loss_and_each_roles_metric_present() -> None:
    task = Classification(4)
    row = {"train_loss": 0.12345, "id_acc": 81.26, "val_acc": 70.0, "ood_acc": 65.44, "round": 3}
    assert _status(row, task) == "loss 0.123 · id acc 81.3% · val acc 70.0% · ood acc 65.4%"
    assert _status({"train_loss": 2.0, "ood_acc": 40.0}, task) == "loss 2.000 · ood acc 40.0%"


def test_kernel_record_gives_torchs_own_capability_and_the_mode_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    record = kernel_record("native")
    assert record["mode"] == "native" and record["torch_cpu_capability"] == "AVX512"
