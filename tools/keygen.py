"""``zmq-rpc-keygen``: write a CurveZMQ key pair for a worker or a client.

Runs in the main thread of its own process. ``zmq-rpc-keygen DIR NAME`` writes ``DIR/NAME.key``
(public, 0644: copy it to whoever must trust this key) and ``DIR/NAME.key_secret`` (0600: stays on
this machine), refusing to overwrite unless ``--force``, and prints the public key and the
endpoint suffix a worker's key gives its address (``#curve=KEY``). See docs/SECURITY.md.
"""

from __future__ import annotations

import argparse
import sys

from ..broker.keys import CURVE_MARK, KeyFileError, generate_keypair, load_public_key


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zmq-rpc-keygen``."""
    ap = argparse.ArgumentParser(prog="zmq-rpc-keygen", description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="where to write the key files (made 0700 if missing)")
    ap.add_argument("name", help="file name stem, e.g. the host or user the key belongs to")
    ap.add_argument("--force", action="store_true", help="replace existing key files")
    args = ap.parse_args(argv)
    try:
        public_path, secret_path = generate_keypair(args.directory, args.name, args.force)
    except (KeyFileError, OSError) as exc:
        print(f"zmq-rpc-keygen: {exc}", file=sys.stderr)
        return 1
    key = load_public_key(public_path).decode()
    print(f"public key  {public_path}  (share it: --authorized-keys / --worker-keys dirs)")
    print(f"secret key  {secret_path}  (mode 600, keep it here)")
    print(f"public key  {key}")
    print(f"a worker with this key is reached as  tcp://HOST:PORT{CURVE_MARK}{key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
