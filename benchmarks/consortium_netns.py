"""Rehearse a consortium on one machine: a SuperLink and one SuperNode per client, each in its own network namespace.

Called by ``benchmarks/consortium_netns.sh`` (which also deletes the namespaces if this process is killed). Root only.

- Network: namespaces ``<prefix>-sl``, ``<prefix>-n<k>`` and a hub ``<prefix>-hub`` holding a bridge; one veth pair
  per member to the bridge; addresses 10.77.0.0/24 exist inside these namespaces only (SuperLink 10.77.0.1, node k
  10.77.0.(10+k)). Nothing is added to the host's namespace.
- Security (docs/flower.md, "Secure deployment"): TLS certificates for 10.77.0.1 (``make_certificates``, what
  ``feddg flower certs`` writes), node keys registered with ``flwr supernode register`` (``--enable-supernode-auth``)
  and a roster; no node declares a ``partition-id``.
- Control plane (docs/flower.md, "The control plane"): the SuperLink listens on 127.0.0.1:9093 of its namespace
  only; ``fleet_proxy.py`` on 10.77.0.1:9093 forwards ``/v1/fleet/`` alone. ``flwr`` runs in the SuperLink's
  namespace; from a node's namespace a Control API request gets 403 and ``flwr ls`` fails.
- Runs: ``feddg flower run`` twice on the same deployment, with the links unshaped and then shaped to 50 ms RTT and
  100 Mbit/s (``tc qdisc add dev <veth> root netem delay 25ms rate 100mbit`` on every member's link; where the kernel
  has no sch_netem: ``tbf rate 100mbit`` on the links and the 25 ms per direction in the proxy). Seconds per round:
  ``time_round_s`` of metrics.jsonl.

Prints one line per step and a JSON summary (``--json``); exits 0 with ``skipped: <reason>`` where namespaces cannot
be made. Every wait has a timeout; the namespaces and every process in them go on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUBNET = "10.77.0"
LINK_HOST = f"{SUBNET}.1"
PORT = 9093  # the SuperLink (127.0.0.1, its namespace) and the proxy (10.77.0.1)
NODE_PORT = 9094  # each SuperNode's Runtime API (127.0.0.1, its namespace)
CONNECTION = "feddg-netns"
DELAY_MS, RATE = 25, "100mbit"


def log(text: str) -> None:
    print(text, flush=True)


def why_no_namespaces(prefix: str) -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    if os.geteuid() != 0:
        return "not root (ip netns needs CAP_SYS_ADMIN)"
    probe = subprocess.run(["ip", "netns", "add", f"{prefix}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{prefix}-probe"], capture_output=True)
    if shutil.which("tc") is None:
        return "no `tc` on PATH"
    return None


def sh(*args: str, ns: str | None = None, timeout: float = 30, check: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc


class Consortium:
    """The namespaces, links and processes of one rehearsal (``prefix`` names them all)."""

    def __init__(self, prefix: str, clients: int, workdir: Path) -> None:
        self.prefix, self.clients, self.workdir = prefix, clients, workdir
        self.hub, self.sl = f"{prefix}-hub", f"{prefix}-sl"
        self.nodes = [f"{prefix}-n{k}" for k in range(clients)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.proxy: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    "FLWR_HOME": str(workdir / "flwr-home")}
        self.shaping = "none"

    def link_of(self, ns: str) -> str:
        """The member end of ``ns``'s veth pair (the hub end is this + "h"); at most 15 characters."""
        return self.prefix + ("s" if ns == self.sl else "n" + ns.rsplit("-n", 1)[1])

    def make_network(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
        sh("ip", "link", "set", "br0", "up", ns=self.hub)
        for i, ns in enumerate([self.sl, *self.nodes]):
            member = self.link_of(ns)
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", member, "type", "veth", "peer", "name", member + "h")
            sh("ip", "link", "set", member, "netns", ns)
            sh("ip", "link", "set", member + "h", "netns", self.hub)
            sh("ip", "link", "set", member + "h", "master", "br0", "up", ns=self.hub)
            sh("ip", "addr", "add", f"{SUBNET}.{1 if i == 0 else 9 + i}/24", "dev", member, ns=ns)
            sh("ip", "link", "set", member, "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)

    def shape(self) -> str:
        """50 ms RTT and 100 Mbit/s on every link: netem, or tbf + the proxy's delay where netem is missing."""
        members = [self.sl, *self.nodes]
        netem = [sh("tc", "qdisc", "add", "dev", self.link_of(ns), "root", "netem", "delay", f"{DELAY_MS}ms",
                    "rate", RATE, ns=ns, check=False) for ns in members]
        if all(p.returncode == 0 for p in netem):
            self.shaping = f"netem delay {DELAY_MS}ms rate {RATE}"
            return self.shaping
        for ns, p in zip(members, netem, strict=True):
            if p.returncode == 0:
                sh("tc", "qdisc", "del", "dev", self.link_of(ns), "root", ns=ns)
            sh("tc", "qdisc", "add", "dev", self.link_of(ns), "root", "tbf", "rate", RATE, "burst", "64kb",
               "latency", "400ms", ns=ns)
        self.signal_proxy(signal.SIGUSR1)
        reason = next(p.stderr.strip() for p in netem if p.returncode != 0)
        self.shaping = f"tbf rate {RATE} + proxy delay {DELAY_MS}ms per direction (netem: {reason})"
        return self.shaping

    def unshape(self) -> None:
        for ns in [self.sl, *self.nodes]:
            sh("tc", "qdisc", "del", "dev", self.link_of(ns), "root", ns=ns, check=False)
        self.signal_proxy(signal.SIGUSR2)
        self.shaping = "none"

    def signal_proxy(self, sig: signal.Signals) -> None:
        assert self.proxy is not None
        self.proxy.send_signal(sig)

    def spawn(self, ns: str, name: str, *argv: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``ns`` (``ip netns exec`` execs it: the pid is the program's)."""
        with open(self.workdir / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=self.workdir, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_listening(self, ns: str, host: str, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while f"{host}:{port}" not in sh("ss", "-ltnH", ns=ns).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} in {ns} after {timeout:.0f} s")
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process ended early; see the logs in {self.workdir}")
            time.sleep(0.3)

    def listeners(self, ns: str) -> list[str]:
        return sorted(line.split()[3] for line in sh("ss", "-ltnH", ns=ns).stdout.splitlines())

    def start(self, tls: dict[str, Path], keys: list[Path], timeout: float) -> None:
        serve_tls = ["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["server"]),
                     "--ssl-keyfile", str(tls["server-key"])]
        home = Path(self.env["FLWR_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{PORT}"\nroot-certificates = "{tls["ca"]}"\n')
        self.spawn(self.sl, "superlink", str(BIN / "flower-superlink"), *serve_tls, "--enable-supernode-auth",
                   "--host", "127.0.0.1", "--port", str(PORT), "--disable-runtime-dependency-installation")
        self.proxy = self.spawn(self.sl, "fleet-proxy", sys.executable, str(REPO / "benchmarks" / "fleet_proxy.py"),
                                "--listen", f"{LINK_HOST}:{PORT}", "--upstream", f"127.0.0.1:{PORT}",
                                "--cert", str(tls["server"]), "--key", str(tls["server-key"]), "--ca", str(tls["ca"]),
                                "--delay-ms", str(DELAY_MS))
        self.wait_listening(self.sl, "127.0.0.1", PORT, timeout)
        self.wait_listening(self.sl, LINK_HOST, PORT, timeout)
        for key in keys:
            sh(str(BIN / "flwr"), "supernode", "register", f"{key}.pub", CONNECTION, ns=self.sl, env=self.env,
               timeout=timeout)
        for ns, key in zip(self.nodes, keys, strict=True):
            node = self.spawn(ns, f"supernode-{ns}", str(BIN / "flower-supernode"), "--root-certificates",
                              str(tls["ca"]), "--auth-supernode-private-key", str(key), "--superlink",
                              f"{LINK_HOST}:{PORT}", "--isolation", "process", "--host", "127.0.0.1", "--port",
                              str(NODE_PORT), *serve_tls, "--node-config", f"auth-key='{key}'")
            self.wait_listening(ns, "127.0.0.1", NODE_PORT, timeout)
            self.spawn(ns, f"executor-{ns}", sys.executable, "-m", "feddg.engines.flower.executor",
                       "--runtime-api-address", f"127.0.0.1:{NODE_PORT}", "--parent-pid", str(node.pid),
                       "--root-certificates", str(tls["ca"]))

    def probe(self, ns: str, ca: Path, timeout: float) -> dict[str, Any]:
        """Run :func:`probe_superlink` in ``ns`` (a node's network seen from inside)."""
        out = sh(sys.executable, __file__, "probe", str(ca), ns=ns, timeout=timeout).stdout
        return dict(json.loads(out.splitlines()[-1]))

    def flwr_ls(self, ns: str, address: str, ca: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """``flwr ls`` from ``ns`` against ``address`` (its own FLWR_HOME)."""
        home = self.workdir / f"flwr-home-{ns}"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(f'[superlink]\ndefault = "c"\n\n[superlink.c]\naddress = "{address}"\n'
                                          f'root-certificates = "{ca}"\n')
        return sh(str(BIN / "flwr"), "ls", "c", ns=ns, env={**self.env, "FLWR_HOME": str(home)}, check=False,
                  timeout=timeout)

    def run(self, config: Path, run_dir: Path, timeout: float) -> dict[str, Any]:
        """``feddg flower run`` in the SuperLink's namespace; its wall time and the run's seconds per round."""
        t0 = time.monotonic()
        proc = sh(str(BIN / "feddg"), "flower", "run", str(config), "--run-dir", str(run_dir), "--connection",
                  CONNECTION, "--app-dir", str(REPO / "flower"), ns=self.sl, env=self.env, check=False,
                  timeout=timeout)
        wall = time.monotonic() - t0
        (self.workdir / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"feddg flower run exited {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}")
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rounds = [r["time_round_s"] for r in rows]
        return {"run_dir": str(run_dir), "wall_s": round(wall, 2), "clients": [r["clients"] for r in rows],
                "identified_by_roster": "identified by the roster" in proc.stdout + proc.stderr,
                "bytes_per_round": statistics.median(r["bytes_down"] + r["bytes_up"] for r in rows),
                "round_s": [round(s, 2) for s in rounds], "median_round_s": round(statistics.median(rounds), 2)}

    def close(self) -> None:
        """Stop every process in the namespaces (SuperExecs, ServerApp, ClientApps too), then delete them."""
        namespaces = [self.sl, *self.nodes, self.hub]
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            pids = {int(p) for ns in namespaces for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()}
            pids |= {p.pid for p in self.procs if p.poll() is None}
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        for ns in namespaces:
            sh("ip", "netns", "del", ns, check=False)


def probe_superlink(ca: str, samples: int = 5) -> dict[str, Any]:
    """From a node's namespace: the round trip of a Fleet API request to the SuperLink (median ms over one
    kept-alive TLS connection), the status of a Control API request, and the TCP connect time."""
    tls = ssl.create_default_context(cafile=ca)
    t0 = time.perf_counter()
    conn = http.client.HTTPSConnection(LINK_HOST, PORT, context=tls, timeout=10)
    conn.connect()
    connect_ms = (time.perf_counter() - t0) * 1000
    rtts, fleet_status = [], 0
    for _ in range(samples):
        t0 = time.perf_counter()
        conn.request("GET", "/v1/fleet/feddg-rtt-probe")
        response = conn.getresponse()
        response.read()
        rtts.append((time.perf_counter() - t0) * 1000)
        fleet_status = response.status
    control = http.client.HTTPSConnection(LINK_HOST, PORT, context=tls, timeout=10)
    control.request("POST", "/v1/control/list-runs", body=b"", headers={"Content-Type": "application/protobuf"})
    return {"fleet_rtt_ms": round(statistics.median(rtts), 1), "fleet_status": fleet_status,
            "control_status": control.getresponse().status, "tcp_tls_connect_ms": round(connect_ms, 1)}


def experiment(clients: int, rounds: int, cache_dir: Path, roster: Path) -> dict[str, Any]:
    """The deployment test's small run (tiny Digits-DG, cnn, iid clients), its clients named by the roster."""
    return {"name": "netns", "seed": 1, "device": "cpu",
            "data": {"dataset": "digits-dg", "max_per_domain": 40, "cache_dir": str(cache_dir)},
            "split": {"target": "synth"}, "partition": {"kind": "iid", "num_clients": clients},
            "model": {"name": "cnn"}, "federation": {"rounds": rounds, "batch_size": 32},
            "flower": {"roster": str(roster), "node_wait_s": 120, "round_timeout_s": 300}}


def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    from feddg.engines.flower.security import make_certificates, make_node_keys

    workdir = args.out.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    for throwaway in ["pki", "keys", *(p.name for p in workdir.glob("run-*"))]:  # its own test PKI and runs, made
        shutil.rmtree(workdir / throwaway, ignore_errors=True)                   # anew (feddg never writes over them)
    tls = make_certificates(workdir / "pki", [LINK_HOST, "127.0.0.1"])
    names = [f"node{k}" for k in range(args.clients)]
    keys = [private for private, _ in make_node_keys(workdir / "keys", names)]
    roster = workdir / "keys" / "roster.yaml"
    roster.write_text(yaml.safe_dump([{"client": k, "name": f"Hospital {k}", "public_key": f"{n}.pub"}
                                      for k, n in enumerate(names)]))
    config = workdir / "experiment.yaml"
    config.write_text(yaml.safe_dump(experiment(args.clients, args.rounds, args.cache_dir.resolve(), roster)))
    net = Consortium(args.prefix, args.clients, workdir)
    report: dict[str, Any] = {"clients": args.clients, "rounds": args.rounds, "load": os.getloadavg()[0]}
    try:
        net.make_network()
        t0 = time.monotonic()
        net.start(tls, keys, args.timeout)
        report["start_s"] = round(time.monotonic() - t0, 1)
        log(f"deployment up in {report['start_s']} s: SuperLink in {net.sl}, nodes in {', '.join(net.nodes)}")
        report["superlink_listeners"] = net.listeners(net.sl)
        control = net.probe(net.nodes[0], tls["ca"], args.timeout)
        node_ls = net.flwr_ls(net.nodes[0], f"{LINK_HOST}:{PORT}", tls["ca"], args.timeout)
        report["flwr_ls_from_node_rc"] = node_ls.returncode
        report["flwr_ls_from_node"] = [line.strip(" \u2502") for line in (node_ls.stdout + node_ls.stderr).splitlines()
                                       if any(c.isalpha() for c in line)][-2:]
        log(f"control plane from {net.nodes[0]}: HTTP {control['control_status']}, "
            f"`flwr ls` exit {node_ls.returncode}; SuperLink namespace listens on {report['superlink_listeners']}")
        report["runs"] = []
        for rep in range(args.repeats):  # A B A B ...: unshaped, then shaped, on the same deployment
            for shaped in (False, True):
                if shaped:
                    report["shaping"] = net.shape()
                elif rep:
                    net.unshape()
                setting = "50ms" if shaped else "0ms"
                probe = net.probe(net.nodes[0], tls["ca"], args.timeout)
                report.setdefault(f"probe_{setting}", probe)
                run = net.run(config, workdir / f"run-{setting}-{rep}", args.timeout)
                report["runs"].append({"setting": setting, "fleet_rtt_ms": probe["fleet_rtt_ms"], **run})
                log(f"{setting} ({net.shaping}): Fleet API round trip {probe['fleet_rtt_ms']} ms, "
                    f"{run['median_round_s']} s per round {run['round_s']}")
        for setting in ("0ms", "50ms"):
            rounds = [s for run in report["runs"] if run["setting"] == setting for s in run["round_s"]]
            report[f"median_round_{setting}_s"] = round(statistics.median(rounds), 2)
        report["flwr_ls_on_superlink_rc"] = net.flwr_ls(net.sl, f"127.0.0.1:{PORT}", tls["ca"], args.timeout).returncode
    finally:
        net.close()
    report["load_end"] = os.getloadavg()[0]
    return report


def main() -> None:
    if sys.argv[1:2] == ["probe"]:  # run inside a node's namespace by Consortium.probe
        print(json.dumps(probe_superlink(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=f"fdg{os.getpid() % 100000}", help="names of namespaces and links")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="unshaped + shaped runs, alternating")
    parser.add_argument("--out", type=Path, default=Path("runs/consortium-netns"), help="work and run directories")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "test-data", help="dataset cache")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each wait and each run")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    if len(args.prefix) > 9 or not args.prefix.isalnum():
        parser.error("--prefix: at most 9 letters and digits (link names are prefix + 'n<k>h', 15 at most)")
    if not 1 <= args.clients <= 200 or args.rounds < 1 or args.repeats < 1:
        parser.error("want 1..200 --clients, at least 1 --rounds and --repeats")
    if (why := why_no_namespaces(args.prefix)) is not None:
        print(f"skipped: {why}")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in rehearse's finally
    report = rehearse(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
