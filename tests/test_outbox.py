"""Replies leave the worker only if they decode (worker/dispatch/outbox.py), and the reply that did not."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zmq_rpc.broker import files as f
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.errors import RemoteError
from zmq_rpc.broker.protocol import ErrorCode
from zmq_rpc.broker.wire import MAX_STRING
from zmq_rpc.client import Client
from zmq_rpc.client.files import query_file
from zmq_rpc.worker.dispatch.outbox import Outbox
from zmq_rpc.worker.files import loading
from zmq_rpc.worker.server import WorkerServer
from zmq_rpc.worker.sessions.quotas import InFlight

pytestmark = pytest.mark.timeout(30)


def test_a_query_of_a_4096_character_path_is_answered_not_found(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        tmp_path: Path) -> None:
    """Issue 24.10: the refusal quoted the whole path: a 4,140-character ``reason``, over the
    protocol's MAX_STRING, so the client raised BadRequest instead of reading "not found"."""
    c = make_client(make_worker(model_dirs=(str(tmp_path),)).endpoint)
    reply = query_file(c, "a" * (MAX_STRING - 6) + ".gguf").result(10)
    assert not reply.found and "not in this worker's model directories" in reply.reason
    assert len(reply.reason) <= 400
    c.ping()


def test_a_reply_that_would_not_decode_becomes_an_internal_error(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """Whatever reply a handler makes, the client gets one it can decode: a reply over the
    protocol's limits is logged and answered with INTERNAL, and the worker goes on."""
    monkeypatch.setattr(loading, "_why", lambda exc: "x" * (MAX_STRING + 1))
    c = make_client(make_worker(model_dirs=(str(tmp_path),)).endpoint)
    with caplog.at_level(logging.ERROR, logger="zmq_rpc.worker"):
        with pytest.raises(RemoteError) as caught:
            query_file(c, "missing.gguf").result(10)
    assert caught.value.code == ErrorCode.INTERNAL and "breaks the protocol" in str(caught.value)
    assert any("breaks the protocol" in r.getMessage() for r in caplog.records)
    c.ping()


def test_the_outbox_checks_the_payload_count() -> None:
    sent: list[list[Any]] = []
    outbox = Outbox(lambda frames, **_: sent.append(frames), InFlight())
    outbox.reply(b"c", 7, (f.FileQueryReply(found=False, reason="r", size=0, format="",
                                            digest=b""), [b"stray"]))
    header = p.unpack_header(sent[0][1])
    assert header[:2] == [int(ErrorCode.INTERNAL), 7] and "payload" in header[2]
    outbox.reply(b"c", 8, (p.Ack(), []))
    assert p.unpack_header(sent[1][1]) == [0, 8]
