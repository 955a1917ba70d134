"""Where a client's CurveZMQ settings come from: arguments, the endpoint, environment variables.

Pure functions, called by :class:`~zmq_rpc.client.client.Client` in the caller's thread before
the connection opens. Precedence for the worker's public key: a key in the endpoint
(``tcp://h:p#curve=KEY``, what workers advertise), then ``server_key=``, then
``$ZMQ_RPC_SERVER_KEY``; for the client's key pair: ``curve_key=``, then
``$ZMQ_RPC_CURVE_SECRET_KEY`` (a ``.key_secret`` file). With a server key and no key pair the
client is refused before connecting (and the reverse is ignored: a key pair alone changes
nothing, so one environment serves both secured and loopback workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..broker.keys import (
    KeyFileError,
    KeyPair,
    load_keypair,
    load_public_key,
    parse_key,
    split_endpoint,
)

__all__ = ["CurveClient", "SERVER_KEY_ENV", "SECRET_KEY_ENV", "resolve_curve"]

SERVER_KEY_ENV = "ZMQ_RPC_SERVER_KEY"
SECRET_KEY_ENV = "ZMQ_RPC_CURVE_SECRET_KEY"


@dataclass(frozen=True)
class CurveClient:
    """What a client's socket needs to speak CURVE to one worker."""

    keys: KeyPair
    server_key: bytes


def _server_key(value: str | bytes) -> bytes:
    """A key given as text, or as the path of a ``.key`` file."""
    text = value.decode() if isinstance(value, bytes) else value
    if Path(text).is_file():
        return load_public_key(text)
    return parse_key(text)


def resolve_curve(endpoint: str, curve_key: str | os.PathLike[str] | KeyPair | None = None,
                  server_key: str | bytes | None = None,
                  environ: dict[str, str] | None = None) -> tuple[str, CurveClient | None]:
    """The address to connect to and the CURVE settings (None: plain ZMTP)."""
    env = os.environ if environ is None else environ
    address, in_endpoint = split_endpoint(endpoint)
    server = in_endpoint
    if server is None and server_key is not None:
        server = _server_key(server_key)
    if server is None and env.get(SERVER_KEY_ENV):
        server = _server_key(env[SERVER_KEY_ENV])
    if server is None:
        return address, None
    if isinstance(curve_key, KeyPair):
        keys = curve_key
    elif curve_key is not None or env.get(SECRET_KEY_ENV):
        keys = load_keypair(curve_key if curve_key is not None else env[SECRET_KEY_ENV])
    else:
        raise KeyFileError(f"the worker at {address} needs CURVE: pass curve_key= (a .key_secret "
                           f"file from zmq-rpc-keygen) or set ${SECRET_KEY_ENV}")
    return address, CurveClient(keys, server)
