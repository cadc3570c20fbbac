"""A secure Flower deployment: test certificates, node keys, the roster's identity proofs, the insecure path's
warning, run-directory marks, and one loopback deployment with TLS + SuperNode auth + a roster (and a rogue node)."""

import datetime
import ipaddress
import json
import os
import re
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.cli.supernode.register import try_load_public_key
from support.flower_local import LocalDeployment
from support.flower_messages import pushed
from toy import toy_federation_of

from feddg.config import ConfigError, build_config, dump_config
from feddg.engines.flower import client as flower_client
from feddg.engines.flower import server as flower_server
from feddg.engines.flower.app import mark
from feddg.engines.flower.client import IDENTIFY, ROUTE, make_client_app
from feddg.engines.flower.executor import INSECURE_WARNING, tls_args
from feddg.engines.flower.launch import outcome, submit
from feddg.engines.flower.records import put_message
from feddg.engines.flower.security import (
    Roster,
    identity_statement,
    key_fingerprint,
    load_private_key,
    load_public_key,
    make_certificates,
    make_node_keys,
    public_key_text,
    sign,
)
from feddg.engines.flower.server import Refused, collect, discover_clients, roster_identity


def test_the_server_certificate_is_issued_by_the_ca_for_the_given_hosts(tmp_path):
    paths = make_certificates(tmp_path, ["127.0.0.1", "node1.example"])
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    server = x509.load_pem_x509_certificate(paths["server"].read_bytes())
    server.verify_directly_issued_by(ca)  # raises unless the CA's key signed it
    ca.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["node1.example"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    other = make_certificates(tmp_path / "other", ["127.0.0.1"])
    with pytest.raises(InvalidSignature):  # another CA's certificate does not chain to this CA
        x509.load_pem_x509_certificate(other["server"].read_bytes()).verify_directly_issued_by(ca)
    assert oct(paths["server-key"].stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="--host"):
        make_certificates(tmp_path, [])


def test_the_server_key_pairs_with_its_certificate_for_tls_serving_for_the_given_days(tmp_path: Path) -> None:
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)  # a certificate's times are in whole seconds
    paths = make_certificates(tmp_path, ["127.0.0.1"], days=30)
    after = datetime.datetime.now(datetime.UTC)
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    server = x509.load_pem_x509_certificate(paths["server"].read_bytes())
    key = serialization.load_pem_private_key(paths["server-key"].read_bytes(), None)
    ca_key = serialization.load_pem_private_key(paths["ca-key"].read_bytes(), None)
    assert key.public_key() == server.public_key() and ca_key.public_key() == ca.public_key()  # TLS serves with it
    assert server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH])  # a TLS client refuses a server certificate without serverAuth
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign is True
    for cert in (ca, server):
        assert before <= cert.not_valid_before_utc <= after  # valid from its making, not hours later
        assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(days=30)


#: an OpenSSH P-384 public key written by `ssh-keygen -t ecdsa -b 384`
SSH_KEY = ("ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBHv14E5ndmsIkYdEanPCpyQsowwPFki+Z6"
           "DFK40EHnc8QworhjY15ySkDhLE3PZyjqcuv+XtpEqB+ZuvOKYQ9N72GjX6dR8TpNuJbLF/X5vX/PZKl2k+EeHAoWArFbL7Qw==")


def test_a_key_fingerprint_is_the_one_ssh_keygen_prints() -> None:
    # `ssh-keygen -lf` of this key printed SHA256:/hn0Hb/3eVVof2IjjS/X40W2CZdd1Q1X4fQIQOfRhjE
    assert key_fingerprint(load_public_key(SSH_KEY)) == "SHA256:/hn0Hb/3eVVof2IjjS/X40W2CZdd1Q1X4fQIQOfRhjE"


def test_keys_that_are_not_elliptic_curve_keys_are_refused(tmp_path: Path) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    with pytest.raises(ValueError, match="not an EC public key"):
        load_public_key(public.decode())
    private = tmp_path / "node"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    with pytest.raises(ValueError, match="not an EC private key"):
        load_private_key(private)


def test_node_keys_are_p384_openssh_pairs_that_flower_accepts(tmp_path):
    (private, public), _ = make_node_keys(tmp_path, ["node0", "node1"])
    key = load_private_key(private)
    assert isinstance(key.curve, ec.SECP384R1)
    assert public_key_text(key.public_key()) == public.read_text().strip()
    assert try_load_public_key(public)  # what `flwr supernode register node0.pub` reads
    fp = key_fingerprint(load_public_key(public.read_text()))
    assert fp.startswith("SHA256:") and len(fp) == 7 + 43  # 32 bytes, unpadded base64
    with pytest.raises(ValueError, match="once"):
        make_node_keys(tmp_path, ["a", "a"])


def test_keys_and_certificates_are_never_written_over_and_private_keys_are_never_readable_by_others(tmp_path):
    old_umask = os.umask(0)  # the widest umask: the mode must come from the creation itself
    try:
        paths = make_certificates(tmp_path / "pki", ["127.0.0.1"])
        (private, _), = make_node_keys(tmp_path / "keys", ["node0"])
    finally:
        os.umask(old_umask)
    assert {k: oct(v.stat().st_mode & 0o777) for k, v in paths.items()} == {
        "ca": "0o644", "ca-key": "0o600", "server": "0o644", "server-key": "0o600"}
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    ca_key = paths["ca-key"].read_bytes()
    with pytest.raises(FileExistsError, match="already holds ca.pem, ca.key, server.pem, server.key"):
        make_certificates(tmp_path / "pki", ["127.0.0.1"])
    assert paths["ca-key"].read_bytes() == ca_key  # the CA the nodes trust is kept
    node0 = private.read_bytes()
    with pytest.raises(FileExistsError, match="already holds node0, node0.pub"):
        make_node_keys(tmp_path / "keys", ["node1", "node0"])
    assert private.read_bytes() == node0 and not (tmp_path / "keys" / "node1").exists()  # nothing half-written
    for bad in ("a/b", "..", ".hidden"):
        with pytest.raises(ValueError, match="file name"):
            make_node_keys(tmp_path / "more", [bad])
    with pytest.raises(ValueError, match="--host"):
        make_certificates(tmp_path / "blank", [" "])


def test_a_link_where_a_key_would_be_written_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # a dangling link (it could lead anywhere) counts as a file already there: refused in one line, nothing written
    for folder, link, make in (("pki", "server.key", lambda: make_certificates(tmp_path / "pki", ["127.0.0.1"])),
                               ("keys", "node0.pub", lambda: make_node_keys(tmp_path / "keys", ["node0"]))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / link).symlink_to(tmp_path / "elsewhere")
        with pytest.raises(FileExistsError, match=f"already holds {link}: writing"):
            make()
        assert [p.name for p in (tmp_path / folder).iterdir()] == [link]
    assert not (tmp_path / "elsewhere").exists()


def test_a_relative_roster_path_is_refused_when_the_config_loads(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^flower.roster: give an absolute path \(the ServerApp reads it from its "
                                          r"own working directory\), got 'keys/roster.yaml'$"):
        build_config({}, ["flower.roster=keys/roster.yaml"])
    assert build_config({}, [f"flower.roster={tmp_path}/r.yaml"]).flower.roster == f"{tmp_path}/r.yaml"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build_config({}, ["flower.roster=~/r.yaml"]).flower.roster == f"{tmp_path}/r.yaml"


@pytest.mark.parametrize("engine", ["inprocess", "flower"])
def test_a_roster_outside_a_deployment_is_refused_before_the_run_directory_is_made(tmp_path, engine):
    from typer.testing import CliRunner

    from feddg.cli import app

    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "configs/demo.yaml", "--run-dir", str(run_dir), "--engine", engine,
                                      "-o", f"flower.roster={tmp_path}/roster.yaml"])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "error: flower.roster is for deployments (feddg flower run: its nodes prove their keys); the simulation and "
        "the in-process engine have no keys"]
    assert not run_dir.exists()


@pytest.fixture
def keys(tmp_path):
    pairs = make_node_keys(tmp_path, ["node0", "node1", "rogue"])
    return {p[0].name: (load_private_key(p[0]), p[1]) for p in pairs}


def write_roster(tmp_path: Path, keys: dict, entries: list[tuple[int, str, str]]) -> Path:
    """Entries (client, name, key name); node1's key is given by fingerprint, the others by file."""
    rows = [{"client": c, "name": n, "public_key": key_fingerprint(load_public_key(keys[k][1].read_text()))
             if k == "node1" else f"{k}.pub"} for c, n, k in entries]
    path = tmp_path / "roster.yaml"
    path.write_text(json.dumps(rows))
    return path


def test_a_roster_lists_each_client_once_with_distinct_keys(tmp_path, keys):
    roster = Roster.load(write_roster(tmp_path, keys, [(0, "St Mary's", "node0"), (1, "Guy's", "node1")]), 2)
    assert sorted(e.name for e in roster.by_fingerprint.values()) == ["Guy's", "St Mary's"]
    for entries, why in (([(0, "a", "node0")], "want 0..1"), ([(0, "a", "node0"), (0, "b", "node1")], "want 0..1"),
                         ([(0, "a", "node0"), (1, "b", "node1"), (1, "c", "rogue")], "want 0..1, each once"),
                         ([(0, "a", "node0"), (1, "b", "node0")], "share a public key"),
                         ([(0, "a", "node0"), (1, "a", "node1")], "share a name")):
        with pytest.raises(ValueError, match=why):
            Roster.load(write_roster(tmp_path, keys, entries), 2)
    (tmp_path / "roster.yaml").write_text("client: 0\nname: a\npublic_key: node0.pub\n")  # one entry, not a list
    with pytest.raises(ValueError, match="want a YAML list of {client, name, public_key} entries"):
        Roster.load(tmp_path / "roster.yaml", 1)


def reply(node_id: int, info: dict) -> SimpleNamespace:
    """What roster_identity reads of a Flower reply."""
    return SimpleNamespace(metadata=SimpleNamespace(src_node_id=node_id), has_error=lambda: False,
                           content=SimpleNamespace(config_records={ROUTE: ConfigRecord(info)}))


def proof(key: ec.EllipticCurvePrivateKey, challenge: str, node_id: int, shown=None) -> dict:
    """A node's identify answer: ``shown``'s public key (default: its own), signed with ``key``."""
    return {"fingerprint": "fed", "public-key": public_key_text((shown or key).public_key()),
            "signature": sign(key, identity_statement(challenge, node_id, "fed"))}


def test_the_roster_refuses_unknown_forged_duplicate_and_unproven_nodes(tmp_path, keys):
    roster = Roster.load(write_roster(tmp_path, keys, [(0, "St Mary's", "node0"), (1, "Guy's", "node1")]), 2)
    node0, node1, rogue = (keys[k][0] for k in ("node0", "node1", "rogue"))
    assert roster_identity(roster, reply(11, proof(node1, "c1", 11)), "c1", {}).client == 1
    with pytest.raises(Refused, match="is not in the roster"):  # a key the SuperLink may know, feddg does not
        roster_identity(roster, reply(12, proof(rogue, "c2", 12)), "c2", {})
    with pytest.raises(Refused, match="forged identity: .* St Mary's"):  # node0's public key, the rogue's signature
        roster_identity(roster, reply(12, proof(rogue, "c2", 12, shown=node0)), "c2", {})
    with pytest.raises(Refused, match="forged identity"):  # node0's own signature, replayed for another challenge
        roster_identity(roster, reply(12, proof(node0, "old", 12)), "c2", {})
    with pytest.raises(Refused, match="forged identity"):  # ... or from another node id
        roster_identity(roster, reply(12, proof(node0, "c2", 10)), "c2", {})
    with pytest.raises(Refused, match="forged identity"):  # ... or for another federation
        roster_identity(roster, reply(12, {**proof(node0, "c2", 12), "fingerprint": "other"}), "c2", {})
    with pytest.raises(Refused, match="forged identity"):  # a signature that is not hex refuses, never raises
        roster_identity(roster, reply(12, {**proof(node0, "c2", 12), "signature": "not hex"}), "c2", {})
    with pytest.raises(Refused, match=r"client 0 \(St Mary's\) is already node 10"):
        roster_identity(roster, reply(12, proof(node0, "c2", 12)), "c2", {0: 10})
    with pytest.raises(Refused, match="no identity proof"):  # a node declaring partition-id=0 only
        roster_identity(roster, reply(12, {"partition-id": 0, "num-partitions": 2, "fingerprint": "fed"}), "c2", {})
    # malformed proofs are refused like any other (they raised KeyError out of discovery, ending the run)
    with pytest.raises(Refused, match="its identity proof lacks public-key, fingerprint"):
        roster_identity(roster, reply(12, {"signature": "00"}), "c2", {})
    no_route = SimpleNamespace(metadata=SimpleNamespace(src_node_id=12), has_error=lambda: False, content=RecordDict())
    with pytest.raises(Refused, match="no identity proof"):
        roster_identity(roster, no_route, "c2", {})


class RosterGrid:
    """Nodes that answer a roster's challenge with ``signers[node]``'s key; ``late`` join on the second poll."""

    def __init__(self, signers: dict[int, ec.EllipticCurvePrivateKey], late: set[int]) -> None:
        self.signers, self.late, self.polls = signers, late, 0
        self.challenged: list[int] = []

    def get_node_ids(self) -> list[int]:
        self.polls += 1
        return [n for n in self.signers if self.polls > 1 or n not in self.late]

    def send_and_receive(self, messages: list[Message], *, timeout: float) -> list[SimpleNamespace]:
        route = [(m.metadata.dst_node_id, m.content.config_records[ROUTE]["challenge"]) for m in messages]
        self.challenged += [n for n, _ in route]
        return [reply(n, proof(self.signers[n], str(c), n)) for n, c in route]


@pytest.mark.usefixtures("task_identity")
def test_discovery_refuses_a_rogue_node_once_and_waits_for_the_roster_clients(tmp_path, keys, monkeypatch):
    monkeypatch.setattr(flower_server, "fingerprint", lambda fed: "fed")
    monkeypatch.setattr(flower_server.time, "sleep", lambda s: None)
    roster = write_roster(tmp_path, keys, [(0, "St Mary's", "node0"), (1, "Guy's", "node1")])
    fed = SimpleNamespace(clients=[0, 1], cfg=SimpleNamespace(flower=SimpleNamespace(roster=str(roster))))
    grid = RosterGrid({10: keys["rogue"][0], 11: keys["node1"][0], 12: keys["node0"][0]}, late={11, 12})
    run = tmp_path / "run"
    run.mkdir()
    (run / "provenance.json").write_text("{}")
    assert discover_clients(grid, SimpleNamespace(fed=fed, round=0, rounds=2, run_dir=run), 60.0) == {0: 12, 1: 11}
    assert grid.challenged == [10, 11, 12]  # the refused node is not challenged again on the next poll
    [session] = json.loads((run / "provenance.json").read_text())["flower_nodes"]  # who trained: the sign-off record
    fp = {k: key_fingerprint(load_public_key(keys[k][1].read_text())) for k in ("node0", "node1")}
    assert session["after_round"] == 0 and session["clients"] == {
        "0": {"node": 12, "by": "roster key", "name": "St Mary's", "key": fp["node0"], "state_dir": False},
        "1": {"node": 11, "by": "roster key", "name": "Guy's", "key": fp["node1"], "state_dir": False}}
    assert [line.split(": key")[0] for line in session["refused"]] == ["node 10"]
    with pytest.raises(TimeoutError, match=r"clients \[0\] did not connect .*; refused 1 node\(s\): node 10: key "):
        discover_clients(RosterGrid({10: keys["rogue"][0], 11: keys["node1"][0]}, late=set()),
                         SimpleNamespace(fed=fed, round=0, rounds=2, run_dir=run), 0.0)


class ChallengeRecordingGrid(RosterGrid):
    """A RosterGrid that keeps every challenge it was sent."""

    def __init__(self, signers: dict[int, ec.EllipticCurvePrivateKey]) -> None:
        super().__init__(signers, late=set())
        self.challenges: list[str] = []

    def send_and_receive(self, messages: list[Message], *, timeout: float) -> list[SimpleNamespace]:
        self.challenges += [str(m.content.config_records[ROUTE]["challenge"]) for m in messages]
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.usefixtures("task_identity")
def test_every_node_gets_a_fresh_random_challenge_so_a_recorded_proof_cannot_be_replayed(tmp_path, keys, monkeypatch):
    """A proof signs its challenge (docs/flower.md): challenges are 256 random bits (64 hex digits), one per node and
    per discovery, never repeated, so a proof captured from one run does not answer the next."""
    monkeypatch.setattr(flower_server, "fingerprint", lambda fed: "fed")
    roster = write_roster(tmp_path, keys, [(0, "St Mary's", "node0"), (1, "Guy's", "node1")])
    fed = SimpleNamespace(clients=[0, 1], cfg=SimpleNamespace(flower=SimpleNamespace(roster=str(roster))))
    sent = []
    for _ in range(2):
        grid = ChallengeRecordingGrid({11: keys["node1"][0], 12: keys["node0"][0]})
        assert discover_clients(grid, SimpleNamespace(fed=fed, round=0, rounds=2, run_dir=tmp_path), 60.0) == {
            0: 12, 1: 11}
        sent += grid.challenges
    assert len(sent) == 4 and len(set(sent)) == 4
    assert all(re.fullmatch(r"[0-9a-f]{64}", c) for c in sent)


def test_a_reply_whose_records_do_not_decode_is_that_clients_failure_not_the_runs():
    content = put_message(RecordDict(), {"w/a": np.ones(2, np.float32), "num_examples": 3, "train_loss": 0.5})
    content["layout"] = ConfigRecord({"order": [*content["layout"]["order"], "ghost"]})  # names a key of no record
    sent = {4: SimpleNamespace(metadata=SimpleNamespace(message_id="m4"))}
    got = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m4", src_node_id=9), has_error=lambda: False,
                          content=content)
    replies, failed = collect(sent, [got], 60)
    assert replies == [] and failed[4].startswith("node 9: unreadable reply (KeyError")


@pytest.mark.usefixtures("task_identity")
def test_a_node_with_its_key_answers_the_challenge_through_the_client_app(tmp_path, keys, monkeypatch):
    monkeypatch.setattr(flower_client, "_FEDERATIONS", OrderedDict())
    text = dump_config(build_config({"partition": {"kind": "by_domain", "num_clients": 2}, "split": {"target": "c"},
                                     "device": "cpu"}))
    app = make_client_app(text, factory=toy_federation_of)
    roster = Roster.load(write_roster(tmp_path, keys, [(0, "St Mary's", "node0"), (1, "Guy's", "node1")]), 2)
    msg = pushed(Message(RecordDict({ROUTE: ConfigRecord({"node-id": 7, "challenge": "abc"})}), 7, IDENTIFY))
    node = {"auth-key": str(tmp_path / "node1"), "partition-id": 0, "num-partitions": 2}  # declares 0, is 1
    answer = app(msg, Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={}))
    answer.metadata.__dict__["_src_node_id"] = 7
    assert roster_identity(roster, answer, "abc", {}).client == 1
    assert "partition-id" not in answer.content.config_records[ROUTE]
    # a ServerApp without a roster sends no challenge: the node refuses rather than serve its declared partition
    plain = pushed(Message(RecordDict({ROUTE: ConfigRecord({"node-id": 7})}), 7, IDENTIFY))
    with pytest.raises(ValueError, match="answers only a roster's challenge: the run has no flower.roster"):
        app(plain, Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={}))


def test_the_insecure_runtime_api_is_only_used_when_asked_for_with_a_warning(tmp_path, capsys):
    assert tls_args(None, True) == ["--insecure"]
    assert INSECURE_WARNING in capsys.readouterr().err
    ca = make_certificates(tmp_path, ["127.0.0.1"])["ca"]
    assert tls_args(str(ca), False) == ["--root-certificates", str(ca)]
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit, match="no such file"):
        tls_args(str(tmp_path / "missing.pem"), False)


def test_a_run_directory_says_whether_it_holds_a_result(tmp_path):
    assert "no status.json" in outcome(tmp_path)
    mark(tmp_path, "running")  # a ServerApp killed mid-run leaves this
    assert "without a mark" in outcome(tmp_path)
    mark(tmp_path, "stopped", "stopped from outside\n(KeyboardInterrupt)")
    assert outcome(tmp_path).endswith("run stopped: stopped from outside (KeyboardInterrupt)")
    mark(tmp_path, "completed")
    assert "without a mark" not in outcome(tmp_path) and outcome(tmp_path) is not None  # no results.json yet
    (tmp_path / "results.json").write_text("{}")
    assert outcome(tmp_path) is None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalDeployment reads /proc")
def test_a_deployment_with_tls_node_auth_and_a_roster_refuses_a_rogue_node(tmp_path, cache_dir, keys, monkeypatch):
    bin_dir = Path(sys.executable).parent
    if not all((bin_dir / b).exists() for b in ("flower-superlink", "flower-supernode", "flwr")):
        pytest.skip("Flower's binaries are not installed beside this Python")
    tls = make_certificates(tmp_path / "certs", ["127.0.0.1"])
    roster = write_roster(tmp_path, keys, [(0, "St Mary's", "node0"), (1, "Guy's", "node1")])
    cfg = build_config(
        {"name": "secure", "seed": 1, "device": "cpu",
         "data": {"dataset": "digits-dg", "max_per_domain": 40, "cache_dir": str(cache_dir)},
         "split": {"target": "synth"}, "partition": {"kind": "iid", "num_clients": 2},
         "model": {"name": "cnn"}, "federation": {"rounds": 1, "batch_size": 32},
         "flower": {"roster": str(roster), "node_wait_s": 60}})
    key_paths = [tmp_path / k for k in ("node0", "node1", "rogue")]
    configs = [f'auth-key="{key_paths[0]}"', f'auth-key="{key_paths[1]}"',
               f'auth-key="{key_paths[2]}" partition-id=0 num-partitions=2']  # registered, not in the roster
    dep = LocalDeployment(tmp_path / "deployment", 3, env={"OMP_NUM_THREADS": "1"}, tls=tls, node_keys=key_paths,
                          node_configs=configs)
    with dep:  # a deployment that does not start fails the test, as the plain deployment test does
        run_dir = tmp_path / "run"
        proc = dep.run(cfg, run_dir, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert outcome(run_dir) is None, outcome(run_dir)
        logs = proc.stdout + "".join(p.read_text(errors="replace") for p in dep.workdir.glob("*.log"))
        assert "refused node" in logs and "is not in the roster" in logs, logs[-3000:]
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["clients"] for r in rows] == [2]
        # a ServerApp that fails (its roster is gone): `flwr run` exits 0, feddg's launcher reports the failure
        shutil.move(roster, tmp_path / "gone.yaml")
        monkeypatch.setenv("FLWR_HOME", dep.env["FLWR_HOME"])
        monkeypatch.setenv("PATH", dep.env["PATH"])
        failure = submit(cfg, tmp_path / "failed", "feddg-local", Path(__file__).resolve().parents[1] / "flower")
        assert failure is not None and "run failed" in failure and "roster.yaml" in failure, failure
        assert not (tmp_path / "failed" / "results.json").exists()
        left = dep.stop()
    assert left == set(), f"processes outlived the deployment: {left}"
