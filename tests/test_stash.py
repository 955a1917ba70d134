"""The early-chunk stash (worker/peer/stash.py): transfers called off before their receive starts."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq
from conftest import WorkerProcess
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.protocol import Cmd
from zmq_rpc.client import Client
from zmq_rpc.worker.peer.stash import MAX_LOST_EARLY, Aborted, Stash
from zmq_rpc.worker.sessions.memory import MemoryBudget

pytestmark = pytest.mark.timeout(60)


def chunk(tok: bytes, nbytes: int, seq: int = 0, nchunks: int = 1) -> tuple[wire.Chunk, zmq.Frame]:
    return wire.Chunk(tok, seq, nchunks, seq * nbytes, nbytes * nchunks, ""), zmq.Frame(bytes(nbytes))


def test_an_abort_is_remembered_until_its_receive_starts() -> None:
    stash, owner, tok = Stash(1 << 20), object(), os.urandom(wire.TOKEN_BYTES)
    stash.announce(owner, tok)
    stash.keep(*chunk(tok, 100), "a")
    assert stash.abort(owner, tok, "the sender died")
    assert len(stash) == 0 and stash.nbytes == 0      # its early chunks are dropped
    stash.keep(*chunk(tok, 100, 1, 2), "a")           # and later ones are not kept
    assert len(stash) == 0
    assert stash.claim(owner, tok) == (None, Aborted("the sender died"))
    assert stash.claim(owner, tok) == (None, None)    # said once
    assert not stash.aborted and not stash.announced


def test_an_abort_of_another_sessions_token_keeps_nothing() -> None:
    stash, owner, tok = Stash(1 << 20), object(), os.urandom(wire.TOKEN_BYTES)
    stash.announce(owner, tok)
    assert not stash.abort(object(), tok, "x")        # another session's
    assert not stash.aborted and not stash.called_off
    stash.abort(owner, tok, "x")
    stash.forget(owner)                               # the session closed
    assert not stash.aborted and not stash.announced


def test_a_call_off_before_the_receive_is_queued_fails_it_when_announced() -> None:
    """The client called off a hand-off (its sender's run failed) before it issued the run that
    receives it: that run's receive fails as it is announced, for that session only."""
    stash, owner, other = Stash(1 << 20), object(), object()
    tok, tok2 = os.urandom(wire.TOKEN_BYTES), os.urandom(wire.TOKEN_BYTES)
    assert not stash.abort(owner, tok, "the run that sends it failed")
    assert not stash.abort(owner, tok2, "x")
    stash.announce(other, tok2)                       # another session's receive of that token
    assert tok2 not in stash.aborted
    stash.announce(owner, tok)
    assert stash.claim(owner, tok) == (None, Aborted("the run that sends it failed", ""))
    stash.abort(owner, os.urandom(wire.TOKEN_BYTES), "x")
    stash.forget(owner)                               # the session closed: its call-offs go
    assert not stash.called_off


def test_call_offs_before_their_receives_are_remembered_up_to_a_bound() -> None:
    stash, owner = Stash(1 << 20), object()
    tokens = [os.urandom(wire.TOKEN_BYTES) for _ in range(MAX_LOST_EARLY + 5)]
    for token in tokens:
        stash.abort(owner, token, "x")
    assert len(stash.called_off) == MAX_LOST_EARLY
    assert tokens[0] not in stash.called_off and tokens[-1] in stash.called_off


def test_a_chunk_with_no_room_in_mem_fails_its_receive_as_it_starts() -> None:
    stash, owner, budget = Stash(1000), object(), MemoryBudget(1000)
    stash.use_budget(budget)
    full, lost = os.urandom(wire.TOKEN_BYTES), os.urandom(wire.TOKEN_BYTES)
    stash.announce(owner, full)
    stash.announce(owner, lost)
    stash.keep(*chunk(full, 900), "a")
    assert budget.used == 900                          # counted against --mem
    lost_chunk = wire.Chunk(lost, 0, 1, 0, 200, "tcp://127.0.0.1:9")
    stash.keep(lost_chunk, zmq.Frame(bytes(200)), "a")  # does not fit: that transfer is lost
    stashed, why = stash.claim(owner, lost)
    assert stashed is None and why is not None and "--mem" in why.why
    assert why.reply_to == "tcp://127.0.0.1:9"        # its sender is told at once
    stashed, why = stash.claim(owner, full)
    assert why is None and stashed is not None and stashed.nbytes == 900
    assert budget.used == 0


def test_a_transfer_that_lost_an_early_chunk_fails_its_receive_when_announced() -> None:
    """A hand-off that reaches a worker before its run is queued, when --mem has no room to
    keep it: the chunk is dropped, and the receive announced later fails at once, saying why,
    instead of waiting 48 s for the transfer deadline (CI loop run 1 of 3aa0586: a prefill of a
    split model on workers whose stages filled --mem). Later chunks of it are not kept."""
    stash, owner, budget = Stash(1 << 20), object(), MemoryBudget(1000)
    stash.use_budget(budget)
    budget.reserve(1000, "a session's buffers")
    tok = os.urandom(wire.TOKEN_BYTES)
    stash.keep(wire.Chunk(tok, 0, 2, 0, 400, "tcp://127.0.0.1:9"), zmq.Frame(bytes(200)), "a")
    assert len(stash) == 0 and stash.dropped == 1
    budget.release(1000)
    stash.keep(*chunk(tok, 200, 1, 2), "a")          # room now, but the transfer is lost
    assert len(stash) == 0 and budget.used == 0
    stash.announce(owner, tok)
    stashed, why = stash.claim(owner, tok)
    assert stashed is None and why is not None
    assert "before the receive was queued" in why.why and "--mem had no room" in why.why
    assert why.reply_to == "tcp://127.0.0.1:9"
    assert not stash.lost_early and not stash.aborted


def test_lost_early_transfers_are_remembered_up_to_a_bound() -> None:
    stash, budget = Stash(1 << 20), MemoryBudget(0)
    stash.use_budget(budget)
    tokens = [os.urandom(wire.TOKEN_BYTES) for _ in range(MAX_LOST_EARLY + 5)]
    for tok in tokens:
        stash.keep(*chunk(tok, 10), "a")
    assert len(stash.lost_early) == MAX_LOST_EARLY
    assert tokens[0] not in stash.lost_early and tokens[-1] in stash.lost_early


def test_each_sender_has_its_own_byte_share() -> None:
    """Issue 24.2: one sender's flood fills the unannounced bytes; another sender's chunk
    evicts the flood's oldest, never the other way round."""
    stash = Stash(64 << 10)
    flood = [os.urandom(wire.TOKEN_BYTES) for _ in range(80)]
    for tok in flood:
        stash.keep(*chunk(tok, 1 << 10), "127.0.0.2")
    assert stash.unannounced_bytes == 64 << 10      # its oldest made room for its newest
    real = os.urandom(wire.TOKEN_BYTES)
    stash.keep(*chunk(real, 4 << 10), "127.0.0.1")
    assert stash.sender_bytes == {"127.0.0.2": 60 << 10, "127.0.0.1": 4 << 10}
    stash.keep(*chunk(os.urandom(wire.TOKEN_BYTES), 1 << 10), "127.0.0.2")
    assert stash.sender_bytes["127.0.0.1"] == 4 << 10   # the flood displaces only itself
    stashed, why = stash.claim(object(), real)
    assert why is None and stashed is not None and stashed.nbytes == 4 << 10


def test_announced_chunks_evict_unannounced_ones_for_room_in_mem() -> None:
    stash, owner, budget = Stash(1 << 20), object(), MemoryBudget(64 << 10)
    stash.use_budget(budget)
    for _ in range(64):
        stash.keep(*chunk(os.urandom(wire.TOKEN_BYTES), 1 << 10), "127.0.0.2")
    assert budget.free() == 0
    tok = os.urandom(wire.TOKEN_BYTES)
    stash.announce(owner, tok)
    stash.keep(*chunk(tok, 8 << 10), "127.0.0.1")
    stashed, why = stash.claim(owner, tok)
    assert why is None and stashed is not None and stashed.nbytes == 8 << 10
    assert stash.shed() and budget.used == 0 and len(stash) == 0


# ------------------------------------------- a flood from another address, real workers (issue 24)

FLOOD_CHUNKS = 80
"""Made-up 1 MiB transfers pushed to B's peer port: more than the whole stash's bytes (a
quarter of ``--mem 256MiB``, 64 MiB) when every sender shared them."""


def _flood(ctx: zmq.Context[zmq.Socket[bytes]], peer_endpoint: str) -> None:
    """80 x 1 MiB chunks of made-up transfers from 127.0.0.2 (libzmq's ``source;address``
    connect form), then a probe on the same connection: its answer says B read them all."""
    host_port = peer_endpoint.removeprefix("tcp://")
    push, acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        push.setsockopt(zmq.LINGER, 0)
        acks.setsockopt(zmq.LINGER, 0)
        acks.bind("tcp://127.0.0.2:*")
        push.connect(f"tcp://127.0.0.2:0;{host_port}")
        for _ in range(FLOOD_CHUNKS):
            push.send_multipart([wire.encode_peer(wire.Chunk(
                os.urandom(wire.TOKEN_BYTES), 0, 1, 0, 1 << 20, "")), bytes(1 << 20)])
        push.send(wire.encode_peer(wire.Probe(os.urandom(wire.TOKEN_BYTES),
                                              acks.getsockopt_string(zmq.LAST_ENDPOINT))))
        assert acks.poll(30_000), "B never read the flood"
    finally:
        push.close(linger=0)
        acks.close(linger=0)


def test_a_flood_from_another_address_does_not_fail_a_copy_into_a_busy_session(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """Issue 24.2: 80 x 1 MiB of made-up chunks from 127.0.0.2 filled the stash's one byte
    budget, shared by every sender, for 30 s; a real copy A -> B whose receive waited in B's
    session (behind an earlier receive) then had its chunk dropped and failed with
    TransferError at the transfer deadline (~48 s with default settings; 0.16-0.19 s without
    the flood). Each sender now has its own share, and a chunk of an announced transfer makes
    room by evicting unannounced ones."""
    a_proc, b_proc = spawn_worker("--mem", "256MiB"), spawn_worker("--mem", "256MiB")
    with Client(a_proc.endpoint) as a, Client(b_proc.endpoint) as b:   # default settings
        data = np.arange(1 << 20, dtype=np.uint8)
        src, head_src = (a.alloc_buffer(1 << 20).tensor((1 << 20,), "uint8") for _ in "ab")
        dst, head_dst = (b.alloc_buffer(1 << 20).tensor((1 << 20,), "uint8") for _ in "ab")
        a.set_tensor(src, data)
        a.copy_tensor(src, dst)                        # the route is probed: direct
        ctx = zmq.Context()
        try:
            _flood(ctx, b.info.peer_endpoint)
        finally:
            ctx.term()
        b.set_tensor(dst, np.zeros(1 << 20, np.uint8))
        token = os.urandom(wire.TOKEN_BYTES)           # B's session busy: a receive waits
        head = b.connection.call(Cmd.PEER_RECV, wire.PeerRecv(token=token, dst=head_dst.ref,
                                                    timeout_ms=20_000))
        start = time.monotonic()
        copy = a.copy_tensor_async(src, dst)           # its chunk reaches B while it queues
        a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=token, src=head_src.ref,
                                             endpoint=b.info.peer_endpoint, timeout_ms=20_000))
        copy.result(timeout=10)
        took = time.monotonic() - start
        head.result(timeout=10)
        np.testing.assert_array_equal(b.get_tensor(dst), data)
    assert took < 5, f"the copy took {took:.2f} s after the flood"
