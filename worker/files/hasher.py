"""Model files hashed off the backend thread: one hashing thread, its jobs and their completions.

:class:`FileHasher` is created, used and closed by the backend thread; the thread it starts
(``zmq-rpc-hasher``) only reads the files it is handed, each as an open descriptor it closes
when done, and owns nothing else. Hashing a model file reads all of it (a 2 GiB file: seconds),
which on the backend thread held every client's requests that long. Here the backend thread
hands the open file over (:meth:`FileHasher.submit`), goes on serving, and learns of the result
as a completion (:meth:`FileHasher.collect`, called when :attr:`FileHasher.wake_fd` is readable
in its poll); the waiter it registered then runs on the backend thread, which alone touches the
cache (:meth:`~.model_files.ModelFiles.remember`) and the sessions.

Jobs for the same version of a file (:class:`~.model_files.FileKey`) share one hash. One thread
hashes one file at a time, in order: a second file waits for the first (BLAKE3 and ``preadv``
release the GIL, so the backend thread keeps its core; a pool would only take the other core
from the broker). It runs at the worker's priority: a nicer thread, preempted on a loaded machine
while it holds the GIL between two blocks, would hold the backend thread up (docs/SECURITY.md).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

from ..formats.hashing import HashCancelled
from .model_files import FileIdentity, FileKey, FileRefused, OpenFile, identify_open

log = logging.getLogger("zmq_rpc.worker.files")

HashOutcome = FileIdentity | str
"""A hash job's result: the file's identity, or why it could not be had."""
Waiter = Callable[[HashOutcome], None]


class FileHasher:
    """The hashing thread and the jobs handed to it (backend thread only, but the thread)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[OpenFile | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[FileKey, HashOutcome]] = queue.SimpleQueue()
        self._waiters: dict[FileKey, list[Waiter]] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="zmq-rpc-hasher", daemon=False)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        """Readable when a completion waits: poll it beside the sockets, then :meth:`collect`."""
        return self._wake_r

    def submit(self, file: OpenFile, waiter: Waiter) -> None:
        """Hash ``file`` (its descriptor is ours now) and call ``waiter`` with the outcome from
        :meth:`collect`; a file already being hashed is not hashed twice."""
        waiting = self._waiters.get(file.key)
        if waiting is not None:
            os.close(file.fd)
            waiting.append(waiter)
            return
        self._waiters[file.key] = [waiter]
        self._jobs.put(file)

    def collect(self) -> None:
        """Deliver every finished hash to its waiters (on the calling, backend, thread)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                key, outcome = self._done.get_nowait()
            except queue.Empty:
                return
            for waiter in self._waiters.pop(key, []):
                waiter(outcome)

    def close(self) -> None:
        """Stop the thread (a hash under way stops at its next block) and join it. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._jobs.put(None)
        self._thread.join()
        while True:                       # jobs never started: their descriptors are ours
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                os.close(job.fd)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ the hashing thread

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._stop.is_set():
                os.close(job.fd)
                continue
            outcome = self._hash(job)
            self._done.put((job.key, outcome))
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:        # the pipe is full: the backend has wake-ups enough
                pass

    def _hash(self, job: OpenFile) -> HashOutcome:
        try:
            return identify_open(job, self._stop.is_set)
        except FileRefused as exc:
            return str(exc)
        except OSError as exc:
            return f"cannot read the file: {exc.strerror or exc}"
        except HashCancelled:
            return "the worker is shutting down"
        except Exception as exc:  # a bug must not leave a query waiting forever
            log.exception("hashing %s failed", job.name)
            return f"hashing the file failed: {type(exc).__name__}: {exc}"
        finally:
            os.close(job.fd)

