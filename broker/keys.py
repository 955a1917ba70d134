"""CurveZMQ key files and endpoints that carry a key: read, write, check. Pure functions.

Any thread may call these; nothing here keeps state. The files are ZeroMQ's certificate format
(ZPL, what ``zmq.auth.create_certificates`` writes and ``zmq.auth.load_certificate`` reads), so keys
made by other ZeroMQ tools work here and ours work there:

- ``NAME.key``: the public key only; safe to copy anywhere (mode 0644);
- ``NAME.key_secret``: both keys; never leaves its machine (mode 0600, refused if group or others
  may read it, like ssh refuses a private key that is too open).

An endpoint may carry the public key of the server listening there: ``tcp://10.0.0.2:50052#curve=``
followed by the 40-character Z85 key (or 64 hex digits). Workers advertise their peer endpoint this
way, so a key travels wherever the endpoint does (a client's worker list, a PEER_SEND's destination)
with no change to the wire protocol. ``#`` never occurs in a tcp/ipc/inproc address.
"""

from __future__ import annotations

import binascii
import datetime
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

__all__ = ["KeyPair", "KeyFileError", "CURVE_MARK", "generate_keypair", "load_keypair",
           "load_public_key", "load_key_dir", "read_key_dir", "key_dir_signature", "KeyDir",
           "parse_key", "split_endpoint", "join_endpoint"]

CURVE_MARK = "#curve="
Z85_KEY_LEN = 40


class KeyFileError(ValueError):
    """A key file or key text that cannot be used (missing, malformed, too open)."""


@dataclass(frozen=True)
class KeyPair:
    """A CurveZMQ key pair, both halves Z85 (40 ASCII bytes)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:     # never print a secret key into a log or a traceback
        return f"KeyPair(public={self.public.decode()!r}, secret=<hidden>)"


def parse_key(text: str | bytes) -> bytes:
    """A public key given as 40 Z85 characters or 64 hex digits, as Z85 bytes."""
    raw = text.strip().encode() if isinstance(text, str) else text.strip()
    if len(raw) == 64:
        try:
            raw = z85.encode(binascii.unhexlify(raw))
        except (binascii.Error, ValueError):
            raise KeyFileError("a 64-character key must be hex digits") from None
    if len(raw) != Z85_KEY_LEN:
        raise KeyFileError(f"a CURVE key is 40 Z85 characters or 64 hex digits, not {len(raw)}")
    try:
        z85.decode(raw)
    except (ValueError, KeyError, TypeError):
        raise KeyFileError("not a Z85 key") from None
    return raw


def split_endpoint(endpoint: str) -> tuple[str, bytes | None]:
    """``tcp://h:p#curve=KEY`` -> (``tcp://h:p``, KEY); an endpoint without a key -> (it, None)."""
    address, mark, key = endpoint.partition(CURVE_MARK)
    if not mark:
        return endpoint, None
    return address, parse_key(key)


def join_endpoint(address: str, public_key: bytes | None) -> str:
    """The endpoint text that tells whoever connects which server key to expect."""
    return address if public_key is None else f"{address}{CURVE_MARK}{public_key.decode()}"


def _read_fields(path: Path) -> dict[str, bytes]:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    fields: dict[str, bytes] = {}
    for line in text.splitlines():
        line = line.strip()
        for name in ("public-key", "secret-key"):
            if line.startswith(name.encode()):
                fields[name] = line.split(b"=", 1)[-1].strip(b" \t'\"")
    if "public-key" not in fields:
        raise KeyFileError(f"{path} holds no public-key")
    return fields


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file."""
    path = Path(path)
    try:
        return parse_key(_read_fields(path)["public-key"])
    except KeyFileError as exc:
        raise KeyFileError(f"{path}: {exc}") from None


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """Both keys from a ``.key_secret`` file, refused if group or others may read it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}): a secret "
                        f"key must be private, run: chmod 600 {path}")
    fields = _read_fields(path)
    if "secret-key" not in fields:
        raise KeyFileError(f"{path} holds no secret-key (a .key file is the public half: "
                        "pass the .key_secret file)")
    pair = KeyPair(parse_key(fields["public-key"]), parse_key(fields["secret-key"]))
    if zmq.curve_public(pair.secret) != pair.public:
        raise KeyFileError(f"{path}: its public key is not the secret key's")
    return pair


def load_key_dir(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """Every public key in ``directory``'s ``*.key`` files (a malformed one is an error: a typo
    must not silently lock someone out, or worse, be ignored in an allow list)."""
    scan = read_key_dir(directory)
    if scan.errors:
        raise KeyFileError(scan.errors[0])
    return scan.keys


Signature = tuple[tuple[str, int, int, int, int], ...]
"""Per ``*.key`` file, sorted by name: (name, size, mtime_ns, ctime_ns, inode)."""
RACY_NS = 1_000_000_000
"""A file whose mtime or ctime is this close to a read may change again without its signature
changing (the kernel stamps times from a coarse clock: two same-size writes a few ms apart can
carry one stamp, like ``cp carol.key bob.key`` right after bob.key was written): while any file
is that fresh, its contents are read again at every look (git's "racy clean" problem)."""


@dataclass(frozen=True)
class KeyDir:
    """What one read of a key directory found: the keys of its good files, one error per file
    refused (malformed, unreadable), and the signature the read matched."""

    signature: Signature
    keys: frozenset[bytes]
    errors: tuple[str, ...] = ()
    racy: bool = False
    """Some file changed within :data:`RACY_NS` of the read: read it again next time."""

    def stale(self, signature: Signature) -> bool:
        """Whether a look that found ``signature`` must read the files again."""
        return self.racy or signature != self.signature


def key_dir_signature(directory: str | os.PathLike[str]) -> Signature:
    """One ``scandir`` and one ``stat`` per ``*.key`` file (following symlinks): any write,
    replacement, rename, addition or removal of a file changes it. KeyFileError when the
    directory cannot be listed."""
    entries = []
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                if entry.name.endswith(".key"):
                    entries.append(_file_signature(entry))
    except OSError as exc:
        raise KeyFileError(f"{directory} is not a readable directory of .key files "
                           f"({exc.strerror})") from None
    return tuple(sorted(entries))


def _file_signature(entry: os.DirEntry[str]) -> tuple[str, int, int, int, int]:
    try:
        st = os.stat(entry.path)
    except OSError:          # a dangling link, or gone since the listing: read() says why
        return (entry.name, -1, -1, -1, -1)
    return (entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def read_key_dir(directory: str | os.PathLike[str]) -> KeyDir:
    """Each ``*.key`` file read on its own: a malformed one is refused (named in ``errors``)
    and the others still count, so a removal elsewhere in the directory always applies."""
    signature = key_dir_signature(directory)
    keys, errors = set(), []
    for name, *_ in signature:
        try:
            keys.add(load_public_key(Path(directory) / name))
        except KeyFileError as exc:
            errors.append(str(exc))
    now = time.time_ns()
    racy = any(now - max(sig[2], sig[3]) < RACY_NS for sig in signature)
    return KeyDir(signature, frozenset(keys), tuple(errors), racy)


_BANNER = ("#   ****  Generated on {now} by zmq-rpc-keygen  ****\n"
           "#   ZeroMQ CURVE {what} Certificate\n#   {advice}\n\n")


def generate_keypair(directory: str | os.PathLike[str], name: str,
                     overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600, created private, never
    widened afterwards) into ``directory`` (made 0700 if missing); returns both paths."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"not a key name: {name!r}")
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    paths = folder / f"{name}.key", folder / f"{name}.key_secret"
    body = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    _write(paths[0], _BANNER.format(now=now, what="Public", advice="Copy it to whoever "
                                    "must trust this key.") + body, 0o644, overwrite)
    _write(paths[1], _BANNER.format(now=now, what="**Secret**", advice="DO NOT PROVIDE THIS "
                                    "FILE TO OTHER USERS nor change its permissions.")
           + body + f'    secret-key = "{secret.decode()}"\n', 0o600, overwrite)
    return paths


def _write(path: Path, text: str, mode: int, overwrite: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except FileExistsError:
        raise KeyFileError(f"{path} exists (pass --force to replace it)") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(fd, mode)       # the umask may have narrowed it; an old file may be wider
        f.write(text)
