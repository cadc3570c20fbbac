"""Mutation audit of the Flower deployment engine's units (security, records, secagg, launch, executor, worker):
fast tests that call each unit directly with small inputs, pinning what the existing tests left open."""

from __future__ import annotations

import datetime
import io
import json
import pickle
import re
import signal
import sys
from collections.abc import Callable
from logging import INFO
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import cast

import numpy as np
import pytest
from cryptography import x509
from flwr.app import Array, RecordDict
from flwr.common import Parameters
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.legacy_context import LegacyContext
from flwr.serverapp import Grid
from test_flower import toy_config, toy_federation_of
from test_flower_units import FakeChild, supervise_on_a_fake_clock
from test_secagg import scaled_workflow

from feddg.config import build_config
from feddg.engines.flower import app, executor, launch, secagg_server, security
from feddg.engines.flower.app import mark
from feddg.engines.flower.records import array_value, get_message, put_message, record_int
from feddg.engines.flower.secagg import fitres_content
from feddg.engines.flower.security import (
    Roster,
    identity_statement,
    key_fingerprint,
    load_private_key,
    load_public_key,
    make_certificates,
    make_node_keys,
)
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped

# --- security.py ---------------------------------------------------------------------------------------------


def test_the_identity_statement_is_the_documented_one() -> None:
    """docs/flower.md: the node signs ``feddg identify v1|challenge|node id|federation fingerprint``; the separators
    keep challenge "a1" of node 2 apart from challenge "a" of node 12."""
    assert identity_statement("c1", 7, "fp") == b"feddg identify v1|c1|7|fp"
    assert identity_statement("a1", 2, "f") != identity_statement("a", 12, "f")


def test_the_test_ca_signs_only_leaf_certificates_with_critical_constraints(tmp_path: Path) -> None:
    """The CA's basicConstraints is critical (RFC 5280 4.2.1.9: MUST for a CA) with pathLen 0 (it issues no
    intermediate CA), its keyUsage is critical; both certificates are valid for a year by default (the CLI's 365)."""
    paths = make_certificates(tmp_path, ["127.0.0.1"])
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).critical
    server = x509.load_pem_x509_certificate(paths["server"].read_bytes())
    for cert in (ca, server):
        assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(days=365)


def test_a_key_file_that_appears_after_the_check_is_still_never_written_over(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are created exclusively: even past the up-front check (a race), an existing key is kept."""
    monkeypatch.setattr(security, "_refuse_existing", lambda paths, what: None)
    tmp_path.joinpath("node0").write_text("the deployed key")
    with pytest.raises(FileExistsError):
        make_node_keys(tmp_path, ["node0"])
    assert tmp_path.joinpath("node0").read_text() == "the deployed key"


def test_node_keys_need_at_least_one_name_and_each_public_key_is_one_line(tmp_path: Path) -> None:
    """No names is refused like a repeated one; a ``.pub`` file is one newline-ended line, as ssh-keygen writes."""
    with pytest.raises(ValueError, match="name each node once"):
        make_node_keys(tmp_path, [])
    (_, public), = make_node_keys(tmp_path, ["node0"])
    text = public.read_text()
    assert text.endswith("\n") and text.count("\n") == 1 and text.startswith("ecdsa-sha2-nistp384 ")


def test_text_that_is_no_key_is_refused_in_feddg_s_words(tmp_path: Path) -> None:
    """A public key that does not parse and a private key file that is not OpenSSH raise feddg's ValueError."""
    with pytest.raises(ValueError, match="^not an OpenSSH public key: 'garbage'$"):
        load_public_key("garbage")
    bad = tmp_path / "node0"
    bad.write_text("garbage")
    with pytest.raises(ValueError, match="not an unencrypted OpenSSH private key$"):
        load_private_key(bad)


def test_a_public_key_with_blank_lines_around_it_loads(tmp_path: Path) -> None:
    """A .pub text with a leading blank line or spaces (a hand-edited file) is the same key."""
    (_, public), = make_node_keys(tmp_path, ["node0"])
    text = public.read_text()
    assert key_fingerprint(load_public_key("\n  " + text + "\n")) == key_fingerprint(load_public_key(text))


#: ``ssh-keygen -t ecdsa -b 384 -N secretpw -C ""``: an OpenSSH private key encrypted with a passphrase
ENCRYPTED_KEY = """-----BEGIN OPENSSH PRIVATE KEY-----
b3BlbnNzaC1rZXktdjEAAAAACmFlczI1Ni1jdHIAAAAGYmNyeXB0AAAAGAAAABCcEUp+Km
PdEzCAgi2/mjIqAAAAEAAAAAEAAACIAAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlz
dHAzODQAAABhBAcASZToXcc0/5vvl5J1t3JWCua63/61XN/Y/3lzCA20955QAPgY6vbx3Z
KXzDP4UherYPPg1y4TWqyzX3JpqgMb88GxGNGD9xvT11aVkEwMwY2zToePi1TIirjtGOGX
4wAAANAWBXcZTFCSXeXPlT/IyRwOYa2aKH/Kj3VxOsUBmRI3ln+Q9AGoI6TSg6MG/sw0k6
21/SWCpvMwixOa50VaC8D07KSlaPNpsvjLClgVNIPiStE4d4d20XR7w8n4vg3WmmfJe+8+
sjzPTmylowR4kyCUF7+Py5ujNxQTiYKpadr28zg3V/REDl2ZVLBofC30UJRaQHzliwKwot
g9NbRy7Udy1U+oOQwpSBv4QFbY91vf3dufZBFhS4q+LrnphjKh56eKVmSD2vDXQ7tEDRYr
bXXM
-----END OPENSSH PRIVATE KEY-----
"""


def test_an_encrypted_node_key_is_refused_as_not_unencrypted(tmp_path: Path) -> None:
    """docs/flower.md: the node's private key is unencrypted (the SuperNode reads it unattended); an encrypted
    one is refused with feddg's one-line ValueError (cryptography's TypeError, 'Key is password-protected, but
    password was not provided', escaped before)."""
    path = tmp_path / "node0"
    path.write_text(ENCRYPTED_KEY)
    with pytest.raises(ValueError, match="not an unencrypted OpenSSH private key$"):
        load_private_key(path)


def write_rows(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    """A roster file of ``rows`` (JSON is YAML) beside the keys in ``tmp_path``."""
    path = tmp_path / "roster.yaml"
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture
def pubs(tmp_path: Path) -> list[str]:
    """Two node key pairs in ``tmp_path``; their ``.pub`` file names."""
    return [p.name for _, p in make_node_keys(tmp_path, ["node0", "node1"])]


def test_a_roster_may_list_its_clients_in_any_order(tmp_path: Path, pubs: list[str]) -> None:
    """Clients 0..K-1 each once, in any order: the entry for each key is that key's client."""
    roster = Roster.load(write_rows(tmp_path, [{"client": 1, "name": "B", "public_key": pubs[1]},
                                               {"client": 0, "name": "A", "public_key": pubs[0]}]), 2)
    fp0 = key_fingerprint(load_public_key(tmp_path.joinpath(pubs[0]).read_text()))
    assert (roster.by_fingerprint[fp0].client, roster.by_fingerprint[fp0].name) == (0, "A")


@pytest.mark.parametrize(("field", "value"), [("name", ""), ("public_key", ""), ("client", "x")])
def test_a_roster_entry_with_an_empty_or_malformed_field_is_refused_naming_it(tmp_path: Path, pubs: list[str],
                                                                              field: str, value: object) -> None:
    """Every entry has a name and a key (non-empty) and a whole-number client: refused in one line naming the field."""
    rows: list[dict[str, object]] = [{"client": 0, "name": "A", "public_key": pubs[0]},
                                     {"client": 1, "name": "B", "public_key": pubs[1]}]
    rows[1][field] = value
    path = write_rows(tmp_path, rows)
    with pytest.raises(ValueError, match=rf"^roster {re.escape(str(path))}: \('{field}',\) "):
        Roster.load(path, 2)


# --- records.py ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, np.array([object()], dtype=object), [1, 2]])
def test_a_message_holding_anything_but_arrays_and_scalars_is_refused_before_it_is_encoded(value: object) -> None:
    """put_message validates first: a bool would otherwise cross as the int 1, and a list or object array crash."""
    with pytest.raises(TypeError, match="'flag'"):
        put_message(RecordDict(), {"flag": value})  # type: ignore[dict-item]


def test_an_array_whose_npy_header_is_longer_than_128_bytes_decodes() -> None:
    """The bytes after the header are counted from where the header ends (30 axes: a 192-byte header, 4 data bytes)."""
    value = np.full((1,) * 30, 2.5, np.float32)
    got = array_value(Array(value))
    assert got.shape == value.shape and got.dtype == np.float32 and float(got.reshape(-1)[0]) == 2.5
    back = get_message(put_message(RecordDict(), {"w/deep": value}))["w/deep"]
    assert isinstance(back, np.ndarray) and back.shape == value.shape


def test_a_record_scalar_in_bytes_reads_as_an_int() -> None:
    """bytes is one of Flower's record scalars: read as int() reads it."""
    assert record_int(b"12") == 12


def test_a_pickle_dressed_as_an_object_array_with_a_matching_header_is_never_unpickled() -> None:
    """A forged reply whose .npy header (object dtype, 8 bytes an item) declares exactly the pickle's padded length
    passes the size check; decoding must still refuse to unpickle it (pickles run code), with a ValueError."""
    body = pickle.dumps(["not an array"])
    body += bytes(-len(body) % 8)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|O", "fortran_order": False, "shape": (len(body) // 8,)})
    forged = Array(dtype="float32", shape=(len(body) // 8,), stype="numpy.ndarray", data=header.getvalue() + body)
    with pytest.raises(ValueError, match="allow_pickle=False"):
        array_value(forged)


# --- secagg.py, secagg_server.py -----------------------------------------------------------------------------


def test_a_secure_reply_without_its_count_is_refused_not_weighed_as_one() -> None:
    """A client's FitRes carries the reply's own num_examples: a reply without one cannot be masked (KeyError)."""
    sent = {"w/a": np.zeros(2, np.float32)}
    with pytest.raises(KeyError, match="num_examples"):
        fitres_content(sent, {"w/a": np.ones(2, np.float32), "train_loss": 0.5})


def test_a_secure_round_whose_workflow_aggregates_no_client_stops_the_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A workflow that calls aggregate_fit with no results (every client dropped) halts the run in one line, as
    one that never aggregates does; nothing is folded."""

    def no_results(grid: Grid, context: LegacyContext) -> None:
        strategy = cast(secagg_server.SecureRound, context.strategy)
        strategy.configure_fit(1, Parameters([], ""), SimpleClientManager())
        strategy.aggregate_fit(1, [], [])

    monkeypatch.setattr(secagg_server, "workflow", lambda cfg, max_weight, timeout: no_results)
    server = Server(toy_federation_of(toy_config("federation.engine=flower", "flower.secure_aggregation=secaggplus",
                                                 "flower.round_timeout_s=5")), tmp_path / "run")
    with pytest.raises(RunStopped, match=r"^round 1: secure aggregation halted"):
        secagg_server.run_secure_rounds(server, cast(Grid, None), {0: 1000, 1: 1001, 2: 1002, 3: 1003})
    assert server.round == 0


def test_a_secure_round_s_row_carries_its_training_time_as_every_engine_s_does(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """metrics.jsonl rows of every engine hold ``time_train_s`` (the reports' time split reads it): a secure round's
    row too, a non-negative number of seconds."""
    fake = scaled_workflow({1: 0.5}, {1: 4}, [])
    monkeypatch.setattr(secagg_server, "workflow", lambda cfg, max_weight, timeout: fake)
    server = Server(toy_federation_of(toy_config("federation.engine=flower", "flower.secure_aggregation=secaggplus",
                                                 "federation.rounds=1")), tmp_path / "run")
    rows: list[dict[str, object]] = []
    secagg_server.run_secure_rounds(server, cast(Grid, None), {0: 1000, 1: 1001, 2: 1002, 3: 1003}, rows.append)
    [row] = rows
    assert isinstance(row["time_train_s"], float) and row["time_train_s"] >= 0


# --- launch.py -----------------------------------------------------------------------------------------------


def test_the_server_app_logs_each_rounds_loss_and_the_id_val_and_ood_means_to_two_places(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ServerApp's line per round (what `flwr log` shows): the training loss and the task metric's id, val and ood
    means rounded to 0.01, not its per-domain figures."""
    lines: list[tuple[object, ...]] = []
    monkeypatch.setattr(app, "log", lambda *args: lines.append(args))
    app._round_logger("dice")({"round": 3, "train_loss": 0.25, "id_dice": 80.125, "val_dice": 70.0, "ood_dice": 60.456,
                               "ood_dice/BIDMC": 1.0, "id_acc": 5.0})
    assert lines == [(INFO, "feddg round %d: train_loss %.4f %s", 3, 0.25,
                      {"id_dice": 80.12, "val_dice": 70.0, "ood_dice": 60.46})]


def test_only_a_completed_mark_with_results_is_a_success(tmp_path: Path) -> None:
    """A results.json beside a failed mark (e.g. left by an earlier run) is no success: the mark decides."""
    mark(tmp_path, "failed", "ValueError: x")
    (tmp_path / "results.json").write_text("{}")
    assert launch.outcome(tmp_path) == f"{tmp_path}: run failed: ValueError: x"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_status_file_that_is_no_mark_is_named_as_such_not_as_missing(tmp_path: Path, text: str) -> None:
    """A status.json that does not parse, or is no JSON object, is reported as what it is (it read "no status.json")."""
    (tmp_path / "status.json").write_text(text)
    assert launch.outcome(tmp_path) == (f"{tmp_path}: status.json is not a status mark (unreadable, or not a JSON "
                                        "object): see `flwr log`")
    (tmp_path / "status.json").unlink()
    assert launch.outcome(tmp_path).startswith(f"{tmp_path}: no status.json: the ServerApp did not start")


def test_a_config_toml_that_does_not_parse_gives_no_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The insecure check never raises on a broken config.toml (flwr itself reports it)."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text("[superlink.lab\ninsecure = true\n")
    assert launch.insecure_warning("lab") is None


def executable(path: Path) -> Path:
    """An empty executable file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_environment_s_flwr_comes_before_one_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flwr_command: the ``flwr`` beside ``sys.executable`` first, another on PATH only when there is none there."""
    own, other = executable(tmp_path / "venv" / "bin" / "flwr"), executable(tmp_path / "elsewhere" / "flwr")
    monkeypatch.setenv("PATH", str(other.parent))
    monkeypatch.setattr(sys, "executable", str(own.parent / "python"))
    assert launch.flwr_command() == str(own)
    own.unlink()
    assert launch.flwr_command() == str(other)


def flower_app(tmp_path: Path) -> Path:
    """A folder that passes for a Flower App (it holds a pyproject.toml)."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "pyproject.toml").write_text("")
    return tmp_path / "app"


def refuse_to_run(argv: list[str]) -> None:
    raise AssertionError(f"flwr ran: {argv}")


def test_without_flwr_nothing_is_submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``flwr`` beside this Python or on PATH: refused in feddg's words before anything runs."""
    monkeypatch.setattr(launch, "flwr_command", lambda: None)
    monkeypatch.setattr(launch.subprocess, "run", refuse_to_run)
    with pytest.raises(ValueError, match="^no `flwr` command beside "):
        launch.submit(build_config({}), tmp_path / "run", "lab", flower_app(tmp_path))


def test_a_folder_without_a_pyproject_is_no_flower_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--app-dir must hold a pyproject.toml: an existing folder without one is refused before flwr runs."""
    monkeypatch.setattr(launch, "flwr_command", lambda: "/opt/flwr")
    monkeypatch.setattr(launch.subprocess, "run", refuse_to_run)
    (tmp_path / "app").mkdir()
    with pytest.raises(ValueError, match="no Flower App there"):
        launch.submit(build_config({}), tmp_path / "run", "lab", tmp_path / "app")


class FakeClock:
    """time.monotonic / time.sleep of launch on a fake clock; ``at`` calls a function once the clock reaches it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: dict[float, Callable[[], None]] | None = None) -> None:
        self.now, self.at = 0.0, dict(at or {})
        monkeypatch.setattr(launch.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(launch.time, "sleep", self.sleep)

    def sleep(self, s: float) -> None:
        self.now += s
        for t in [t for t in self.at if t <= self.now]:
            self.at.pop(t)()


def test_the_launcher_waits_30_s_by_default_for_a_running_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/flower.md: the launcher waits up to 30 s (polling every 0.5 s) for a ``running`` mark to change."""
    clock = FakeClock(monkeypatch)
    mark(tmp_path, "running")
    assert "without a mark" in str(launch.settled_outcome(tmp_path))
    assert clock.now == 30.0


def test_submit_reports_the_mark_the_server_app_writes_after_flwr_returned(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """On flwr stop the stream ends before the ServerApp marks its run: submit waits for the mark to settle."""
    run_dir = tmp_path / "run"
    clock = FakeClock(monkeypatch, {2.0: lambda: mark(run_dir, "stopped", "by flwr stop")})

    def flwr_run(argv: list[str]) -> SimpleNamespace:
        mark(run_dir, "running")
        return SimpleNamespace(returncode=0)

    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "flwr_command", lambda: "/opt/flwr")
    monkeypatch.setattr(launch.subprocess, "run", flwr_run)
    assert launch.submit(build_config({}), run_dir, "lab", flower_app(tmp_path)) == f"{run_dir}: run stopped: by flwr stop"
    assert clock.now == 2.0


# --- executor.py, worker.py ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("stat", "alive"), [("42 (x) Z (y) S 1 42", True), ("42 (x) S (y) Z 1 42", False)])
def test_a_process_whose_name_holds_a_parenthesis_is_judged_by_the_state_after_its_name(
        monkeypatch: pytest.MonkeyPatch, stat: str, alive: bool) -> None:
    """/proc/PID/stat is ``pid (comm) state ...`` and comm may hold ") Z (": the state follows the last ")"."""
    monkeypatch.setattr(executor.os, "kill", lambda pid, sig: None)
    monkeypatch.setattr(executor, "Path", lambda path: SimpleNamespace(read_text=lambda: stat))
    assert executor.alive(42) is alive


def test_without_proc_a_process_that_takes_signals_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc cannot be read (not Linux) the signal test alone decides: a process it reaches is alive."""

    def no_proc() -> str:
        raise FileNotFoundError("/proc/42/stat")

    monkeypatch.setattr(executor.os, "kill", lambda pid, sig: None)
    monkeypatch.setattr(executor, "Path", lambda path: SimpleNamespace(read_text=no_proc))
    assert executor.alive(42)


def test_a_worker_that_dies_within_a_minute_of_its_start_doubles_the_pause(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """docs/flower.md: another worker starts after 1 s, longer each time one dies within a minute of its start:
    lives of 59, 59, 61 and 0 s give pauses of 2, 4, 1 and 2 s."""
    supervise_on_a_fake_clock(monkeypatch, [59.0, 59.0, 61.0, 0.0], lambda clock, started: started < 4)
    assert [line.split("starts in ")[1] for line in capsys.readouterr().err.splitlines()] == ["2 s", "4 s", "1 s", "2 s"]


def test_the_executor_hands_its_worker_the_address_poll_interval_and_tls(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``executor --poll-interval`` reaches the worker it supervises, with the address and the resolved CA."""
    ca = tmp_path / "ca.pem"
    ca.write_text("CA")
    started: list[tuple[list[str], int | None]] = []
    monkeypatch.setattr(executor, "supervise", lambda args, parent: started.append((args, parent)))
    monkeypatch.setattr(sys, "argv", ["executor", "--runtime-api-address", "127.0.0.1:9", "--poll-interval", "0.25",
                                      "--root-certificates", str(ca)])
    executor.main()
    assert started == [(["--runtime-api-address", "127.0.0.1:9", "--poll-interval", "0.25",
                         "--root-certificates", str(ca.resolve())], None)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_executor_ends_its_worker_on_sigterm_and_sigint(monkeypatch: pytest.MonkeyPatch, signum: int) -> None:
    """The executor ends on SIGTERM/SIGINT (its docstring) with exit code 0, terminating the worker it started."""
    handlers: dict[int, Callable[[int, FrameType | None], None]] = {}
    clock = [0.0]
    children: list[FakeChild] = []

    def popen(argv: list[str]) -> FakeChild:
        children.append(FakeChild(clock, 1e9))
        return children[-1]

    def sleep(s: float) -> None:
        clock[0] += s
        handlers[signum](signum, None)  # the signal arrives while the worker runs

    monkeypatch.setattr(executor.signal, "signal", lambda sig, handler: handlers.__setitem__(sig, handler))
    monkeypatch.setattr(executor.subprocess, "Popen", popen)
    monkeypatch.setattr(executor.time, "sleep", sleep)
    monkeypatch.setattr(executor, "alive", lambda pid: True)
    with pytest.raises(SystemExit) as exit:
        executor.supervise(["--insecure"], 42)
    assert exit.value.code == 0 and [c.terminated for c in children] == [True]
