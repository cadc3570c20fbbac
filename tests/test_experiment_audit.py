"""Pins found by a mutation audit of experiment.py, engines/inprocess.py, reproducibility.py, devices.py, messages.py,
catalog.py and seeds.py: the wiring of ``run_experiment`` (progress, tracking, figures, interrupts) with its
collaborators replaced by recorders, the refusals and clean-up of ``resume_experiment``, and unit behaviours each
module's docstring states. Expected values are written out by hand from those docstrings."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import feddg.catalog
from feddg import experiment
from feddg.algorithms.base import Reply
from feddg.algorithms.registry import list_methods, method_label
from feddg.catalog import build_catalog, catalog, source_digest, user_cache_dir
from feddg.config import build_config, read_yaml
from feddg.devices import images, to_device
from feddg.engines import inprocess, workers
from feddg.experiment import Interrupted, RunDirError, _in_schema, clear_run_dir, resume_experiment, run_experiment
from feddg.federation.client import Outcome
from feddg.messages import array_slot, load_weights, validate_message, weights_of
from feddg.reproducibility import PORTABLE_ENV
from feddg.tasks.classification import Classification


class FakeProgress:
    """``progress_bar``'s stand-in: records the task it was given and each update."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def __enter__(self) -> FakeProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, **fields: Any) -> int:
        self.log.append(("add_task", (description, fields)))
        return 7

    def update(self, task: int, **fields: Any) -> None:
        self.log.append(("update", (task, fields)))


def wire(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]], *, round: int = 0,
         saved: int | None = None, interrupt: bool = False) -> list[tuple[str, Any]]:
    """Replace run_experiment's collaborators by recorders; the engine calls ``on_round`` with ``rows`` (then raises
    KeyboardInterrupt when ``interrupt``). Returns the shared call log."""
    log: list[tuple[str, Any]] = []
    fed = SimpleNamespace(dataset=SimpleNamespace(domains=["mnist", "svhn", "uci"]),
                          split=SimpleNamespace(test_domains=[2, 0]), task=Classification(4))
    server = SimpleNamespace(rounds=5, round=round, saved_round=saved, fed=fed)

    class Tracking:
        def __init__(self, cfg: object, run_dir: Path) -> None:
            log.append(("tracking", run_dir))

        def log_round(self, row: dict[str, Any]) -> None:
            log.append(("log_round", row))

        def finish(self, results: dict[str, Any]) -> None:
            log.append(("finish", dict(results)))

    def engine(srv: object, on_round: Any) -> dict[str, Any]:
        assert srv is server
        for row in rows:
            on_round(row)
        if interrupt:
            raise KeyboardInterrupt
        return {"final": {"ood_acc": 50.0}}

    def make_server(f: object, run_dir: Path, resume: bool) -> SimpleNamespace:
        log.append(("server", (f is fed, run_dir, resume)))
        return server

    monkeypatch.setattr(experiment, "Tracking", Tracking)
    monkeypatch.setattr(experiment, "build_federation", lambda cfg: fed)
    monkeypatch.setattr(experiment, "Server", make_server)
    monkeypatch.setattr(experiment, "run_inprocess", engine)
    monkeypatch.setattr(experiment, "progress_bar", lambda enabled: FakeProgress(log))
    monkeypatch.setattr(experiment, "plot_run", lambda run_dir: log.append(("plot_run", run_dir)))
    monkeypatch.setattr(experiment, "write_examples", lambda srv: log.append(("write_examples", srv is server)))
    return log


def test_run_experiment_feeds_each_round_to_the_bar_and_tracking_then_draws_and_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round advances the bar by one with its status line and reaches tracking; the end draws the curves, the
    examples, and gives tracking the results (with ``run_dir``); the bar starts at the rounds already done."""
    rows = [{"train_loss": 1.5, "ood_acc": 40.0}, {"train_loss": 0.25, "ood_acc": 62.5}]
    log = wire(monkeypatch, rows, round=2)
    run = tmp_path / "run"
    results = run_experiment(build_config({}), run, resume=True, progress=False)
    assert results == {"final": {"ood_acc": 50.0}, "run_dir": str(run)}
    status = ["loss 1.500 · ood acc 40.0%", "loss 0.250 · ood acc 62.5%"]
    assert log == [
        ("tracking", run), ("server", (True, run, True)),
        ("add_task", ("fedavg → uci, mnist", {"total": 5, "completed": 2, "status": ""})),
        ("update", (7, {"advance": 1, "status": status[0]})), ("log_round", rows[0]),
        ("update", (7, {"advance": 1, "status": status[1]})), ("log_round", rows[1]),
        ("plot_run", run), ("write_examples", True), ("finish", {"final": {"ood_acc": 50.0}, "run_dir": str(run)}),
    ]


def test_a_hierarchical_runs_bar_names_its_station_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FedAvg clients under HFedATM stations: "fedavg+hfedatm → ...", as its report and results table name it."""
    log = wire(monkeypatch, [], round=0)
    cfg = build_config({}, ["hierarchy.stations=2", "hierarchy.merge=hfedatm"])
    run_experiment(cfg, tmp_path / "run", progress=False)
    assert [args[0] for name, args in log if name == "add_task"] == ["fedavg+hfedatm → uci, mnist"]


def test_an_interrupted_run_is_sigint_by_default_and_names_the_round_in_progress_and_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt with no signal recorded is SIGINT (exit 130); the message counts from ``server.round``
    (rounds done) and ``server.saved_round`` (the last checkpoint); nothing is drawn or finished."""
    log = wire(monkeypatch, [{"train_loss": 1.0}], round=4, saved=3, interrupt=True)
    run = tmp_path / "run"
    with pytest.raises(Interrupted) as err:
        run_experiment(build_config({}), run, resume=True, progress=False)
    assert err.value.code == 128 + signal.SIGINT == 130
    assert str(err.value) == (f"SIGINT: the run stopped during round 5 (the last checkpoint is round 3); "
                              f"feddg run --resume {run} continues it")
    assert [name for name, _ in log] == ["tracking", "server", "add_task", "update", "log_round"]


def test_clear_run_dir_refuses_a_folder_without_config_yaml_and_deletes_nothing(tmp_path: Path) -> None:
    """``clear_run_dir`` refuses a directory that is not a feddg run (its docstring), even one holding feddg names."""
    (tmp_path / "metrics.jsonl").write_text("x")
    with pytest.raises(RunDirError, match=r"is not a feddg run directory \(no config.yaml\); refusing"):
        clear_run_dir(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == "x"


def test_resume_refuses_a_folder_without_config_yaml(tmp_path: Path) -> None:
    """A resume names the missing config.yaml rather than failing on reading it."""
    (tmp_path / "checkpoint.pt").write_text("x")
    with pytest.raises(RunDirError, match=r"is not a feddg run directory \(no config.yaml\) to resume$"):
        resume_experiment(tmp_path, progress=False)


def test_in_schema_is_false_for_a_key_the_config_has_not() -> None:
    """``_in_schema`` follows the nested models: a missing leaf or section is not in the schema."""
    assert _in_schema("federation.rounds") and _in_schema("device")
    assert not _in_schema("federation.no_such_key")
    assert not _in_schema("no_such_section.rounds")


def finished_run(run: Path, raw: dict[str, Any]) -> None:
    """A run directory whose config.yaml is ``raw`` as written, with a (dummy) checkpoint, results.json and audits."""
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps(raw))  # JSON is YAML
    (run / "checkpoint.pt").write_text("x")
    (run / "results.json").write_text(json.dumps({"final": {"ood_acc": 12.5}}))
    for name in ("audit", "audit-1", "audit.partial", "audit-notes"):
        (run / name).mkdir()


def test_a_finished_run_whose_config_yaml_omits_the_rounds_resumes_as_finished(tmp_path: Path) -> None:
    """A config.yaml without ``federation.rounds`` (the default applies) cannot have grown: the finished results
    come back unchanged with ``resumed: False``."""
    run = tmp_path / "run"
    finished_run(run, {"seed": 3})
    assert resume_experiment(run, progress=False) == {"final": {"ood_acc": 12.5}, "run_dir": str(run),
                                                      "resumed": False}


def test_an_extended_resume_clears_the_old_results_and_audits_writes_the_overrides_and_records_the_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extending a finished run (3 -> 4 rounds, eval.every 2): results.json and every audit folder go (a user's
    ``audit-notes`` stays), config.yaml takes the overrides, the resume is recorded as not the same as a fresh run
    (round 3 was evaluated only as the last), and the run continues its checkpoint with the caller's progress."""
    run = tmp_path / "run"
    finished_run(run, build_config({"federation": {"rounds": 3}, "eval": {"every": 2}}).model_dump(mode="json"))
    recorded: list[tuple[Any, ...]] = []
    monkeypatch.setattr(experiment, "record_resume",
                        lambda run_dir, cfg, overrides, same_as_fresh: recorded.append((run_dir, overrides,
                                                                                        same_as_fresh)))
    monkeypatch.setattr(experiment, "run_experiment",
                        lambda cfg, run_dir, *, resume, progress: {"rounds": cfg.federation.rounds,
                                                                   "resume": resume, "progress": progress})
    assert resume_experiment(run, ["federation.rounds=4"], progress=True) == {"rounds": 4, "resume": True,
                                                                             "progress": True}
    assert sorted(p.name for p in run.iterdir()) == ["audit-notes", "checkpoint.pt", "config.yaml"]
    assert read_yaml(run / "config.yaml")["federation"]["rounds"] == 4
    assert recorded == [(run, ["federation.rounds=4"], False)]


def test_run_setup_asks_every_client_in_order_and_keeps_each_new_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a setup request, every client (all of them, in id order) answers it from its stored state (empty when
    none), its new state is kept, and the replies reach ``finish_setup`` tagged with their client ids."""
    asked: list[tuple[int, Any, Any]] = []

    def setup(fed: object, cid: int, request: Any, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        asked.append((cid, request, state))
        return {"n": cid * 10}, {"s": cid}

    finished: list[list[Reply]] = []
    server = SimpleNamespace(fed=SimpleNamespace(clients=[None] * 3), client_states={1: {"old": 1}},
                             setup_request=lambda: {"q": 1}, finish_setup=finished.append)
    monkeypatch.setattr(inprocess, "run_client_setup", setup)
    inprocess.run_setup(server)
    assert asked == [(0, {"q": 1}, {}), (1, {"q": 1}, {"old": 1}), (2, {"q": 1}, {})]
    assert server.client_states == {0: {"s": 0}, 1: {"s": 1}, 2: {"s": 2}}
    assert finished == [[Reply(0, {"n": 0}), Reply(1, {"n": 10}), Reply(2, {"n": 20})]]


def test_run_setup_without_a_request_only_marks_the_setup_done() -> None:
    """A method without a setup exchange is marked done and no client is asked."""
    marked: list[bool] = []
    server = SimpleNamespace(setup_request=lambda: None, mark_setup_done=lambda: marked.append(True))
    inprocess.run_setup(server)
    assert marked == [True]


def test_a_sequential_round_folds_replies_and_fails_clients_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a pool each sent client runs in turn from its stored state; a reply is received with its new state,
    a missing one fails the client with its error, or ``no reply`` when it gave none."""
    outcomes = {0: Outcome({"num_examples": 4}, {"s": 0}), 1: Outcome(error="ValueError: bad"), 2: Outcome()}
    ran: list[tuple[int, int, Any, Any]] = []

    def client(fed: object, cid: int, round: int, msg: Any, state: Any) -> Outcome:
        ran.append((cid, round, msg, state))
        return outcomes[cid]

    log: list[tuple[Any, ...]] = []
    server = SimpleNamespace(fed="fed", client_states={2: {"kept": 1}},
                             configure=lambda r: {0: {"m": 0}, 1: {"m": 1}, 2: {"m": 2}},
                             start_round=lambda sent: "fold",
                             fail=lambda fold, cid, why: log.append(("fail", fold, cid, why)),
                             receive=lambda fold, reply, state: log.append(("receive", fold, reply, state)),
                             finish_round=lambda r, fold, extra: {"round": r})
    monkeypatch.setattr(inprocess, "try_client", client)
    assert inprocess.run_round(server, 3) == {"round": 3}
    assert ran == [(0, 3, {"m": 0}, {}), (1, 3, {"m": 1}, {}), (2, 3, {"m": 2}, {"kept": 1})]
    assert log == [("receive", "fold", Reply(0, {"num_examples": 4}), {"s": 0}),
                   ("fail", "fold", 1, "ValueError: bad"), ("fail", "fold", 2, "no reply")]


def test_run_inprocess_sets_up_then_runs_the_rounds_left_on_its_pool_and_hands_each_row_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server at round 2 of 4 does its setup exchange first, then runs rounds 3 and 4 (not one more or fewer) on
    the worker pool it started under ``federation.threads`` torch threads, gives each row to ``on_round``, and
    returns what ``write_results`` gives."""
    log: list[Any] = []

    class Pool:
        def __init__(self, cfg: object, n: int, **kw: Any) -> None:
            log.append(("pool", n))

        def __enter__(self) -> Pool:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    federation = SimpleNamespace(workers=2, client_timeout_s=None, threads=2)
    fed = SimpleNamespace(cfg=SimpleNamespace(federation=federation), device=torch.device("cpu"),
                          topology=SimpleNamespace(num_clients=3))
    server = SimpleNamespace(fed=fed, round=2, rounds=4, setup_request=lambda: None,
                             mark_setup_done=lambda: log.append("setup done"), write_results=lambda: {"done": True})
    monkeypatch.setattr(inprocess, "WorkerPool", Pool)
    monkeypatch.setattr(workers, "usable_cores", lambda: 4)
    monkeypatch.setattr(inprocess, "run_round", lambda srv, r, pool: {"round": r, "pool": type(pool).__name__,
                                                                        "threads": torch.get_num_threads()})
    assert inprocess.run_inprocess(server, log.append) == {"done": True}
    assert log == ["setup done", ("pool", 2), {"round": 3, "pool": "Pool", "threads": 2},
                   {"round": 4, "pool": "Pool", "threads": 2}]


def test_numpy_scalars_are_scalars_that_may_cross() -> None:
    """numpy integer and float scalars (``np.int64`` is no ``int``, ``np.float32`` no ``float``) may cross."""
    validate_message({"n": np.int64(3), "k": np.uint8(1), "x": np.float32(0.5)})


def test_weights_of_and_load_weights_use_the_prefix_given() -> None:
    """A model's arrays travel under the prefix asked for, and load back from it."""
    src, dst = nn.Linear(2, 1), nn.Linear(2, 1)
    with torch.no_grad():
        src.weight.copy_(torch.tensor([[1.0, 2.0]]))
        src.bias.fill_(3.0)
    msg = weights_of(src, "p/")
    assert sorted(msg) == ["p/bias", "p/weight"]
    load_weights(dst, {**msg, "w/weight": np.zeros((1, 2), np.float32)}, "p/")
    assert dst.weight.tolist() == [[1.0, 2.0]] and dst.bias.tolist() == [3.0]


def test_a_mismatch_names_the_first_three_missing_keys_in_order() -> None:
    """The KeyError lists the sorted missing (and unexpected) keys, three at most."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    with pytest.raises(KeyError, match=r"missing \['0.bias', '0.weight', '1.bias'\], unexpected \[\]"):
        load_weights(model, {})
    extra = {f"w/x{i}": np.zeros(1) for i in range(4)}
    full = weights_of(model)
    with pytest.raises(KeyError, match=r"missing \[\], unexpected \['x0', 'x1', 'x2'\]"):
        load_weights(model, {**full, **extra})


def test_array_slot_keeps_its_shape_dtype_and_whether_it_is_required() -> None:
    """``array_slot`` builds the array Slot asked for: an optional one stays optional, ``None`` means any shape."""
    optional = array_slot([2, 3], "float32", required=False)
    assert (optional.dtype, optional.shape, optional.number, optional.required) == (np.dtype(np.float32), (2, 3),
                                                                                    False, False)
    assert array_slot(None, np.int64).shape is None and array_slot(None, np.int64).required


def test_to_device_keeps_an_image_batchs_layout_unless_channels_last_is_asked() -> None:
    """``channels_last`` is only applied when asked (to a 4-d tensor alone or in a dict): by default a 4-d batch keeps
    its contiguous NCHW layout."""
    image = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    moved = to_device(image, "cpu")
    assert moved.is_contiguous() and not moved.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(moved, image)
    in_dict = to_device({"pixels": image}, "cpu", channels_last=True)["pixels"]  # each tensor of a dict as asked
    assert in_dict.is_contiguous(memory_format=torch.channels_last) and torch.equal(in_dict, image)


def test_images_refuses_token_inputs_naming_them_and_passes_an_image_tensor_through() -> None:
    """``images`` gives back the tensor it is given and refuses a dict of token tensors, naming its keys."""
    image = torch.zeros(1, 1, 2, 2)
    assert images(image) is image
    with pytest.raises(TypeError, match=r"^expected an image tensor, got inputs \['attention_mask', 'input_ids'\]"):
        images({"input_ids": torch.zeros(1, 3), "attention_mask": torch.ones(1, 3)})


def test_the_portable_settings_are_the_ones_docs_reliability_lists() -> None:
    """docs/reliability.md's table: oneDNN at most AVX2, one OMP/MKL/OpenBLAS thread, numpy without X86_V4; and
    numpy's own AVX-512 dispatch targets (this numpy's, and the old base name AVX512F) all disabled."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__

    assert PORTABLE_ENV["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert {PORTABLE_ENV[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")} == {"1"}
    disabled = set(PORTABLE_ENV["NPY_DISABLE_CPU_FEATURES"].split())
    assert {"X86_V4", "AVX512F"} <= disabled
    assert {t for t in __cpu_dispatch__ if t.startswith("AVX512") or t == "X86_V4"} <= disabled


def test_the_catalog_lists_each_merge_by_what_it_computes_and_augmentations_without_their_name() -> None:
    """A merge is described by its parts (FOT alignment and/or RegMean; neither: the γ-weighted mean), joined by
    " + "; an augmentation's parameters leave out its ``name``; the hierarchy line holds HFedATM's defaults."""
    listing = build_catalog()
    assert dict(listing["merges"]) == {
        "avg": "γ-weighted mean of the station models (HFedAvg)",
        "hfedatm": "FOT alignment (eqs. 2–6) + RegMean of linear layers (eqs. 8–12)",
        "hfedatm-no-fot": "RegMean of linear layers (eqs. 8–12)",
        "hfedatm-no-regmean": "FOT alignment (eqs. 2–6)",
    }
    augmentations = dict(listing["augmentations"])
    assert list(augmentations) == ["mixup", "manifold_mixup", "mixstyle", "moex"]
    assert augmentations["mixup"] == "alpha=0.2" and augmentations["moex"] == "lam=0.9, p=0.5, stage=1"
    assert "lambda_ot=0.05" in listing["hierarchy"] and "sinkhorn_iters=25" in listing["hierarchy"]
    assert [name for name, _ in listing["methods"]] == [method_label(name) for name in list_methods()]  # all of them


@pytest.fixture
def one_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A source root of one file, and a listing builder that returns an empty listing of every key."""
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(feddg.catalog, "build_catalog", lambda: {k: [] for k in sorted(feddg.catalog.KEYS)})
    return root


@pytest.mark.parametrize("cached", ["not json", json.dumps({"methods": []})])
def test_a_corrupt_or_incomplete_cached_listing_is_rebuilt(one_source: Path, tmp_path: Path, cached: str) -> None:
    """A cached file that is no JSON, or lacks a key of the listing, is not returned: the listing is rebuilt and
    written over it."""
    path = tmp_path / "cache" / "methods" / f"{source_digest(one_source)[:32]}.json"
    path.parent.mkdir(parents=True)
    path.write_text(cached)
    listing = catalog(cache_dir=tmp_path / "cache", root=one_source)
    assert listing == {k: [] for k in feddg.catalog.KEYS}
    assert json.loads(path.read_text()) == listing


def test_the_source_digest_counts_each_files_contents_and_its_relative_path(one_source: Path) -> None:
    """Contents of the same length, or the same contents under another name or folder, give another digest."""
    seen = {source_digest(one_source)}
    (one_source / "pkg" / "a.py").write_text("x = 2\n")  # same length
    seen.add(source_digest(one_source))
    (one_source / "pkg" / "a.py").rename(one_source / "pkg" / "b.py")
    seen.add(source_digest(one_source))
    (one_source / "pkg" / "b.py").rename(one_source / "b.py")
    seen.add(source_digest(one_source))
    assert len(seen) == 4


def test_the_cache_folder_expands_a_home_relative_feddg_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$FEDDG_CACHE`` of ``~/...`` is under the home folder, as the dataset cache reads it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FEDDG_CACHE", "~/cache")
    assert user_cache_dir() == tmp_path / "cache"


def test_the_progress_bar_is_disabled_exactly_when_progress_is_off() -> None:
    """``progress=False`` (``--quiet``) gives a disabled bar; ``True`` a live one."""
    assert experiment.progress_bar(False).disable and not experiment.progress_bar(True).disable


@pytest.mark.parametrize("width", [80, 150])
def test_a_run_line_keeps_its_count_status_and_both_times_whole_on_a_narrow_console(
        monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """At 80 columns (a classic terminal, and `make demo` piped to a log) rich squeezed the bar and cut both times to
    ``0:…``; the bar now shows only where the line has room for it."""
    import io

    from rich.console import Console

    monkeypatch.setattr(experiment, "console", Console(file=io.StringIO(), width=width, force_terminal=False))
    with experiment.progress_bar(True) as bar:
        task = bar.add_task("fedavg → mnistm", total=8, status="")
        bar.update(task, advance=8, status="loss 1.375 · id acc 48.3% · ood acc 61.0%")
    [line] = experiment.console.file.getvalue().splitlines()
    assert "8/8 loss 1.375 · id acc 48.3% · ood acc 61.0%" in line and "…" not in line
    assert line.count("0:00:0") == 2 and len(line) <= width
    assert ("━" in line) == (width >= experiment.BAR_FROM_WIDTH)
