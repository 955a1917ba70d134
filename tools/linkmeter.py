"""A TCP relay that counts the bytes a client's link carries: what the wire really holds (ZMTP
framing, signatures, headers and payload), each way, between a client and one worker.

The client connects to :attr:`LinkMeter.endpoint`; every connection is relayed to the worker,
on threads of its own. Workers reach each other on their own peer ports, not through here.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LinkMeter", "metered"]


class LinkMeter:
    """Relay connections from a loopback port to ``target`` (``tcp://host:port``)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = 0
        """Bytes client -> worker."""
        self.received = 0
        """Bytes worker -> client."""
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def counts(self) -> tuple[int, int]:
        """(sent, received) so far."""
        with self._lock:
            return self.sent, self.received

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                inner, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            outer = socket.create_connection(self.target)
            for s in (inner, outer):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [inner, outer]
            for src, dst, up in ((inner, outer, True), (outer, inner, False)):
                thread = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                with self._lock:
                    if up:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stopping.set()
        self.listener.close()
        for s in self._sockets:
            s.close()
        for thread in self._threads:
            thread.join(5)


@contextmanager
def metered(target: str) -> Iterator[LinkMeter]:
    """A :class:`LinkMeter` to ``target``, closed at the end."""
    meter = LinkMeter(target)
    try:
        yield meter
    finally:
        meter.close()
