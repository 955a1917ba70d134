"""Where submitting threads leave requests for whoever drives one connection: the inbox, the
wake-up socket pair, and the lock that orders submissions against close.

Threads: any thread posts (:meth:`Mailbox.post`, :meth:`Mailbox.close`); the connection's driver
(its I/O thread, or a blocking caller holding its socket lock) takes what was posted and drains
the wake-ups. A driver about to block says so (``parked`` for the I/O thread, ``polling`` for a
blocking caller) so that a post writes one wake-up per sleep, not one per request.
"""

from __future__ import annotations

import queue
import socket
import threading

from ..broker.errors import ClientClosed, RpcError
from .calls import Call, Inbox, Reservation, drain_inbox, fail_item


class Mailbox:
    """The inbox of one connection and its wake-up socket."""

    def __init__(self) -> None:
        self.inbox: Inbox = queue.SimpleQueue()
        self.lock = threading.Lock()
        """Orders posts against close (nothing is queued after the close marker); also guards
        a reservation's fields."""
        self.closed = False
        self.parked = False
        """Set by the I/O thread just before it blocks."""
        self.polling = False
        """Set by a blocking caller driving the connection just before it blocks."""
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)

    @property
    def wake_socket(self) -> socket.socket:
        """The end a driver polls (a plain socket: ``zmq_poll`` reports it by its fd)."""
        return self._wake_r

    def post(self, item: Call | Reservation) -> None:
        """Leave ``item`` for the driver, woken if it sleeps; failed at once once closed."""
        with self.lock:
            if not self.closed:
                self.inbox.put(item)
                if self.parked or self.polling:     # one wake-up per sleep
                    self.parked = self.polling = False
                    self.wake()
                return
        fail_item(item, ClientClosed("the client is closed"))

    def close(self) -> bool:
        """Queue the close marker (None) after everything posted; False if already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            self.inbox.put(None)
        self.wake()
        return True

    def shut(self) -> None:
        """No more posts (the I/O thread is ending)."""
        with self.lock:
            self.closed = True

    def empty(self) -> bool:
        return self.inbox.empty()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass      # full: a wake-up is already pending; closed: nobody to wake

    def drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def fail_posted(self, error: RpcError) -> None:
        drain_inbox(self.inbox, error)

    def close_sockets(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
