"""etcd credentials: TLS files, a user and a password file, and the embedded CA.

Whoever holds the job's etcd credentials is trusted (docs/security.md); the
transfer key lives in etcd, so these credentials guard the model too.

The settings travel in the environment (LIVEMIG_ETCD_CA, _CERT, _KEY, _USER,
_PASSWORD_FILE): the command-line flags set them once in the process that
parses them and every process livemig starts inherits them, so no code path
between a flag and an etcd client can forget to pass them on. A password is
read from a file, never from the command line or the environment, where
`ps` and /proc/PID/environ show it.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import socket
import stat
from dataclasses import asdict, dataclass

from livemig.config import ENV_CA, ENV_CERT, ENV_KEY, ENV_PASSWORD_FILE, ENV_USER
from livemig.errors import ConfigError

log = logging.getLogger("livemig.rdzv.security")

_FIELDS = {"ca": ENV_CA, "cert": ENV_CERT, "key": ENV_KEY, "user": ENV_USER, "password_file": ENV_PASSWORD_FILE}


@dataclass(frozen=True)
class EtcdSecurity:
    """What a client presents to etcd. All fields optional: none is plaintext, no auth."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None

    @classmethod
    def from_env(cls) -> EtcdSecurity:
        return cls(**{f: os.environ.get(env) or None for f, env in _FIELDS.items()})

    def to_env(self) -> dict[str, str]:
        return {_FIELDS[f]: v for f, v in asdict(self).items() if v}

    def to_env_clear(self) -> dict[str, str]:
        """Every setting's variable, empty: a child's environment starts from this, then
        to_env(), so an inherited credential for another etcd does not leak in."""
        return dict.fromkeys(_FIELDS.values(), "")

    def apply_to_environ(self) -> None:
        """Make this the setting of this process and of everything it starts."""
        for f, env in _FIELDS.items():
            v = getattr(self, f)
            if v:
                os.environ[env] = v
            else:
                os.environ.pop(env, None)

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def check(self) -> None:
        """One clear line for a setting that cannot work, before any connection is tried."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--etcd-cert and --etcd-key go together: give both (or neither)")
        for name in ("ca", "cert", "key", "password_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"etcd {name.replace('_', ' ')} file {path!r} does not exist")
        # gRPC takes any bytes and fails each connection with lines of its own: say it once, here
        for name, marker in (("ca", b"-----BEGIN CERTIFICATE-----"), ("cert", b"-----BEGIN CERTIFICATE-----"),
                             ("key", b"PRIVATE KEY-----")):  # fmt: skip
            path = getattr(self, name)
            if path and not _holds(path, marker):
                what = "a PEM certificate" if name != "key" else "a PEM private key"
                raise ConfigError(f"etcd {name} file {path!r} is not {what} (--etcd-{name})")
        if bool(self.user) != bool(self.password_file):
            raise ConfigError(
                f"etcd auth needs both a user and a password file: set {ENV_USER} and {ENV_PASSWORD_FILE} "
                "(or --etcd-user and --etcd-password-file)"
            )

    def password(self) -> str:
        assert self.password_file
        try:
            mode = os.stat(self.password_file).st_mode
            with open(self.password_file) as f:
                pw = f.read().rstrip("\n")
        except OSError as exc:
            raise ConfigError(f"cannot read the etcd password file {self.password_file!r}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("etcd password file is readable by others: chmod 600 it", extra={"path": self.password_file})
        if not pw:
            raise ConfigError(f"the etcd password file {self.password_file!r} is empty")
        return pw

    def credentials(self):  # -> grpc.ChannelCredentials
        import grpc

        def read(path: str | None) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise ConfigError(f"cannot read etcd TLS file {path!r}: {exc.strerror}") from None

        # no CA file: the system's roots (an etcd behind a public CA)
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def _holds(path: str, marker: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return marker in f.read(1 << 20)
    except OSError:
        return True  # unreadable: credentials() says so with the reason


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The etcd credential flags, the same on every livemig command."""
    g = p.add_argument_group("etcd security (docs/security.md)")
    g.add_argument("--etcd-ca", help=f"CA bundle that signed etcd's certificate (or ${ENV_CA})")
    g.add_argument("--etcd-cert", help=f"client certificate for etcd (or ${ENV_CERT})")
    g.add_argument("--etcd-key", help=f"its private key (or ${ENV_KEY})")
    g.add_argument("--etcd-user", help=f"etcd user for password auth (or ${ENV_USER})")
    g.add_argument(
        "--etcd-password-file",
        help=f"file holding that user's password (or ${ENV_PASSWORD_FILE}); never a password on the command line",
    )


def apply_arguments(a: argparse.Namespace) -> EtcdSecurity:
    """Flags override the environment; the result becomes the environment (children inherit it)."""
    env = EtcdSecurity.from_env()
    sec = EtcdSecurity(
        ca=getattr(a, "etcd_ca", None) or env.ca,
        cert=getattr(a, "etcd_cert", None) or env.cert,
        key=getattr(a, "etcd_key", None) or env.key,
        user=getattr(a, "etcd_user", None) or env.user,
        password_file=getattr(a, "etcd_password_file", None) or env.password_file,
    )
    sec.check()
    sec.apply_to_environ()
    return sec


# -- the embedded etcd's own CA (secure by default) ----------------------------------------
@dataclass(frozen=True)
class Pki:
    """A CA and the certificates of one etcd deployment, as files (0600) in `root`."""

    root: str

    @property
    def ca(self) -> str:
        return os.path.join(self.root, "ca.crt")

    @property
    def server_cert(self) -> str:
        return os.path.join(self.root, "server.crt")

    @property
    def server_key(self) -> str:
        return os.path.join(self.root, "server.key")

    @property
    def client_cert(self) -> str:
        return os.path.join(self.root, "client.crt")

    @property
    def client_key(self) -> str:
        return os.path.join(self.root, "client.key")

    def client(self) -> EtcdSecurity:
        return EtcdSecurity(ca=self.ca, cert=self.client_cert, key=self.client_key)

    def server_args(self) -> list[str]:
        """etcd flags: TLS only, client certificates required, for clients and peers alike."""
        return ["--cert-file", self.server_cert, "--key-file", self.server_key,
                "--client-cert-auth", "--trusted-ca-file", self.ca,
                "--peer-cert-file", self.server_cert, "--peer-key-file", self.server_key,
                "--peer-client-cert-auth", "--peer-trusted-ca-file", self.ca]  # fmt: skip

    def exists(self) -> bool:
        return all(os.path.isfile(p) for p in (self.ca, self.server_cert, self.server_key,
                                                self.client_cert, self.client_key))  # fmt: skip


def local_names() -> list[str]:
    """The names and addresses this host is reached at, for a server certificate."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return sorted(n for n in names if n)


def make_pki(root: str, names: list[str], days: int = 365) -> Pki:
    """A new CA, a server/peer certificate naming `names` (addresses and DNS names), and a
    client certificate: what a TLS-only etcd and its clients need. EC P-256: fast to make
    (a run makes one at start) and to handshake."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    pki = Pki(root)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "livemig"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # fmt: skip

    ca_key = key()
    ca = (
        x509.CertificateBuilder().subject_name(name("livemig etcd CA")).issuer_name(name("livemig etcd CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip

    def leaf(cn: str, usages: list, sans: list[str] | None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        k = key()
        b = (
            x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
            .public_key(k.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )  # fmt: skip
        if sans:
            alt: list[x509.GeneralName] = []
            for n in dict.fromkeys(sans):
                try:
                    alt.append(x509.IPAddress(ipaddress.ip_address(n)))
                except ValueError:
                    alt.append(x509.DNSName(n))
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return b.sign(ca_key, hashes.SHA256()), k

    # the server certificate is also the peer certificate: it authenticates as a client to other members
    server, server_key = leaf("livemig etcd", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                              names)  # fmt: skip
    client, client_key = leaf("livemig", [ExtendedKeyUsageOID.CLIENT_AUTH], None)

    def write(path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    pem = serialization.Encoding.PEM
    for path, obj in ((pki.ca, ca), (pki.server_cert, server), (pki.client_cert, client)):
        write(path, obj.public_bytes(pem))
    for path, k in ((pki.server_key, server_key), (pki.client_key, client_key)):
        write(path, k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    log.info("etcd certificates made", extra={"dir": root, "names": names})
    return pki
