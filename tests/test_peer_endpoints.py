"""Which peer endpoints a worker pushes to, and as whom (worker/peer/endpoints.py): no socket."""

from __future__ import annotations

import pytest
import zmq
from zmq_rpc.broker.keys import KeyPair
from zmq_rpc.broker.protocol import ErrorCode, WireError
from zmq_rpc.broker.zap import KeySet
from zmq_rpc.worker.peer.endpoints import PeerSecurity

pytestmark = pytest.mark.timeout(10)


def pair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def test_without_keys_only_plain_numeric_endpoints_are_reachable() -> None:
    security = PeerSecurity()
    assert security.address("tcp://10.0.0.1:5") == ("tcp://10.0.0.1:5", None)
    assert security.address("tcp://[::1]:5") == ("tcp://[::1]:5", None)
    for bad, why in [("tcp://10.0.0.1:5#curve=" + pair().public.decode(), "requires CURVE"),
                     ("tcp://localhost:5", "names an IP address"),
                     ("tcp://10.0.0.1:5#curve=short", "bad peer endpoint")]:
        with pytest.raises(WireError, match=why) as err:
            security.address(bad)
        assert err.value.code == ErrorCode.TRANSFER_FAILED


def test_with_keys_only_known_worker_keys_are_reachable() -> None:
    mine, known, stranger = pair(), pair(), pair()
    security = PeerSecurity(mine, KeySet(fixed=frozenset([mine.public, known.public])))
    endpoint = "tcp://10.0.0.2:5#curve=" + known.public.decode()
    assert security.address(endpoint) == ("tcp://10.0.0.2:5", known.public)
    for bad, why in [("tcp://10.0.0.2:5", "carries no key"),
                     ("tcp://10.0.0.2:5#curve=" + stranger.public.decode(), "not among"),
                     ("tcp://host:5#curve=" + known.public.decode(), "names an IP address")]:
        with pytest.raises(WireError, match=why) as err:
            security.address(bad)
        assert err.value.code == ErrorCode.TRANSFER_FAILED
