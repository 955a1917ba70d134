"""Weights from the worker's own disk: FILE_QUERY, READ_FILE, SET_FROM_CACHE, cached uploads.

Runs in the backend thread, as routes of the executor's dispatch table (:meth:`Loading.routes`);
it owns the worker's :class:`~.model_files.ModelFiles` (``--model-dir``) and
:class:`~.tensor_cache.TensorCache` (``--cache-dir``). See :mod:`zmq_rpc.broker.files` for the
commands. A read or a cache fill runs in order in the session's queue, after any zero-copy send
of its destination buffer has finished (the executor's ``writes`` table), like SET_TENSOR.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..broker import files as f
from ..broker import protocol as p
from ..broker.protocol import Cmd, ErrorCode, WireError
from .model_files import PLAIN_DTYPES, FileIdentity, FileRefused, ModelFiles, quoted, read_into
from .requests import Route
from .tensor_cache import TensorCache

if TYPE_CHECKING:
    from .requests import Handler, Outcome, Request
    from .session import Reply, Session, Views

log = logging.getLogger("zmq_rpc.worker.loading")


class Loading:
    """The file and cache commands of one worker (either part may be absent: then they refuse
    or miss, saying why)."""

    def __init__(self, backend: Any, views: Views, files: ModelFiles | None = None,
                 cache: TensorCache | None = None) -> None:
        self.backend = backend
        self.views = views
        self.files = files
        self.cache = cache

    def routes(self, set_tensor: Route) -> dict[Cmd, Route]:
        """This module's part of the executor's dispatch table (SET_TENSOR wrapped to cache)."""
        return {
            Cmd.FILE_QUERY: Route(self.file_query),
            Cmd.READ_FILE: Route(self.read_file, writes=lambda s, m: [r.dst.buffer
                                                                      for r in m.reads]),
            Cmd.SET_FROM_CACHE: Route(self.set_from_cache, writes=lambda s, m: [m.tensor.buffer]),
            Cmd.SET_TENSOR: dataclasses.replace(set_tensor,
                                                handler=self._caching(set_tensor.handler)),
        }

    def capabilities(self) -> list[str]:
        """What HELLO lists for what this worker serves."""
        return ["model-files"] * (self.files is not None) + \
            ["tensor-cache"] * (self.cache is not None)

    # ------------------------------------------------------------------------ files

    def file_query(self, session: Session, msg: f.FileQuery, req: Request) -> Reply:
        try:
            if self.files is None:
                raise FileRefused("this worker serves no model files (start it with "
                                  "--model-dir)")
            ident = self.files.identify(msg.path)
        except (FileRefused, OSError) as exc:
            return f.FileQueryReply(found=False, reason=_why(exc), size=0, format="",
                                    digest=b""), []
        return f.FileQueryReply(found=True, reason="", size=ident.size, format=ident.format,
                                digest=ident.digest), []

    def read_file(self, session: Session, msg: f.ReadFile, req: Request) -> Reply:
        files = self._files()
        try:
            ident = files.check(msg.path, msg.digest)
            spans = [self._span(ident, read) for read in msg.reads]
            views = [self.views.view(session, read.dst) for read in msg.reads]
            fd, st = files.open(msg.path)
        except (FileRefused, OSError) as exc:
            raise WireError(ErrorCode.FILE_REFUSED, _why(exc)) from None
        try:
            if (st.st_size, st.st_mtime_ns) != (ident.size, ident.mtime_ns):
                raise WireError(ErrorCode.FILE_REFUSED, f"{quoted(msg.path)} changed while it was read")
            for offset, view in zip(spans, views):
                self._read(fd, offset, view)
        except (FileRefused, OSError) as exc:
            raise WireError(ErrorCode.FILE_REFUSED, _why(exc)) from None
        finally:
            os.close(fd)
        return p.Empty(), []

    def _files(self) -> ModelFiles:
        if self.files is None:
            raise WireError(ErrorCode.FILE_REFUSED,
                            "this worker serves no model files (start it with --model-dir)")
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


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"cannot read the file: {exc.strerror or exc}"
    return str(exc)
