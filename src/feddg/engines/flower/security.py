"""A secure Flower deployment's pieces: test certificates, node key pairs, the roster, identity proofs.

- :func:`make_certificates`: a CA and a server certificate for the given host names and IPs (subject
  alternative names), for tests and trials; a real deployment uses its organisation's PKI (docs/flower.md).
- :func:`make_node_keys`: ECDSA P-384 key pairs in OpenSSH format, as Flower 1.41's SuperNode
  authentication reads them (``--auth-supernode-private-key KEY``, ``flwr supernode register KEY.pub``).
- :class:`Roster`: who client k is (``flower.roster``): one entry per client, with a name and a public key.
- :func:`identity_statement`, :func:`sign`, :func:`verify`: a node proves which roster entry it is by
  signing the server's fresh challenge, its Flower node id and its federation fingerprint with the
  private key of that entry (ECDSA with SHA-256, as Flower's own node authentication signs).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import os
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import Field, ValidationError

from feddg.settings import Settings

#: Flower's SuperNode authentication accepts EC keys on NIST curves; P-384 is what its docs suggest
NODE_CURVE = ec.SECP384R1
#: what :func:`make_certificates` writes
CERTIFICATE_FILES = ("ca.pem", "ca.key", "server.pem", "server.key")


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    """A new file (never over an existing one); a private key is mode 600 from its creation, never readable by others."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644), "wb") as f:
        f.write(data)
    return path


def _refuse_existing(paths: list[Path], what: str) -> None:
    """Keys and certificates already deployed are never replaced: one line naming them, before anything is written."""
    if found := [p.name for p in paths if p.exists() or p.is_symlink()]:
        raise FileExistsError(f"{paths[0].parent} already holds {', '.join(found)}: writing {what} there would replace "
                              "what the deployment trusts; choose a new folder (or remove them first)")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    """An IP address SAN for an IP, a DNS name SAN otherwise."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certificates(out_dir: Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """Write ``ca.pem``/``ca.key`` (a self-signed CA) and ``server.pem``/``server.key`` (signed by it, valid for
    ``hosts``) under ``out_dir``; returns the paths by file stem and kind (``ca``, ``ca-key``, ``server``, ``server-key``)."""
    if not hosts or not all(h.strip() for h in hosts):
        raise ValueError("name at least one --host (an IP address or DNS name the SuperLink is reached at)")
    _refuse_existing([out_dir / n for n in CERTIFICATE_FILES], "a new CA")
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("feddg test CA")).issuer_name(_name("feddg test CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return {
        "ca": _write(out_dir / "ca.pem", ca.public_bytes(pem)),
        "ca-key": _write(out_dir / "ca.key", ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()), True),
        "server": _write(out_dir / "server.pem", server.public_bytes(pem)),
        "server-key": _write(out_dir / "server.key", key.private_bytes(pem, pkcs8, serialization.NoEncryption()), True),
    }


def make_node_keys(out_dir: Path, names: list[str]) -> list[tuple[Path, Path]]:
    """Write ``NAME`` (OpenSSH private key, unencrypted: Flower reads it unattended) and ``NAME.pub`` for each name."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"name each node once with --node (got {names})")
    if bad := [n for n in names if Path(n).name != n or n in (".", "..") or n.startswith(".")]:
        raise ValueError(f"a node's name is its key's file name: no folders or leading dots (got {bad})")
    _refuse_existing([out_dir / f for n in names for f in (n, f"{n}.pub")], "new node keys")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        key = ec.generate_private_key(NODE_CURVE())
        private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption())
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        out.append((_write(out_dir / name, private, True), _write(out_dir / f"{name}.pub", public + b"\n")))
    return out


def load_public_key(text: str) -> ec.EllipticCurvePublicKey:
    """An OpenSSH EC public key (``ecdsa-sha2-nistp384 AAAA...``)."""
    try:
        key = serialization.load_ssh_public_key(text.strip().encode())
    except (ValueError, TypeError) as err:
        raise ValueError(f"not an OpenSSH public key: {text.strip()[:40]!r}") from err
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"not an EC public key: {text.strip()[:40]!r}")
    return key


def load_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The node's OpenSSH EC private key, the file its SuperNode gets as ``--auth-supernode-private-key``."""
    try:
        key = serialization.load_ssh_private_key(Path(path).read_bytes(), None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:  # TypeError: encrypted (no passphrase given)
        raise ValueError(f"{path}: not an unencrypted OpenSSH private key") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path}: not an EC private key")
    return key


def public_key_text(key: ec.EllipticCurvePublicKey) -> str:
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """OpenSSH's fingerprint (``ssh-keygen -lf KEY.pub``): ``SHA256:`` + unpadded base64 of the key blob's sha256."""
    blob = base64.b64decode(public_key_text(key).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def identity_statement(challenge: str, node_id: int, federation: str) -> bytes:
    """What a node signs: the server's one-time ``challenge``, the Flower node id the reply comes from, and the
    fingerprint of the federation it built (so a signature answers one challenge, from one node, only)."""
    return f"feddg identify v1|{challenge}|{node_id}|{federation}".encode()


def sign(key: ec.EllipticCurvePrivateKey, statement: bytes) -> str:
    return key.sign(statement, ec.ECDSA(hashes.SHA256())).hex()


def verify(key: ec.EllipticCurvePublicKey, statement: bytes, signature: str) -> bool:
    try:
        key.verify(bytes.fromhex(signature), statement, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


class RosterEntry(Settings):
    """One client's identity: ``public_key`` is a ``.pub`` file (relative to the roster) or its ``SHA256:`` fingerprint."""

    client: int = Field(ge=0)
    name: str = Field(min_length=1)
    public_key: str = Field(min_length=1)


class Roster:
    """The clients of a secure deployment by key fingerprint (``flower.roster``, a YAML list of entries)."""

    def __init__(self, entries: list[RosterEntry], fingerprints: list[str]) -> None:
        self.entries = entries
        self.by_fingerprint = dict(zip(fingerprints, entries, strict=True))
        self._fingerprints = {e.client: fp for fp, e in self.by_fingerprint.items()}

    def fingerprint_of(self, entry: RosterEntry) -> str:
        """The ``SHA256:`` fingerprint of ``entry``'s key."""
        return self._fingerprints[entry.client]

    @classmethod
    def load(cls, path: Path, num_clients: int) -> Roster:
        """Read and check ``path``: clients 0..num_clients-1 each once, distinct names and keys."""
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
            entries = [RosterEntry.model_validate(e) for e in raw] if isinstance(raw, list) else None
        except ValidationError as err:
            raise ValueError(f"roster {path}: {err.errors()[0]['loc']} {err.errors()[0]['msg']}") from None
        if entries is None:
            raise ValueError(f"roster {path}: want a YAML list of {{client, name, public_key}} entries")
        clients = sorted(e.client for e in entries)
        if clients != list(range(num_clients)):
            raise ValueError(f"roster {path}: lists clients {clients}; want 0..{num_clients - 1}, each once")
        fps = [e.public_key if e.public_key.startswith("SHA256:")
               else key_fingerprint(load_public_key((path.parent / e.public_key).read_text())) for e in entries]
        for what, values in (("name", [e.name for e in entries]), ("public key", fps)):
            if len(set(values)) != len(values):
                raise ValueError(f"roster {path}: two clients share a {what}")
        return cls(entries, fps)
