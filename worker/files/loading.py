"""Weights from the worker's own disk: FILE_QUERY, READ_FILE, SET_FROM_CACHE, cached uploads.

Runs in the backend thread, as routes of the executor's dispatch table (:meth:`Loading.routes`);
it owns the worker's :class:`~.model_files.ModelFiles` (``--model-dir``) and
:class:`~.tensor_cache.TensorCache` (``--cache-dir``). See :mod:`zmq_rpc.broker.files` for the
commands. A read or a cache fill runs in order in the session's queue, after any zero-copy send
of its destination buffer has finished (the executor's ``writes`` table), like SET_TENSOR.

A file not hashed yet in its current version is hashed by :mod:`~.hasher`'s thread, never
here: its FILE_QUERY or READ_FILE waits at the head of its session's queue (other sessions go on)
and runs again when the hash is in; the reply leaves then.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...broker import files as f
from ...broker import protocol as p
from ...broker.protocol import Cmd, ErrorCode, WireError
from ..sessions.session import Later, Request, Route
from .hasher import FileHasher, HashOutcome
from .model_files import (
    PLAIN_DTYPES,
    FileIdentity,
    FileRefused,
    ModelFiles,
    check_digest,
    quoted,
    read_into,
)
from .tensor_cache import TensorCache

if TYPE_CHECKING:
    from ..sessions.session import Handler, Outcome, Reply, Session
    from ..sessions.views import Views

log = logging.getLogger("zmq_rpc.worker.files.loading")


@dataclass(eq=False)
class FileRequest(Request):
    """A FILE_QUERY or READ_FILE: waits at the head of its session's queue (``in_flight``)
    while its file is hashed off this thread; ``hashed`` is what the hash came to."""

    hashed: HashOutcome | None = None


class Loading:
    """The file and cache commands of one worker (either part may be absent: then they refuse
    or miss, saying why)."""

    def __init__(self, backend: Any, views: Views, resume: Callable[[Session], None]) -> None:
        self.backend = backend
        self.views = views
        self.resume = resume
        """Runs a session's queue again once the hash its head waited for is in."""
        self.files: ModelFiles | None = None
        self.cache: TensorCache | None = None
        self.hasher: FileHasher | None = None

    def serve(self, files: ModelFiles | None, cache: TensorCache | None) -> None:
        """Serve ``files`` (starting the hashing thread) and ``cache``."""
        self.files, self.cache = files, cache
        if files is not None and self.hasher is None:
            self.hasher = FileHasher()

    def close(self) -> None:
        """Stop the hashing thread (backend thread, at its end)."""
        if self.hasher is not None:
            self.hasher.close()

    def routes(self, set_tensor: Route) -> dict[Cmd, Route]:
        """This module's part of the executor's dispatch table (SET_TENSOR wrapped to cache)."""
        return {
            Cmd.FILE_QUERY: Route(self.file_query, entry=FileRequest),
            Cmd.READ_FILE: Route(self.read_file, writes=lambda s, m: [r.dst.buffer
                                                                      for r in m.reads],
                                 entry=FileRequest),
            Cmd.SET_FROM_CACHE: Route(self.set_from_cache, writes=lambda s, m: [m.tensor.buffer]),
            Cmd.SET_TENSOR: dataclasses.replace(set_tensor,
                                                handler=self._caching(set_tensor.handler)),
        }

    def capabilities(self) -> list[str]:
        """What HELLO lists for what this worker serves."""
        return ["model-files"] * (self.files is not None) + \
            ["tensor-cache"] * (self.cache is not None)

    # ------------------------------------------------------------------------ files

    def file_query(self, session: Session, msg: f.FileQuery, req: Request) -> Outcome:
        try:
            ident = self._identity(session, msg.path, req)
        except (FileRefused, OSError) as exc:
            return f.FileQueryReply(found=False, reason=_why(exc), size=0, format="",
                                    digest=b""), []
        if ident is None:
            return Later.HOLD
        return f.FileQueryReply(found=True, reason="", size=ident.size, format=ident.format,
                                digest=ident.digest), []

    def read_file(self, session: Session, msg: f.ReadFile, req: Request) -> Outcome:
        try:
            ident = self._identity(session, msg.path, req)
            if ident is None:
                return Later.HOLD
            check_digest(ident, msg.digest)
            spans = [self._span(ident, read) for read in msg.reads]
            views = [self.views.view(session, read.dst) for read in msg.reads]
            fd, st = self._files().open(msg.path)
        except (FileRefused, OSError) as exc:
            raise WireError(ErrorCode.FILE_REFUSED, _why(exc)) from None
        try:
            key = ident.key
            if (st.st_ino, st.st_size, st.st_mtime_ns) != (key.inode, key.size, key.mtime_ns):
                raise WireError(ErrorCode.FILE_REFUSED, f"{quoted(msg.path)} changed while it was read")
            for offset, view in zip(spans, views):
                self._read(fd, offset, view)
        except (FileRefused, OSError) as exc:
            raise WireError(ErrorCode.FILE_REFUSED, _why(exc)) from None
        finally:
            os.close(fd)
        return p.Empty(), []

    def _identity(self, session: Session, path: str, req: Request) -> FileIdentity | None:
        """``path``'s identity: from the cache, from the hash this request waited for, or None
        when the hash has just been handed to the hashing thread (the request then waits)."""
        assert isinstance(req, FileRequest)
        if req.hashed is not None:
            hashed, req.hashed = req.hashed, None
            if isinstance(hashed, str):
                raise FileRefused(hashed)
            return hashed
        found = self._files(FileRefused).identify(path)
        if isinstance(found, FileIdentity):
            return found
        assert self.hasher is not None
        req.in_flight = True
        self.hasher.submit(found, lambda outcome: self._hashed(session, req, outcome))
        return None

    def _hashed(self, session: Session, req: FileRequest, outcome: HashOutcome) -> None:
        """The hash ``req`` waited for is in (backend thread, from the hasher's completions)."""
        if isinstance(outcome, FileIdentity) and self.files is not None:
            self.files.remember(outcome)
        req.hashed, req.in_flight = outcome, False
        self.resume(session)

    def _files(self, error: Callable[[str], Exception] | None = None) -> ModelFiles:
        if self.files is None:
            why = "this worker serves no model files (start it with --model-dir)"
            raise (error or _refused)(why)
        return self.files

    @staticmethod
    def _span(ident: FileIdentity, read: f.FileRead) -> int:
        """The file offset of ``read``, after checking it against the file's own header."""
        if not read.name:
            if not (read.offset <= ident.size and read.nbytes <= ident.size - read.offset):
                raise FileRefused(f"bytes [{read.offset}, +{read.nbytes}) lie past the end of "
                                  f"the {ident.size}-byte file")
            return read.offset
        info = ident.tensors.get(read.name)
        if info is None:
            raise FileRefused(f"the file has no tensor named {read.name[:80]!r}")
        if info.nbytes < 0:
            raise FileRefused(f"tensor {read.name[:80]!r} has an unknown type ({info.kind})")
        if (read.kind, read.shape, read.nbytes) != (info.kind, info.shape, info.nbytes):
            raise FileRefused(
                f"tensor {read.name[:80]!r} is {info.kind} {list(info.shape)} ({info.nbytes} "
                f"bytes) in the file, not {read.kind[:16]} {list(read.shape)} ({read.nbytes})")
        want = PLAIN_DTYPES.get(info.kind)
        have = read.dst.dtype.dtype_name
        if (want is not None and have != want) or (want is None and have not in ("uint8",
                                                                                 "int8")):
            raise FileRefused(f"tensor {read.name[:80]!r} ({info.kind}) cannot land in a "
                              f"{have} view (wanted {want or 'uint8 blocks'})")
        return info.offset

    def _read(self, fd: int, offset: int, view: Any) -> None:
        backend = self.backend
        target = backend.alias(view)
        if target is not None:
            read_into(fd, offset, memoryview(target).cast("B"))
            return
        staging = np.empty(view.nbytes, np.uint8)
        read_into(fd, offset, staging.data)
        backend.write(view, staging)

    # ------------------------------------------------------------------------ cache

    def set_from_cache(self, session: Session, msg: f.SetFromCache, req: Request) -> Reply:
        if not msg.tensor.is_contiguous():
            raise WireError(ErrorCode.BAD_REQUEST, "SET_FROM_CACHE needs a contiguous view")
        view = self.views.view(session, msg.tensor)
        if self.cache is None:
            return f.CacheReply(hit=False, note="this worker has no cache (--cache-dir)"), []
        found = self.cache.get(msg.key, msg.tensor.nbytes)
        if found.data is not None:
            self.backend.write(view, found.data)
        return f.CacheReply(hit=found.data is not None, note=found.note), []

    def _caching(self, set_tensor: Handler) -> Handler:
        """SET_TENSOR that also files its payload under ``cache_key`` (when it hashes to it)."""
        def handle(session: Session, msg: p.SetTensor, req: Request) -> Outcome:
            reply = set_tensor(session, msg, req)
            if msg.cache_key and self.cache is not None:
                data = getattr(req.payload[0], "buffer", req.payload[0])
                outcome = self.cache.put(msg.cache_key, data)
                if outcome.startswith("not stored"):
                    log.warning("upload for cache key %s %s", msg.cache_key.hex()[:16], outcome)
            return reply
        return handle


def _refused(why: str) -> WireError:
    return WireError(ErrorCode.FILE_REFUSED, why)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"cannot read the file: {exc.strerror or exc}"
    return str(exc)
