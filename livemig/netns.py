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

import os
import subprocess

from livemig.errors import ConfigError


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise ConfigError(f"`ip {' '.join(args)}` failed ({r.stderr.strip()}): a partition needs root and iproute2")


class Partition:
    def __init__(self, k: int | None = None) -> None:
        self.k = (os.getpid() % 200) + 1 if k is None else k
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
