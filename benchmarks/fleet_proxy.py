"""A TLS reverse proxy that forwards only Flower's Fleet API (``/v1/fleet/...``) to a SuperLink bound to loopback.

The control-plane mitigation of docs/flower.md ("The control plane"): Flower 1.41 serves its Fleet, Control and
Runtime APIs on one HTTP listener, so the SuperLink listens on 127.0.0.1 only and this proxy, on the nodes' network,
answers every other path with 403 and closes the connection. It speaks HTTP/1.1 with Content-Length bodies (what
Flower's httpx clients send); a chunked request body is refused (501).

``--delay-ms D``: after SIGUSR1, every chunk waits D ms in each direction (SIGUSR2: no delay again), a userspace
stand-in for ``tc netem delay`` where the kernel has no sch_netem. TLS handshakes (once per kept-alive connection)
and TCP's own segments are not delayed; bandwidth is left to the kernel (``tc ... tbf``).

Standard library only: ``python benchmarks/fleet_proxy.py --listen 10.77.0.1:9093 --upstream 127.0.0.1:9093
--cert server.pem --key server.key --ca ca.pem``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import ssl
import time

#: the only requests forwarded: Fleet API routes (no dot segments, no escapes, no query)
FLEET_PATH = re.compile(rb"/v1/fleet/[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*")
MAX_HEAD = 64 * 1024
CHUNK = 64 * 1024
#: (due time, bytes); b"" ends the stream
Queue = asyncio.Queue[tuple[float, bytes]]


class Link:
    """The delay every chunk currently gets, per direction (seconds)."""

    def __init__(self, delay_s: float) -> None:
        self.configured_s, self.delay_s = delay_s, 0.0


def refusal(status: str) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()


def verdict(head: bytes) -> tuple[str | None, int]:
    """``(refusal status or None, body length)`` of one request head (request line and headers)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not FLEET_PATH.fullmatch(parts[1]):
        return "403 Forbidden", 0
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(b":") for line in lines[1:] if line))
    if b"transfer-encoding" in headers:
        return "501 Not Implemented", 0
    try:
        return None, int(headers.get(b"content-length", b"0"))
    except ValueError:
        return "400 Bad Request", 0


async def feed(reader: asyncio.StreamReader, queue: Queue, link: Link) -> None:
    """Read ``reader`` into ``queue``, each chunk due ``link.delay_s`` after it arrived."""
    try:
        while chunk := await reader.read(CHUNK):
            await queue.put((time.monotonic() + link.delay_s, chunk))
    except (OSError, ssl.SSLError):
        pass
    await queue.put((time.monotonic() + link.delay_s, b""))


async def due(queue: Queue) -> bytes:
    when, chunk = await queue.get()
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    return chunk


async def forward_requests(inbound: Queue, upstream: asyncio.StreamWriter, outbound: Queue, link: Link) -> None:
    """Pass Fleet API requests on to ``upstream``; at the first other request, queue a refusal and stop."""
    buf, body_left = b"", 0
    while chunk := await due(inbound):
        buf += chunk
        while buf:
            if body_left:
                part, buf = buf[:body_left], buf[body_left:]
                upstream.write(part)
                body_left -= len(part)
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0 and len(buf) <= MAX_HEAD:
                break
            head, buf = (buf[: end + 4], buf[end + 4 :]) if end >= 0 else (b"", b"")
            status, body_left = verdict(head) if head else ("431 Request Header Fields Too Large", 0)
            if status is None:
                upstream.write(head)
                continue
            await outbound.put((time.monotonic() + link.delay_s, refusal(status)))
            await outbound.put((time.monotonic() + link.delay_s, b""))
            upstream.close()
            return
        await upstream.drain()
    upstream.close()


async def send_responses(outbound: Queue, client: asyncio.StreamWriter) -> None:
    while chunk := await due(outbound):
        client.write(chunk)
        await client.drain()
    client.close()


async def serve(listen: tuple[str, int], upstream: tuple[str, int], server_tls: ssl.SSLContext,
                upstream_tls: ssl.SSLContext, link: Link) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream, ssl=upstream_tls,
                                                                 server_hostname=upstream[0])
        except (OSError, ssl.SSLError):
            writer.close()
            return
        inbound: Queue = asyncio.Queue()
        outbound: Queue = asyncio.Queue()
        tasks = [feed(reader, inbound, link), feed(up_reader, outbound, link),
                 forward_requests(inbound, up_writer, outbound, link), send_responses(outbound, writer)]
        try:
            await asyncio.gather(*tasks)
        except (OSError, ssl.SSLError):
            pass
        finally:
            writer.close()
            up_writer.close()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(link, "delay_s", link.configured_s))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(link, "delay_s", 0.0))
    server = await asyncio.start_server(handle, *listen, ssl=server_tls)
    print(f"fleet proxy on {listen[0]}:{listen[1]} -> {upstream[0]}:{upstream[1]} (/v1/fleet/ only)", flush=True)
    async with server:
        await server.serve_forever()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=address, required=True, help="HOST:PORT on the nodes' network")
    parser.add_argument("--upstream", type=address, required=True, help="the SuperLink's loopback HOST:PORT")
    parser.add_argument("--cert", required=True, help="the SuperLink's certificate (PEM), served to the nodes")
    parser.add_argument("--key", required=True, help="its private key")
    parser.add_argument("--ca", required=True, help="the CA that signed the SuperLink's certificate")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="delay per direction after SIGUSR1")
    args = parser.parse_args()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(args.cert, args.key)
    upstream_tls = ssl.create_default_context(cafile=args.ca)
    asyncio.run(serve(args.listen, args.upstream, server_tls, upstream_tls, Link(args.delay_ms / 1000)))


if __name__ == "__main__":
    main()
