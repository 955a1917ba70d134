"""The early-chunk stash (worker/stash.py): transfers called off before their receive starts."""

from __future__ import annotations

import os

import pytest
import zmq
from zmq_rpc.broker import peer as wire
from zmq_rpc.worker.stash import Stash

pytestmark = pytest.mark.timeout(10)


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
    assert stash.claim(owner, tok) == (None, "the sender died")
    assert stash.claim(owner, tok) == (None, None)    # said once
    assert not stash.aborted and not stash.announced


def test_an_abort_of_a_token_nobody_here_waits_for_keeps_nothing() -> None:
    stash, owner, tok = Stash(1 << 20), object(), os.urandom(wire.TOKEN_BYTES)
    assert not stash.abort(owner, tok, "x")           # never announced
    stash.announce(owner, tok)
    assert not stash.abort(object(), tok, "x")        # another session's
    assert not stash.aborted
    stash.abort(owner, tok, "x")
    stash.forget(owner)                               # the session closed
    assert not stash.aborted and not stash.announced


def test_a_chunk_dropped_for_a_full_stash_fails_its_receive_as_it_starts() -> None:
    stash, owner = Stash(1000), object()
    full, lost = os.urandom(wire.TOKEN_BYTES), os.urandom(wire.TOKEN_BYTES)
    stash.announce(owner, full)
    stash.announce(owner, lost)
    stash.keep(*chunk(full, 900), "a")
    stash.keep(*chunk(lost, 200), "a")                # does not fit: that transfer is lost
    stashed, why = stash.claim(owner, lost)
    assert stashed is None and why is not None and "stash was full" in why
    stashed, why = stash.claim(owner, full)
    assert why is None and stashed is not None and stashed.nbytes == 900
