"""Several hosts on one machine, on shaped links: Linux network namespaces, veth pairs, a bridge.

:class:`NetLab` builds a small private network for tests and ``zmq-rpc-bench --link``::

       host "client"        host "w0"          host "w1"        (one network namespace each:
      eth0 10.213.0.2      eth0 10.213.0.3    eth0 10.213.0.4     its own lo, its own eth0)
          |  tbf               |  tbf             |  tbf          (each direction of each link
          +------------+-------+--------+---------+                shaped to the host's rate)
                       |  bridge br0    |
                       +-- namespace "sw" (the switch) --+

Every namespace, the bridge and the subnet exist only inside the lab: nothing is added to the
machine's own network namespace, so no packet of a lab can leave the machine or reach another
lab (several may run at once: each has its own namespaces). Rates use ``tc qdisc ... tbf`` on both
ends of each veth pair (egress of the host's ``eth0`` shapes its uploads, egress of the switch
port shapes its downloads). Latency is not emulated: ``netem`` is not available on the kernels we
run on, so links are bandwidth-limited with sub-millisecond delay.

A direct link between two hosts (:meth:`NetLab.link`: a second veth pair, its own /24 in
10.213.1.0 and up) carries what one host says to the other without the bridge, e.g. two workers'
peer ports (``--peer-bind`` on it), and :meth:`NetLab.set_link` takes it down and up again
(``ip link set ... down``): a partition between two hosts that both still reach the others.

Lifecycle: ``with NetLab({...}) as lab:`` sets everything up (a failure half way tears down what
was made) and on exit stops the processes it started and deletes its namespaces, whatever happened
inside. Namespaces are named ``zrl<pid>x<n>-<host>``: a lab left behind by a process that was
killed is swept by the next lab made on the machine (:func:`sweep_stale`).

Needs root and iproute2 (``apt-get install iproute2``); :func:`unavailable_reason` says what is
missing, for tests to skip with. Owned by the thread that made it; :meth:`NetLab.inside` moves
only the calling thread into a host (threads started there stay there: make clients inside).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..worker.launch import ServerProcess

PREFIX = "zrl"
SUBNET = "10.213.0"
"""The lab's /24: hosts get .2, .3, ... in the order given. It exists only inside the lab."""
SWITCH = "sw"
CLONE_NEWNET = 0x40000000
_counter = itertools.count()

_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class NetLabError(RuntimeError):
    """Building, using or tearing down a lab failed (the message has the command's output)."""


def rate_bits(rate: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 (tc's decimal units)."""
    match = _RATE.match(rate.strip().lower())
    if match is None:
        raise ValueError(f"not a link rate: {rate!r} (write e.g. 100mbit, 1gbit, 2.5gbit)")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


def unavailable_reason() -> str | None:
    """Why a lab cannot be built here (None when it can): not Linux, not root, no iproute2."""
    if not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise NetLabError(f"{' '.join(argv)} failed ({done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()}")
    return done


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose owning process is gone; returns their names."""
    swept = []
    for name in _namespaces():
        match = re.match(rf"^{PREFIX}(\d+)x\d+-", name)
        if match and not _alive(int(match.group(1))):
            _kill_inside(name)
            _run(["ip", "netns", "delete", name], check=False)
            swept.append(name)
    return swept


def _kill_inside(netns: str) -> None:
    """SIGKILL what still runs in one of our lab namespaces (only processes a lab started)."""
    out = _run(["ip", "netns", "pids", netns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class Host:
    """One host of a lab: its namespace, address and link rate (None: not shaped)."""

    name: str
    netns: str
    address: str
    port: str
    rate: str | None


class NetLab:
    """Hosts in network namespaces, on one bridge, with shaped links (see the module doc)."""

    def __init__(self, hosts: Mapping[str, str | None] | Sequence[str],
                 rate: str | None = "1gbit") -> None:
        rates = dict(hosts) if isinstance(hosts, Mapping) else dict.fromkeys(hosts, rate)
        if not rates or len(rates) > 200:
            raise ValueError("a lab has 1 to 200 hosts")
        for name, r in rates.items():
            if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", name) or name == SWITCH:
                raise ValueError(f"host names are 1-6 lowercase letters/digits, not {name!r}")
            if r is not None:
                rate_bits(r)
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.tag}-{SWITCH}"
        self.hosts = {name: Host(name, f"{self.tag}-{name}", f"{SUBNET}.{i + 2}", f"p{i}", r)
                      for i, (name, r) in enumerate(rates.items())}
        self.links: dict[frozenset[str], tuple[int, str | None]] = {}
        """Direct links made by :meth:`link`: (their subnet's third octet, their rate)."""
        self.processes: list[subprocess.Popen[str]] = []
        self.servers: list[ServerProcess] = []
        self._made: list[str] = []
        self._open = False

    # ------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> NetLab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Build the namespaces, the bridge, the links and their shaping."""
        reason = unavailable_reason()
        if reason:
            raise NetLabError(reason)
        sweep_stale()
        self._open = True
        try:
            self._add_netns(self.switch)
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "link", "set", "br0", "up")
            for host in self.hosts.values():
                self._add_host(host)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        self._ip(name, "link", "set", "lo", "up")

    def _add_host(self, host: Host) -> None:
        self._add_netns(host.netns)
        _run(["ip", "link", "add", "name", "eth0", "netns", host.netns, "type", "veth",
              "peer", "name", host.port, "netns", self.switch])
        self._ip(host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        self._ip(host.netns, "link", "set", "eth0", "up")
        self._ip(self.switch, "link", "set", host.port, "master", "br0")
        self._ip(self.switch, "link", "set", host.port, "up")
        if host.rate is not None:
            self.shape(host.name, host.rate)

    def close(self) -> None:
        """Stop the processes started here, then delete every namespace (idempotent)."""
        if not self._open:
            return
        self._open = False
        for server in self.servers:
            server.stop(timeout=10)
        for proc in self.processes:
            _stop(proc)
        self.servers.clear()
        self.processes.clear()
        for name in reversed(self._made):
            _kill_inside(name)
            _run(["ip", "netns", "delete", name], check=False)
        self._made.clear()

    # ---------------------------------------------------------------------------- links

    def shape(self, host: str, rate: str | None) -> None:
        """Set (or with None remove) the rate of ``host``'s link, both directions."""
        h = self.hosts[host]
        self.hosts[host] = Host(h.name, h.netns, h.address, h.port, rate)
        for netns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
            if rate is None:
                _run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                     check=False)
                continue
            _run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root",
                  *tbf_args(rate)])

    def link(self, a: str, b: str, rate: str | None = None) -> None:
        """A direct veth link between hosts ``a`` and ``b`` (device ``l-<other host>`` on each
        side, addresses :meth:`link_address`), shaped to ``rate`` both ways (None: not)."""
        key = frozenset((a, b))
        if a == b or key in self.links or a not in self.hosts or b not in self.hosts:
            raise ValueError(f"cannot link {a!r} and {b!r}")
        if rate is not None:
            rate_bits(rate)
        self.links[key] = (len(self.links) + 1, rate)
        ha, hb = self.hosts[a], self.hosts[b]
        _run(["ip", "link", "add", "name", f"l-{b}", "netns", ha.netns, "type", "veth",
              "peer", "name", f"l-{a}", "netns", hb.netns])
        for host, other in ((a, b), (b, a)):
            netns = self.hosts[host].netns
            self._ip(netns, "addr", "add", f"{self.link_address(host, other)}/24", "dev",
                     f"l-{other}")
            self._ip(netns, "link", "set", f"l-{other}", "up")
            if rate is not None:
                _run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev",
                      f"l-{other}", "root", *tbf_args(rate)])

    def link_address(self, host: str, other: str) -> str:
        """``host``'s address on its direct link to ``other``."""
        octet, _ = self.links[frozenset((host, other))]
        return f"{SUBNET.rsplit('.', 1)[0]}.{octet}.{1 if host < other else 2}"

    def set_link(self, a: str, b: str, up: bool) -> None:
        """Take the direct link between ``a`` and ``b`` down (``ip link set ... down`` on
        ``a``'s side: ``b``'s side loses its carrier) or bring it up again."""
        if frozenset((a, b)) not in self.links:
            raise ValueError(f"no direct link between {a!r} and {b!r}")
        self._ip(self.hosts[a].netns, "link", "set", f"l-{b}", "up" if up else "down")

    def qdisc(self, host: str) -> str:
        """``tc -s qdisc show`` of the host's eth0 (for reports and tests)."""
        return self.run(host, ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout

    # ------------------------------------------------------------------------ processes

    def address(self, host: str) -> str:
        """The host's address in the lab subnet."""
        return self.hosts[host].address

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` inside ``host`` (text mode); stopped by :meth:`close` if still running."""
        proc: subprocess.Popen[str] = subprocess.Popen(self.argv(host, argv), text=True,
                                                       **kwargs)  # type: ignore[call-overload]
        self.processes.append(proc)
        return proc

    def serve(self, host: str, argv: Sequence[str]) -> ServerProcess:
        """Start a server inside ``host`` (its first stdout line ends ``listening on ENDPOINT``:
        ``zmq-rpc-worker``, the bench's baselines) and wait for it; stopped by :meth:`close`."""
        server = ServerProcess(self.argv(host, argv))
        self.servers.append(server)
        server.wait_ready()
        return server

    def run(self, host: str, argv: Sequence[str], check: bool = True,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host`` to completion, capturing its output."""
        done = subprocess.run(self.argv(host, argv), capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise NetLabError(f"{argv[0]} in {host} failed ({done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done

    @contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """Move the calling thread into ``host``'s namespace for the block (then back).

        Sockets made in the block, and threads started in it (with their sockets: a zmq
        context's I/O threads, a client's engine), belong to the host for good."""
        with _setns(f"/run/netns/{self.hosts[host].netns}"):
            yield

    def _ip(self, netns: str, *args: str) -> None:
        _run(["ip", "-n", netns, *args])


def tbf_args(rate: str) -> list[str]:
    """A token bucket at ``rate``: a burst of ~1 ms at that rate (at least 64 KiB, so that one
    GSO segment fits) and up to 50 ms of queue before drops."""
    burst = max(rate_bits(rate) // 8 // 1000, 64 << 10)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _stop(proc: subprocess.Popen[str], timeout: float = 10.0) -> None:
    """SIGTERM (SIGKILL after ``timeout``), wait, close its pipes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@contextmanager
def _setns(path: str) -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise NetLabError(f"setns({path}) failed: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise NetLabError(f"cannot return from {path}: "
                                  f"{os.strerror(ctypes.get_errno())}")
    finally:
        os.close(target)
        os.close(home)


def _gettid() -> int:
    return int(ctypes.CDLL(None).syscall(186)) if not hasattr(os, "gettid") else os.gettid()


def worker_argv(lab: NetLab, host: str, *extra: str, bind: str | None = None) -> list[str]:
    """A ``zmq-rpc-worker`` for ``host`` bound to ``bind`` (default: the host's lab address;
    free ports for clients and peers), one BLAS thread. The lab is a private network, so a
    worker that wants keys or ``--insecure`` to listen beyond loopback gets ``--insecure``
    unless ``extra`` names keys."""
    argv = [sys.executable, "-m", "zmq_rpc.worker.cli", "--bind",
            bind or f"tcp://{lab.address(host)}:*", "--threads", "1", "--log-level", "WARNING",
            *extra]
    if "--curve-secret-key" not in extra and _worker_option("--insecure"):
        argv.append("--insecure")
    return argv


def _worker_option(flag: str) -> bool:
    from ..worker.cli import build_parser

    return flag in build_parser()._option_string_actions
