"""Log output for workers: plain lines for people, one JSON object per line for collectors.

Configured once by the CLI's main thread before any worker thread starts; the formatters then run
on whichever thread logs. Session events carry their fields as ``extra`` (``event``, ``session``,
``client``, ``client_id``, ...): the text format shows them in the message, the JSON format as keys.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable

__all__ = ["JsonFormatter", "Throttled", "configure_logging"]

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message",
                                                                                  "asctime"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, its extras."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        out.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send zmq-rpc's logs to stderr as ``text`` lines or ``json`` objects."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


THROTTLE_S = 10.0
"""Least seconds between two lines of one :class:`Throttled` warning."""


class Throttled:
    """A warning that input from outside can cause once per message (a bad peer message, an
    acknowledgement that cannot go out): logged the first time, then at most once per
    ``interval`` seconds, saying how many were left out since, so that a flood of bad messages
    cannot flood the log (or fill a disk). Used by one thread."""

    def __init__(self, logger: logging.Logger, interval: float = THROTTLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._quiet = 0
        self.count = 0
        """Times :meth:`warning` was called, logged or not."""

    def warning(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless the last line was under ``interval`` seconds ago; whether it
        did."""
        self.count += 1
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._quiet += 1
            return False
        if self._quiet:
            msg, args = f"{msg} (and %d more since the last such line)", (*args, self._quiet)
        self._log.warning(msg, *args)
        self._last, self._quiet = now, 0
        return True
