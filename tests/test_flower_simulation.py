"""``run_flower``'s own work, without Ray: what it hands Flower's ``run_simulation`` (supernodes, Ray settings, the
ClientApp, log and environment settings) and what it makes of the ServerApp's outcome (results, RunStopped, nothing).

``run_simulation`` is replaced by a fake that records its arguments and the environment, then calls the ServerApp the
way Flower's thread does; ``run_on_grid`` by one that records its arguments. The real runtime is run by
tests/test_flower.py, test_tasks.py, test_faults.py and test_secagg.py.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flwr.simulation
import pytest
import ray._private.utils as ray_utils
from flwr.app import Context, RecordDict

from feddg.config import build_config, dump_config
from feddg.engines.flower import simulation
from feddg.engines.flower.server import PollingGrid
from feddg.engines.flower.simulation import run_flower
from feddg.experiment import stop_signals
from feddg.federation.validation import RunStopped

GRID = object()  # the Grid Flower would give the ServerApp
ENV = ("FEDDG_VERBOSE", "FEDDG_PLAIN_LOGS", "RAY_COLOR_PREFIX", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
       "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO")


class FakeFlower:
    """Stands in for ``run_simulation``, ``run_on_grid``, ``make_client_app`` and ``update_console_handler``."""

    def __init__(self) -> None:
        self.simulation: dict[str, Any] = {}
        self.env: dict[str, str | None] = {}
        self.flwr_level = logging.NOTSET
        self.grid_calls: list[tuple[Any, Any, Any]] = []
        self.client_app_args: tuple[str, Any, Any] | None = None
        self.client_app_quiet: bool | None = None
        self.client_app = object()
        self.console_colored: list[bool] = []
        self.outcome: Callable[[], dict[str, Any]] = lambda: {"final": {"ood_acc": 50.0}}
        self.serve = True  # False: the ServerApp never returns (Flower logged its error and went on)

    def run_simulation(self, server_app: Any, **kwargs: Any) -> None:
        self.simulation = kwargs
        self.env = {k: os.environ.get(k) for k in ENV}
        self.flwr_level = logging.getLogger("flwr").level
        if self.serve:
            server_app(GRID, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))

    def run_on_grid(self, server: Any, grid: Any, on_round: Any) -> dict[str, Any]:
        self.grid_calls.append((server, grid, on_round))
        return self.outcome()

    def make_client_app(self, text: str, factory: Any, state_dir: Any, quiet: bool) -> object:
        self.client_app_args = (text, factory, state_dir)
        self.client_app_quiet = quiet
        return self.client_app

    def update_console_handler(self, colored: bool) -> None:
        self.console_colored.append(colored)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeFlower]:
    fake = FakeFlower()
    for name in ("run_simulation", "run_on_grid", "make_client_app", "update_console_handler"):
        monkeypatch.setattr(simulation, name, getattr(fake, name))
    for key in ENV:  # set, then removed: what run_flower sets in os.environ goes when the test ends
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    flwr_log = logging.getLogger("flwr")
    monkeypatch.setattr(flwr_log, "filters", [])
    level = flwr_log.level
    yield fake
    flwr_log.setLevel(level)


def fake_server(*overrides: str, clients: int = 3) -> Any:
    """What run_flower reads of a Server: its config and its clients."""
    return SimpleNamespace(fed=SimpleNamespace(cfg=build_config({}, list(overrides)), clients=[object()] * clients),
                           run_dir=Path("runs/x"))


def test_one_supernode_per_client_on_a_loopback_ray_with_the_configured_resources(fake: FakeFlower) -> None:
    server = fake_server("flower.ray_num_cpus=3", "flower.client_num_cpus=0.5", "flower.client_num_gpus=0.25",
                         clients=5)
    run_flower(server)
    assert fake.simulation["num_supernodes"] == 5
    assert fake.simulation["backend_config"] == {
        "init_args": {"_node_ip_address": "127.0.0.1", "include_dashboard": False, "logging_level": logging.WARNING,
                      "num_cpus": 3},
        "client_resources": {"num_cpus": 0.5, "num_gpus": 0.25},
    }
    assert fake.simulation["verbose_logging"] is False
    assert set(fake.simulation) < set(inspect.signature(flwr.simulation.run_simulation).parameters)  # Flower's names


def test_ray_takes_all_cpus_unless_flower_ray_num_cpus_is_set(fake: FakeFlower) -> None:
    run_flower(fake_server())
    assert fake.simulation["backend_config"]["init_args"] == {
        "_node_ip_address": "127.0.0.1", "include_dashboard": False, "logging_level": logging.WARNING}
    assert fake.simulation["backend_config"]["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.0}


@pytest.mark.parametrize(("value", "loud"), [(None, False), ("0", False), ("", False), ("1", True)])
def test_only_feddg_verbose_1_lets_flower_and_ray_log_info(fake: FakeFlower, monkeypatch: pytest.MonkeyPatch,
                                                            value: str | None, loud: bool) -> None:
    if value is not None:
        monkeypatch.setenv("FEDDG_VERBOSE", value)
    run_flower(fake_server())
    level = logging.INFO if loud else logging.WARNING
    assert fake.simulation["verbose_logging"] is loud
    assert fake.client_app_quiet is not loud  # the actors' own INFO lines (Ray prints them under the progress bar)
    assert fake.simulation["backend_config"]["init_args"]["logging_level"] == level
    assert fake.flwr_level == level


def test_the_client_app_gets_the_experiment_yaml_the_factory_and_the_run_s_node_state_folder(fake: FakeFlower) -> None:
    server = fake_server("federation.rounds=7", "seed=11")

    def factory(cfg: Any) -> Any:
        raise AssertionError("the fake ClientApp builds nothing")

    run_flower(server, factory=factory)
    assert fake.client_app_args == (dump_config(server.fed.cfg), factory, Path("runs/x/node-state"))  # for --resume
    assert fake.simulation["client_app"] is fake.client_app


def test_the_server_app_drives_the_server_and_its_results_come_back(fake: FakeFlower) -> None:
    server = fake_server()
    rows: list[dict[str, Any]] = []
    assert run_flower(server, on_round=rows.append) == {"final": {"ood_acc": 50.0}}
    [(driven, grid, callback)] = fake.grid_calls
    assert driven is server and callback == rows.append
    assert isinstance(grid, PollingGrid) and grid.grid is GRID and not grid.stop.is_set()


class SilentGrid:
    """A Grid whose clients never reply (their Ray actors are gone)."""

    def push_messages(self, messages: Any) -> list[str]:
        return ["m1"]

    def pull_messages(self, ids: Any) -> list[Any]:
        return []


def waiting_for_replies(waited: list[str]) -> Any:
    """A stand-in for run_on_grid that waits for replies (up to an hour) and notes why it stopped in ``waited``."""

    def waits(server: Any, grid: Any, on_round: Any) -> dict[str, Any]:
        try:
            grid.send_and_receive([], timeout=3600.0)
        except RunStopped as err:
            waited.append(str(err))
            raise
        return {}

    return waits


def test_an_interrupted_simulation_stops_its_server_app_thread_instead_of_waiting_out_the_round(
        fake: FakeFlower, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C reaches the main thread inside run_simulation while the ServerApp's thread waits for replies that
    # will not come: it waited flower.round_timeout_s (an hour) and held the process that long
    waited: list[str] = []
    threads: list[threading.Thread] = []

    def interrupted(server_app: Any, **kwargs: Any) -> None:
        thread = threading.Thread(target=server_app, args=(SilentGrid(), None), daemon=True)  # a failure ends too
        thread.start()
        threads.append(thread)
        raise KeyboardInterrupt

    monkeypatch.setattr(simulation, "run_on_grid", waiting_for_replies(waited))
    monkeypatch.setattr(simulation, "run_simulation", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_flower(fake_server())
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()
    assert waited == ["interrupted while waiting for the clients' replies"]


def test_run_stopped_in_the_server_app_thread_is_raised_again_by_run_flower(fake: FakeFlower) -> None:
    stop = RunStopped("round 2: every client failed")

    def stopped() -> dict[str, Any]:
        raise stop

    fake.outcome = stopped
    with pytest.raises(RunStopped) as raised:
        run_flower(fake_server())
    assert raised.value is stop


def test_a_server_app_that_ended_without_results_is_an_error(fake: FakeFlower) -> None:
    fake.serve = False
    with pytest.raises(RuntimeError, match=r"^the Flower ServerApp ended without results \(see the log above\)$"):
        run_flower(fake_server())


def test_a_roster_is_refused_before_the_simulation_starts(fake: FakeFlower, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^flower\.roster is for deployments \(feddg flower run: its nodes prove their "
                                         r"keys\); the simulation and the in-process engine have no keys$"):
        run_flower(fake_server(f"flower.roster={tmp_path}/roster.yaml"))
    assert fake.simulation == {}


def test_the_deprecation_filter_is_on_the_flwr_logger_once_however_many_runs(fake: FakeFlower) -> None:
    run_flower(fake_server())
    run_flower(fake_server())
    flwr_log = logging.getLogger("flwr")
    assert [type(f).__name__ for f in flwr_log.filters] == ["_NotRunSimulationDeprecation"]
    notice = logging.LogRecord("flwr", logging.WARNING, "", 0, "DEPRECATED FEATURE: `run_simulation` ...", (), None)
    assert not flwr_log.filter(notice)


def test_ray_and_the_actors_get_plain_logs_where_stderr_is_redirected(fake: FakeFlower,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    run_flower(fake_server())
    assert fake.env["FEDDG_PLAIN_LOGS"] == "1" and fake.env["RAY_COLOR_PREFIX"] == "0"
    assert fake.console_colored == [False]


def test_a_terminal_keeps_colour(fake: FakeFlower) -> None:
    run_flower(fake_server())
    assert fake.env["FEDDG_PLAIN_LOGS"] is None and fake.env["RAY_COLOR_PREFIX"] is None
    assert fake.console_colored == []


@pytest.mark.parametrize(("given", "seen"), [(None, "0"), ("1", "1")])
def test_ray_environment_at_start_keeps_a_users_accelerator_override(fake: FakeFlower, monkeypatch: pytest.MonkeyPatch,
                                                                     given: str | None, seen: str) -> None:
    if given is not None:
        monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", given)
    run_flower(fake_server())
    assert fake.env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == seen
    assert fake.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_simulation_ends_it_as_a_finished_run_then_reaches_the_callers_handler(
        fake: FakeFlower, monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    # raised in the main thread, Flower shut Ray down under its workers' pending ray.get: the process hung or Ray
    # ended it before feddg's line; now the ServerApp stops, the simulation returns, and then the signal is raised
    waited: list[str] = []
    threads: list[threading.Thread] = []

    def signalled(server_app: Any, **kwargs: Any) -> None:
        ray_utils.set_sigterm_handler(lambda s, f: None)  # what ray.init does: it must not take SIGTERM over
        thread = threading.Thread(target=server_app, args=(SilentGrid(), None), daemon=True)
        thread.start()
        signal.raise_signal(sig)  # while the clients train: deferred, not raised here
        thread.join(timeout=10)  # Flower's run ends once the ServerApp has
        threads.append(thread)

    monkeypatch.setattr(simulation, "run_on_grid", waiting_for_replies(waited))
    monkeypatch.setattr(simulation, "run_simulation", signalled)
    with stop_signals() as got, pytest.raises(KeyboardInterrupt):  # feddg run's handlers: which signal came
        run_flower(fake_server())
    assert got == {"signal": sig} and not threads[0].is_alive()
    assert waited == ["interrupted while waiting for the clients' replies"]
