"""A real Flower deployment on 127.0.0.1: flower-superlink, 3 flower-supernode processes, `flwr run`.

Two rounds of FedAvg on a tiny Digits-DG config; the run directory must equal the in-process
engine's, every listening socket of the deployment's processes must be on loopback, and no
process may survive the shutdown.
"""

import json
import os
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from support.flower_local import LocalDeployment

from feddg.config import build_config
from feddg.experiment import run_experiment
from feddg.federation.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} address (32-bit words in host byte order) -> printable IP."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening_addresses(pids: set[int]) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state owned by ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # the process ended meanwhile
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                host, port = f[1].split(":")
                out.add((_address(host), int(port, 16)))
    return out


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1")


def test_listeners_of_a_process_are_found_and_decoded():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listening_addresses({os.getpid()})
    assert _address("0100007F") == "127.0.0.1" and _address("00000000") == "0.0.0.0"
    assert _address("0100007F") == "127.0.0.1" and _address("00000000") == "0.0.0.0"
    assert _address("0000000000000000FFFF00000100007F") == "::ffff:127.0.0.1"
    assert _address("00000000000000000000000001000000") == "::1"
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and is_loopback("::ffff:127.0.0.1")


@pytest.mark.slow
def test_two_rounds_on_a_superlink_and_three_supernodes(tmp_path, cache_dir):
    cfg = build_config(
        {"name": "deploy", "seed": 5, "device": "cpu",
         "data": {"dataset": "digits-dg", "max_per_domain": 120, "cache_dir": str(cache_dir)},
         "split": {"target": "synth"}, "partition": {"kind": "by_domain", "num_clients": 3},
         "model": {"name": "cnn"}, "federation": {"rounds": 2, "batch_size": 32}, "optim": {"lr": 0.05}}
    )
    run_dir = tmp_path / "run"
    listeners: set[tuple[str, int]] = set()
    stop = threading.Event()
    dep = LocalDeployment(tmp_path / "deployment", 3, env={"OMP_NUM_THREADS": "1"})

    def watch() -> None:  # sample the listeners of every deployment process while it runs
        while not stop.is_set():
            listeners.update(listening_addresses({pid for pid, _ in dep.snapshot()}))
            stop.wait(1.0)

    with dep:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            proc = dep.run(cfg, run_dir, timeout=540)
        finally:
            stop.set()
            watcher.join()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        left = dep.stop()
    assert left == set(), f"processes outlived the deployment: {left}"
    assert ("127.0.0.1", dep.port) in listeners and {("127.0.0.1", p) for p in dep.node_ports} <= listeners
    assert all(is_loopback(ip) for ip, _ in listeners), listeners
    assert "feddg round 2" in proc.stdout  # the ServerApp's log, streamed by `flwr run --stream`

    # the same experiment in-process, with as many threads as each ClientApp process had
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(cfg, tmp_path / "inprocess", progress=False)
    finally:
        torch.set_num_threads(before)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(r) for r in (tmp_path / "inprocess" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and [r["clients"] for r in rows] == [3, 3]
    assert [r["bytes_up"] for r in rows] == [r["bytes_up"] for r in ref]
    assert [r["train_loss"] for r in rows] == pytest.approx([r["train_loss"] for r in ref], rel=1e-5)
    w, w_ref = (load_checkpoint(d)["server_state"]["weights"] for d in (run_dir, tmp_path / "inprocess"))
    assert max(float(np.abs(w[k].astype(np.float64) - w_ref[k]).max()) for k in w) <= 1e-5
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds"] == 2 and results["target"] == ["synth"] and "ood_acc" in results["final"]
    assert (run_dir / "curves.png").is_file() and (run_dir / "config.yaml").is_file()
