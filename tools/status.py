"""``zmq-rpc-worker status tcp://a:50052[,tcp://b:50052]``: ask running workers what they are doing.

Runs on the main thread of its own process (plus one client I/O thread per worker). It opens a
:class:`~zmq_rpc.client.Client` per worker, sends STATUS over the protocol itself (1.5), and prints
one table: a row per worker (version, protocol, uptime, sessions, queued requests, memory, graphs,
transfers in progress, device, capabilities), then a row per session when ``--sessions`` is given.
``--json`` prints the same as one JSON document for scripts; ``--watch [SECONDS]`` refreshes until
Ctrl-C. An unreachable or older worker gets a row saying why, never a hang: each worker is asked
within ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from ..broker import protocol as p
from ..broker.errors import RpcError
from ..broker.keys import KeyFileError
from ..client import Client

CLEAR = "\x1b[H\x1b[2J"


@dataclass
class Row:
    """One worker's answer (``status``) or why there is none (``error``)."""

    endpoint: str
    status: p.StatusReply | None = None
    protocol: str = ""
    error: str = ""


class Poller:
    """Clients of the workers, opened on first use and reopened after a failure."""

    def __init__(self, endpoints: Sequence[str], timeout: float,
                 curve_key: str | None = None) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.curve_key = curve_key
        """The key pair (a .key_secret file) for CURVE workers; None: $ZMQ_RPC_CURVE_SECRET_KEY."""
        self.clients: dict[str, Client] = {}

    def _client(self, endpoint: str) -> Client:
        client = self.clients.get(endpoint)
        if client is None:
            client = Client(endpoint, timeout=self.timeout, connect_timeout=self.timeout,
                            name="zmq-rpc-status", curve_key=self.curve_key)
            self.clients[endpoint] = client
        return client

    def poll(self) -> list[Row]:
        """Every worker's status, asked of all at once."""
        asked: list[tuple[str, Client | None, Future[p.StatusReply] | str]] = []
        for endpoint in self.endpoints:
            try:
                client = self._client(endpoint)
                asked.append((endpoint, client, client.status_async()))
            except RpcError as exc:
                asked.append((endpoint, None, f"{type(exc).__name__}: {exc}"))
            except KeyFileError as exc:     # a CURVE worker, and no usable key pair here
                asked.append((endpoint, None, f"no key: {exc} (--curve-key FILE)"))
        return [self._row(*item) for item in asked]

    def _row(self, endpoint: str, client: Client | None,
             answer: Future[p.StatusReply] | str) -> Row:
        if isinstance(answer, str) or client is None:
            return Row(endpoint, error=str(answer))
        try:
            status = answer.result()
        except RpcError as exc:
            self._drop(endpoint)
            return Row(endpoint, error=f"{type(exc).__name__}: {exc}")
        return Row(endpoint, status, f"{client.info.major}.{client.info.minor}")

    def _drop(self, endpoint: str) -> None:
        client = self.clients.pop(endpoint, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for endpoint in list(self.clients):
            self._drop(endpoint)


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_seconds(seconds: float) -> str:
    """3725 -> '1h02m'."""
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


WORKER_COLUMNS = ("WORKER", "NAME", "VERSION", "PROTO", "UPTIME", "SESSIONS", "QUEUED",
                  "MEMORY USED / LIMIT", "BUFFERS", "GRAPHS", "XFERS", "DEVICE", "CAPABILITIES")


def worker_cells(row: Row) -> list[str]:
    s = row.status
    if s is None:
        return [row.endpoint, f"unreachable: {row.error}"] + [""] * (len(WORKER_COLUMNS) - 2)
    share = 100 * s.memory_used / s.memory_limit if s.memory_limit else 0.0
    device = ", ".join(f"{d.name} ({d.kind})" for d in s.devices)
    return [row.endpoint, s.server, s.version, row.protocol, human_seconds(s.uptime_ms / 1000),
            str(s.sessions), str(s.queue_depth),
            f"{human_bytes(s.memory_used)} / {human_bytes(s.memory_limit)} ({share:.0f}%)",
            str(s.buffers), str(s.graphs), str(s.transfers_in_progress), device,
            ",".join(s.capabilities)]


SESSION_COLUMNS = ("WORKER", "SESSION", "CLIENT", "CLIENT ID", "MEMORY", "BUFFERS", "GRAPHS",
                   "QUEUED", "IDLE")


def session_cells(row: Row) -> list[list[str]]:
    if row.status is None:
        return []
    return [[row.endpoint, f"s{i.sid}", i.client, i.client_id, human_bytes(i.memory),
             str(i.buffers), str(i.graphs), str(i.queued), human_seconds(i.idle_ms / 1000)]
            for i in row.status.session_list]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


def render(rows: Sequence[Row], sessions: bool) -> str:
    text = format_table(WORKER_COLUMNS, [worker_cells(r) for r in rows])
    if sessions:
        listed = [cells for r in rows for cells in session_cells(r)]
        text += "\n\n" + (format_table(SESSION_COLUMNS, listed) if listed else "no sessions")
    return text


def as_json(rows: Sequence[Row]) -> str:
    doc = [{"endpoint": r.endpoint, "protocol": r.protocol, "error": r.error or None,
            "status": asdict(r.status) if r.status is not None else None} for r in rows]
    return json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "workers": doc}, indent=1)


def build_parser(prog: str = "zmq-rpc-worker status") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("endpoints", help="comma-separated worker endpoints (tcp://host:port,...)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    ap.add_argument("--sessions", action="store_true", help="also list each worker's sessions")
    ap.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) until Ctrl-C")
    ap.add_argument("--timeout", type=float, default=5.0,
                    help="seconds to wait for each worker (default %(default)s)")
    ap.add_argument("--curve-key", metavar="FILE", default=None,
                    help="this client's CURVE key pair (a .key_secret file) for workers whose "
                         "endpoint carries #curve=KEY (default: $ZMQ_RPC_CURVE_SECRET_KEY)")
    return ap


def main(argv: Sequence[str] | None = None, prog: str = "zmq-rpc-worker status") -> int:
    """Entry point; exit code 1 if some worker did not answer (in the last refresh)."""
    args = build_parser(prog).parse_args(argv)
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    poller = Poller(endpoints, args.timeout, args.curve_key)
    stop: list[bool] = []
    if args.watch is not None:
        signal.signal(signal.SIGINT, lambda *_: stop.append(True))
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while True:
            rows = poller.poll()
            _show(rows, args, clear=args.watch is not None and sys.stdout.isatty())
            if args.watch is None or _sleep(args.watch, stop):
                return 1 if any(r.status is None for r in rows) else 0
    finally:
        poller.close()


def _show(rows: Sequence[Row], args: Any, clear: bool) -> None:
    text = as_json(rows) if args.json else render(rows, args.sessions)
    print((CLEAR if clear else "") + text, flush=True)
    if args.watch is not None and not args.json:
        print(f"\n{time.strftime('%H:%M:%S')}, every {args.watch:g} s; Ctrl-C stops", flush=True)


def _sleep(seconds: float, stop: list[bool]) -> bool:
    """Sleep, waking early when asked to stop; True when stopping."""
    deadline = time.monotonic() + seconds
    while not stop and time.monotonic() < deadline:
        time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
    return bool(stop)


if __name__ == "__main__":
    sys.exit(main())
