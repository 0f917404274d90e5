"""A real network partition for one worker: its own network namespace.

The worker runs in namespace `lm-<id>` joined to the host by a veth pair
(10.213.<k>.1 and .5 on the host side, .2 inside). Every other process of
the job (the coordinator's group store, the other workers' gloo sockets and
state servers) listens on the host-side address .1, etcd on .5, so the worker
reaches all of them through the veth, and nothing else. `cut()` takes the
link down: data and control paths both go silent while the process lives on
(no RST, no error: exactly what a pulled cable or a bad switch does).
`cut_peers()` breaks only the links to the other processes (a policy rule in
the namespace discards everything it sends to .1, so no connection to or
from the peers' address works) while etcd at .5 stays reachable: two workers
that both still reach etcd but not each other. `heal()` undoes either. Needs
root and iproute2; only for this machine's tests and `livemig run --fault
partition:...` or `link:...`.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile

from livemig.errors import ConfigError


def _claim(kind: str, start: int, lo: int, hi: int) -> tuple[int, int]:
    """A namespace id in [lo, hi) no live process of this machine holds: (id, the lock's fd).
    The lock is an flock, so a dead run's id is free again, and setup's removal of a dead
    run's leftovers never touches a live run's namespace (two runs, or two pytest
    workers, whose pids agree modulo the range)."""
    span = hi - lo
    for i in range(span):
        ident = lo + (start - lo + i) % span
        fd = os.open(os.path.join(tempfile.gettempdir(), f"livemig-{kind}-{ident}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return ident, fd
        except BlockingIOError:
            os.close(fd)
    raise ConfigError(f"every {kind} namespace id ({lo}..{hi - 1}) is held by a live run on this machine")


def _release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # drops the flock


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise ConfigError(f"`ip {' '.join(args)}` failed ({r.stderr.strip()}): a partition needs root and iproute2")


class Partition:
    def __init__(self, k: int | None = None) -> None:
        self._lock: int | None = None
        if k is None:
            k, self._lock = _claim("partition", (os.getpid() % 200) + 1, 1, 201)
        self.k = k
        self.ns = f"lm-{self.k}"
        self.host_if, self.ns_if = f"lmh{self.k}", f"lmn{self.k}"
        self.host_ip, self.ns_ip = f"10.213.{self.k}.1", f"10.213.{self.k}.2"
        self.etcd_ip = f"10.213.{self.k}.5"  # etcd's own address: a peer-link cut leaves it reachable
        self.up = False
        self.peers_cut = False

    def setup(self) -> Partition:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)  # leftovers of a dead run
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.ns)
            _ip("addr", "add", f"{self.host_ip}/29", "dev", self.host_if)
            _ip("addr", "add", f"{self.etcd_ip}/29", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/29", "dev", self.ns_if)
            _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
            _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        except ConfigError:
            self.teardown()
            raise
        self.up = True
        return self

    def wrap(self, argv: list[str]) -> list[str]:
        """The command line that runs `argv` inside the namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def cut(self) -> None:
        _ip("link", "set", self.host_if, "down")

    def cut_peers(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "rule", "add", "to", self.host_ip, "blackhole")
        self.peers_cut = True

    def heal(self) -> None:
        if self.peers_cut:
            _ip("netns", "exec", self.ns, "ip", "rule", "del", "to", self.host_ip, "blackhole")
            self.peers_cut = False
        _ip("link", "set", self.host_if, "up")

    def teardown(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        self.up = False
        _release(self._lock)
        self._lock = None


class Hosts:
    """K simulated hosts for tests: network namespaces `lmh<id>-<k>` on one Linux bridge,
    host k at 10.214.<id>.<k+1>/24, the root namespace at .254 (so a test reaches all of
    them). Processes in them share this kernel, PID space, hostname and /tmp: everything
    that names a node must come from --host and a per-host state dir (docs/operations.md).
    `kill_all(k)` SIGKILLs every process in host k at once (a node lost); `cut(k)` takes
    its link down, `heal(k)` brings it back. Always `teardown()` (a context manager)."""

    def __init__(self, count: int, ident: int | None = None) -> None:
        self._lock: int | None = None
        if ident is None:
            ident, self._lock = _claim("hosts", (os.getpid() % 200) + 20, 20, 220)
        self.id = ident
        self.count = count
        self.bridge = f"lmbr{self.id}"
        self.names = [f"lmh{self.id}-{k}" for k in range(count)]
        self.addrs = [f"10.214.{self.id}.{k + 1}" for k in range(count)]
        self.root_addr = f"10.214.{self.id}.254"

    def _veth(self, k: int) -> tuple[str, str]:
        return f"lmv{self.id}x{k}", f"lmp{self.id}x{k}"

    def setup(self) -> Hosts:
        self._remove()  # leftovers of a dead run (the id's lock says no live run holds them)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.root_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for k, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
                outer, inner = self._veth(k)
                _ip("netns", "add", ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", inner)
                _ip("netns", "exec", ns, "ip", "link", "set", inner, "up")
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except ConfigError:
            self.teardown()
            raise
        return self

    def wrap(self, k: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[k], *argv]

    def pids(self, k: int) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.names[k]], capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()]

    def kill_all(self, k: int) -> list[int]:
        """SIGKILL every process of host k at once: agent, workers, spares, coordinator. A
        machine dies as one: every process is SIGSTOPped before any is killed, else an agent
        killed after one of its workers could still report that worker's death (one rank
        fenced first, the node's others a lease TTL later: not the machine loss meant)."""
        import signal

        pids = self.pids(k)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return pids

    def cut(self, k: int) -> None:
        _ip("link", "set", self._veth(k)[0], "down")

    def heal(self, k: int) -> None:
        _ip("link", "set", self._veth(k)[0], "up")

    def teardown(self) -> None:
        self._remove()
        _release(self._lock)
        self._lock = None

    def _remove(self) -> None:
        import signal

        for k, ns in enumerate(self.names):
            for pid in self.pids(k):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", self._veth(k)[0]], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> Hosts:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()
