"""Misbehaving S3 endpoints on loopback, for tests: a server that accepts connections and never
answers, and a TCP proxy in front of the real SeaweedFS server that stalls chosen requests or
drops their connection part-way through the answer. Real sockets, real server; nothing is mocked."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

METHODS = (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE")


class LoopbackServer:
    """A listener on 127.0.0.1 that hands each accepted connection to ``_serve`` and closes every
    socket it made on ``close``."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.socks.append(conn)
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        """Holds the connection open and never reads or answers a byte."""

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


class StalledEndpoint(LoopbackServer):
    """Accepts every connection and never reads or answers a byte."""


@dataclass
class Fault:
    stall: bool = False  # swallow the request, never answer it
    cut_after: int | None = None  # forward this many bytes of the answer, then drop the connection
    reset: bool = False  # drop with a TCP reset instead of a clean close
    drip: float | None = None  # send the answer's headers, then its body one byte every ``drip`` seconds


class FaultyProxy(LoopbackServer):
    """A loopback TCP proxy in front of SeaweedFS; ``rule(request_line)`` picks a Fault per request."""

    def __init__(self, upstream: str, rule: Callable[[str], Fault | None],
                 on_cut: Callable[[str], None] | None = None) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.rule = rule
        self.on_cut = on_cut
        self.requests: list[str] = []
        self.stalled: list[str] = []
        self.cuts: list[str] = []
        self.lock = threading.Lock()
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        self.socks.append(upstream)
        threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        """One thread per connection, so a cut closes sockets no other thread is blocked on."""
        fault: Fault | None = None
        line, sent, head = "", 0, b""
        try:
            while True:
                ready, _, _ = select.select([client, upstream], [], [])
                if client in ready:
                    data = client.recv(1 << 16)
                    if not data:
                        return
                    if data.split(b" ", 1)[0] in METHODS:  # a new request on this connection
                        line, sent, head = data.split(b"\r\n", 1)[0].decode("latin-1"), 0, b""
                        with self.lock:
                            self.requests.append(line)
                            fault = self.rule(line)
                            if fault and fault.stall:
                                self.stalled.append(line)
                    if not (fault and fault.stall):  # a stalled request is read and dropped, never answered
                        upstream.sendall(data)
                if upstream in ready:
                    data = upstream.recv(1 << 16)
                    if not data:
                        return
                    if fault and fault.cut_after is not None and sent + len(data) > fault.cut_after:
                        self._cut(client, data[: fault.cut_after - sent], line, fault.reset)
                        return
                    if fault and fault.drip is not None:
                        head = self._drip(client, head, data, fault.drip)
                        continue
                    client.sendall(data)
                    sent += len(data)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    @staticmethod
    def _drip(client: socket.socket, head: bytes, data: bytes, every: float) -> bytes:
        """Forward the answer's headers at once and its body byte by byte; ``head`` is the headers
        seen so far (complete once they hold a blank line), returned with ``data``'s added."""
        if b"\r\n\r\n" not in head:
            head += data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                client.sendall(data)
                return head
            body = head[end + 4 :]
            client.sendall(data[: len(data) - len(body)])
            data, head = body, head[: end + 4]
        for i in range(len(data)):
            client.sendall(data[i : i + 1])
            time.sleep(every)
        return head

    def _cut(self, client: socket.socket, last: bytes, line: str, reset: bool) -> None:
        client.sendall(last)
        with self.lock:
            self.cuts.append(line)
        if self.on_cut:  # while the client still waits for the rest
            self.on_cut(line)
        if reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))



def first(n: int, match: Callable[[str], bool], fault: Fault) -> Callable[[str], Fault | None]:
    """A rule: ``fault`` for the first ``n`` requests whose line ``match``es, nothing for the rest."""
    left = [n]

    def rule(line: str) -> Fault | None:
        if left[0] > 0 and match(line):
            left[0] -= 1
            return fault
        return None

    return rule


def ranged_get(line: str) -> bool:
    return line.startswith("GET ") and "list-type" not in line and "uploads" not in line


def via(endpoint: str, s3_url: str, **query: object) -> str:
    """``s3_url``'s bucket and prefix, reached through ``endpoint``."""
    path = s3_url.split("://", 1)[1].split("?", 1)[0]
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"s3://{path}?endpoint={endpoint}{extra}"
