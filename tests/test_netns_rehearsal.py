"""The consortium rehearsal (benchmarks/consortium_netns.sh): SuperLink and SuperNodes in their own network
namespaces with TLS, node auth and a roster; a 50 ms RTT on the links; the Control API closed to the nodes."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from fleet_proxy import Link, due, feed, forward_requests, verdict  # noqa: E402


def test_the_proxy_forwards_fleet_requests_only():
    assert verdict(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nContent-Length: 12\r\n\r\n") == (None, 12)
    assert verdict(b"GET /v1/fleet/ping HTTP/1.1\r\nHost: x\r\n\r\n") == (None, 0)
    for path in (b"/v1/control/list-runs", b"/v1/runtime/x", b"/v1/fleet/../control/stop-run",
                 b"/v1/fleet/%2e%2e/control/stop-run", b"/v1/fleet/", b"/v1/fleet/ping?x=1", b"/v1/fleet//ping"):
        assert verdict(b"POST " + path + b" HTTP/1.1\r\n\r\n") == ("403 Forbidden", 0), path
    assert verdict(b"POST /v1/fleet/push HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")[0] == "501 Not Implemented"
    assert verdict(b"POST /v1/fleet/push HTTP/1.1\r\nContent-Length: x\r\n\r\n")[0] == "400 Bad Request"


def test_the_rehearsal_skips_with_a_reason_where_namespaces_cannot_be_made(tmp_path):
    script = REPO / "benchmarks" / "consortium_netns.sh"
    bash = shutil.which("bash") or "bash"
    proc = subprocess.run([bash, str(script), "--out", str(tmp_path)], env={**os.environ, "PATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)  # no `ip` on PATH
    assert proc.returncode == 0 and proc.stdout.strip() == "skipped: no `ip` (iproute2) on PATH", proc


@pytest.mark.slow
def test_a_namespaced_consortium_runs_with_the_roster_under_latency_and_the_control_api_closed(tmp_path):
    summary = tmp_path / "summary.json"
    proc = subprocess.run([str(REPO / "benchmarks" / "consortium_netns.sh"), "--clients", "2", "--rounds", "1",
                           "--out", str(tmp_path), "--timeout", "150", "--json", str(summary)],
                          capture_output=True, text=True, timeout=480)
    if proc.stdout.startswith("skipped: "):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(summary.read_text())
    assert [run["setting"] for run in report["runs"]] == ["0ms", "50ms"]
    for run in report["runs"]:  # both runs completed, every round with the roster's two clients
        assert run["clients"] == [2] and run["identified_by_roster"], run
    # 25 ms per direction on the way to the SuperLink: a Fleet API round trip ~50 ms longer than unshaped
    assert 40 <= report["probe_50ms"]["fleet_rtt_ms"] - report["probe_0ms"]["fleet_rtt_ms"] <= 150, report
    # from a node's namespace: a Control API request is refused, `flwr ls` fails; on the SuperLink's, it works
    assert report["probe_0ms"]["control_status"] == 403 and report["probe_0ms"]["fleet_status"] == 404
    assert report["flwr_ls_from_node_rc"] != 0 and report["flwr_ls_on_superlink_rc"] == 0
    # the SuperLink itself listens on its loopback only; the proxy is the one listener on the nodes' network
    assert report["superlink_listeners"] == ["10.77.0.1:9093", "127.0.0.1:9093"]
    prefix = proc.stdout.split("SuperLink in ", 1)[1].split("-sl", 1)[0]  # the namespaces are gone after it
    assert prefix + "-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


class Sink:
    """What forward_requests writes to: the upstream connection's bytes."""

    def __init__(self) -> None:
        self.data, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_proxy_passes_bodies_split_across_chunks_and_refuses_the_first_other_request():
    first = b"POST /v1/fleet/push HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789"
    chunks = [first[:20], first[20:55], first[55:], b"GET /v1/fleet/a HTTP/1.1\r\n\r\n",
              b"POST /v1/control/stop-run HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", b"GET /v1/fleet/b HTTP/1.1\r\n\r\n"]

    async def go() -> tuple[Sink, list[bytes]]:
        inbound, outbound, upstream = asyncio.Queue(), asyncio.Queue(), Sink()
        for chunk in [*chunks, b""]:
            inbound.put_nowait((0.0, chunk))
        await forward_requests(inbound, upstream, outbound, Link(0.0))
        return upstream, [outbound.get_nowait()[1] for _ in range(outbound.qsize())]

    upstream, replies = asyncio.run(go())
    assert upstream.data == first + b"GET /v1/fleet/a HTTP/1.1\r\n\r\n" and upstream.closed  # nothing after the refusal
    assert replies == [b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", b""]


def test_the_proxy_delays_each_chunk_by_the_link_delay_once_signalled():
    link = Link(0.05)

    async def arrival_delays() -> list[float]:
        out = []
        for _ in range(2):  # before and after SIGUSR1's effect
            reader, queue = asyncio.StreamReader(), asyncio.Queue()
            reader.feed_data(b"x")
            reader.feed_eof()
            await feed(reader, queue, link)
            t0 = time.monotonic()
            assert await due(queue) == b"x"
            out.append(time.monotonic() - t0)
            link.delay_s = link.configured_s
        return out

    unshaped, shaped = asyncio.run(arrival_delays())
    assert unshaped < 0.03 and 0.04 <= shaped < 0.5
