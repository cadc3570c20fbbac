"""A real Flower deployment on this machine, every listener on 127.0.0.1 (Linux).

One ``flower-superlink`` and one ``flower-supernode`` per client (with feddg's warm executor beside
each, or Flower's default isolation), as separate processes, and the feddg Flower App submitted with
``flwr run --stream``: exactly the shell recipes of docs/flower.md, driven from Python for the
deployment test and ``benchmarks/bench_engines.py``.
``stop()`` terminates them gracefully and reports any process of theirs still alive. With ``tls`` (the
certificates of ``feddg flower certs``) every connection is TLS; with ``node_keys`` too, the SuperLink
authenticates SuperNodes (``--enable-supernode-auth``, every key registered with ``flwr supernode register``)
and each node proves its key to the ServerApp (``auth-key`` in its node config: docs/flower.md, "Secure deployment").
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from feddg.config import ExperimentConfig
from feddg.engines.flower.app import run_config_toml

LOOPBACK = "127.0.0.1"
#: the Flower App directory of a source checkout (components live in the installed package)
APP_DIR = Path(__file__).resolve().parents[2] / "flower"
CONNECTION = "feddg-local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {LOOPBACK}:{port} after {timeout} s") from None
            time.sleep(0.2)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, ..., starttime at [19])."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def process_tree(roots: list[int]) -> set[tuple[int, str]]:
    """``(pid, start time)`` of ``roots`` and all their live descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(int(st[1]), []).append(int(entry.name))
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if (st := _stat(pid)) is not None and st[0] != "Z":
            out.add((pid, st[19]))
            todo += children.get(pid, [])
    return out


def alive(procs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Those of ``procs`` still running (same pid *and* start time, not a zombie)."""
    return {(pid, start) for pid, start in procs if (st := _stat(pid)) is not None and st[0] != "Z" and st[19] == start}


class LocalDeployment:
    """SuperLink + ``num_nodes`` SuperNodes (partition ids 0..num_nodes-1) under ``workdir``.

    ``isolation="process"``: each SuperNode's ClientApps run in feddg's warm executor
    (``python -m feddg.engines.flower.executor``, one per node); ``"subprocess"``: Flower's default, a
    new ``flwr-clientapp`` process per message.
    """

    def __init__(self, workdir: Path, num_nodes: int, env: dict[str, str] | None = None,
                 isolation: str = "process", tls: dict[str, Path] | None = None,
                 node_keys: list[Path] | None = None, node_configs: list[str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.num_nodes = num_nodes
        self.isolation = isolation
        self.tls, self.node_keys = tls, node_keys
        self.node_configs = node_configs or [
            f'auth-key="{node_keys[p]}"' if node_keys else f"partition-id={p} num-partitions={num_nodes}"
            for p in range(num_nodes)]
        self.bin = Path(sys.executable).parent
        self.port = free_port()
        self.node_ports = [free_port() for _ in range(num_nodes)]
        home = self.workdir / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{LOOPBACK}:{self.port}"\n'
            + (f'root-certificates = "{tls["ca"]}"\n' if tls else "insecure = true\n")
        )
        self.env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
                    **(env or {})}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.seen: set[tuple[int, str]] = set()

    def _spawn(self, name: str, *args: str) -> None:
        self.logs.append(open(self.workdir / f"{name}.log", "wb"))
        self.procs.append(
            subprocess.Popen([str(self.bin / args[0]), *args[1:]], cwd=self.workdir, env=self.env,
                             stdout=self.logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
        )

    def start(self, timeout: float = 120.0) -> LocalDeployment:
        """Start the SuperLink (and register the node keys), then the SuperNodes; return once all of them listen."""
        try:
            self._start(timeout)
        except BaseException:  # no process outlives a failed start
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        tls = self.tls
        serve_tls = ["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["server"]),
                     "--ssl-keyfile", str(tls["server-key"])] if tls else []
        self._spawn("superlink", "flower-superlink", *(serve_tls or ["--insecure"]),
                    *(["--enable-supernode-auth"] if self.node_keys else []), "--host", LOOPBACK,
                    "--port", str(self.port), "--disable-runtime-dependency-installation")
        wait_for_port(self.port, timeout)
        for key in self.node_keys or []:
            subprocess.run([str(self.bin / "flwr"), "supernode", "register", f"{key}.pub", CONNECTION], cwd=self.workdir,
                           env=self.env, check=True, capture_output=True, timeout=120)
        nodes = []
        for p, port in enumerate(self.node_ports):
            auth = ["--auth-supernode-private-key", str(self.node_keys[p])] if self.node_keys else []
            self._spawn(f"supernode-{p}", "flower-supernode", *(["--root-certificates", str(tls["ca"])] if tls
                        else ["--insecure"]), *auth, "--superlink", f"{LOOPBACK}:{self.port}",
                        "--host", LOOPBACK, "--port", str(port), *serve_tls, "--isolation", self.isolation,
                        "--node-config", self.node_configs[p])
            nodes.append(self.procs[-1].pid)
        for p, (port, pid) in enumerate(zip(self.node_ports, nodes, strict=True)):
            wait_for_port(port, timeout)
            if self.isolation == "process":
                self._spawn(f"executor-{p}", "python", "-m", "feddg.engines.flower.executor",
                            "--runtime-api-address", f"{LOOPBACK}:{port}", "--parent-pid", str(pid),
                            *(["--root-certificates", str(tls["ca"])] if tls else ["--insecure"]))

    def snapshot(self) -> set[tuple[int, str]]:
        """The deployment's live processes now (SuperExecs, ServerApp, ClientApps included); remembered for stop()."""
        tree = process_tree([p.pid for p in self.procs])
        self.seen |= tree
        return tree

    def run(self, cfg: ExperimentConfig | str, run_dir: Path, timeout: float = 600.0,
            app_dir: Path = APP_DIR) -> subprocess.CompletedProcess[str]:
        """``flwr run <app> feddg-local --run-config run.toml --stream``: blocks until the run ends. ``cfg``: the
        experiment, or the run config TOML itself (as another version of feddg writes it)."""
        toml = self.workdir / "run.toml"
        toml.write_text(cfg if isinstance(cfg, str) else run_config_toml(cfg, run_dir))
        return subprocess.run([str(self.bin / "flwr"), "run", str(app_dir), CONNECTION, "--run-config", str(toml),
                               "--stream"], cwd=self.workdir, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def stop(self, timeout: float = 60.0) -> set[tuple[int, str]]:
        """SIGTERM the executors, the SuperNodes, then the SuperLink (process groups, as Ctrl+C in their terminals would);
        wait for all their processes; return those still alive.

        Anything left after ``timeout`` is killed, so no process outlives the deployment.
        """
        self.snapshot()
        for proc in reversed(self.procs):  # executors and SuperNodes first, the SuperLink last
            if proc.poll() is None:  # each is a process-group leader: its SuperExec gets the signal too
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(self.seen) and time.monotonic() < deadline:
            for proc in self.procs:
                proc.poll()  # reap: a SuperExec watches its parent's pid, which a zombie still holds
            time.sleep(0.5)
        left = alive(self.seen)
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=10)
        for log in self.logs:
            log.close()
        return left

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
