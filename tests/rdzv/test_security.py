"""etcd over TLS with client certificates, and password auth with per-job roles, on real
etcd servers (docs/security.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from cryptography import x509

from livemig.errors import ConfigError, EtcdAccessError, EtcdUnavailableError
from livemig.rdzv.client import EtcdClient, parse_endpoints
from livemig.rdzv.embedded import EtcdCluster
from livemig.rdzv.security import EtcdSecurity
from tests.conftest import REPO
from tests.helpers.etcd_auth import enable_auth, job_user

SHORT = timedelta(seconds=2)


@pytest.fixture(scope="module")
def tls_etcd():
    with EtcdCluster(size=1, tls=True, names=["10.9.8.7", "etcd.example"]) as cluster:
        yield cluster


def test_the_tls_etcd_refuses_plaintext_and_clients_without_a_certificate(tls_etcd):
    ok = EtcdClient(tls_etcd.endpoints, SHORT, tls_etcd.security)
    ok.put("/livemig/t/k", b"v")
    assert ok.get("/livemig/t/k").value == b"v"
    plain = tls_etcd.endpoints.replace("https://", "http://")
    with pytest.raises(EtcdUnavailableError):
        EtcdClient(plain, SHORT, EtcdSecurity()).get("/livemig/t/k")
    with pytest.raises(EtcdUnavailableError):  # the server wants a client certificate
        EtcdClient(tls_etcd.endpoints, SHORT, EtcdSecurity(ca=tls_etcd.pki.ca)).get("/livemig/t/k")
    with pytest.raises(ConfigError, match="plaintext: use https"):  # TLS files with an http URL: a mistake
        EtcdClient(plain, SHORT, tls_etcd.security)


def test_the_certificates_are_private_and_name_every_address(tls_etcd):
    pki = tls_etcd.pki
    assert stat.S_IMODE(os.stat(pki.root).st_mode) == 0o700
    for path in (pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    with open(pki.server_cert, "rb") as f:
        san = x509.load_pem_x509_certificate(f.read()).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    ips = {str(i) for i in san.value.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "10.9.8.7"} <= ips
    assert {"localhost", "etcd.example"} <= set(san.value.get_values_for_type(x509.DNSName))


def test_endpoint_schemes():
    assert [e.secure for e in parse_endpoints("https://a:1,https://b:2")] == [True, True]
    with pytest.raises(ConfigError, match="mix http:// and https://"):
        parse_endpoints("https://a:1,http://b:2")
    with pytest.raises(ConfigError, match="go together"):
        EtcdSecurity(cert="/x").check()
    with pytest.raises(ConfigError, match="needs both a user and a password file"):
        EtcdSecurity(user="u").check()


@pytest.fixture(scope="module")
def auth_etcd():
    """TLS with client certificates and password auth, simple tokens that die after 2 s unused."""
    with EtcdCluster(size=1, tls=True, extra_args=["--auth-token-ttl", "2"]) as cluster:
        enable_auth(cluster)
        yield cluster


def test_a_job_user_reads_and_writes_its_prefix_only(auth_etcd, tmp_path):
    a = EtcdClient(auth_etcd.endpoints, SHORT, job_user(auth_etcd, "job-a", tmp_path))
    b = EtcdClient(auth_etcd.endpoints, SHORT, job_user(auth_etcd, "job-b", tmp_path))
    a.put("/livemig/job-a/secret", b"k")
    assert a.get("/livemig/job-a/secret").value == b"k"
    t0 = time.monotonic()
    for what in (lambda: b.get("/livemig/job-a/secret"), lambda: b.get_prefix("/livemig/"),
                 lambda: b.put("/livemig/job-a/suspects/0", b"x"), lambda: a.get("/livemig/job-b/x")):  # fmt: skip
        with pytest.raises(EtcdAccessError, match="permission denied"):
            what()
    assert time.monotonic() - t0 < 1.5, "a refusal is not an outage: no retrying until the timeout"
    assert a.get("/livemig/job-a/suspects/0") is None  # the other job's write left nothing
    nobody = EtcdClient(auth_etcd.endpoints, SHORT, auth_etcd.security)  # certificate, no password
    with pytest.raises(EtcdAccessError):
        nobody.get("/livemig/job-a/secret")


def test_a_wrong_password_is_one_clear_line(auth_etcd, tmp_path):
    good = job_user(auth_etcd, "job-c", tmp_path)
    bad_file = tmp_path / "bad.password"
    bad_file.write_text("hunter2x\n")
    bad = EtcdSecurity(ca=good.ca, cert=good.cert, key=good.key, user=good.user, password_file=str(bad_file))
    with pytest.raises(EtcdAccessError, match="refused the login of user 'livemig-job-c'") as exc:
        EtcdClient(auth_etcd.endpoints, SHORT, bad).get("/livemig/job-c/x")
    assert "\n" not in str(exc.value) and "hunter2x" not in str(exc.value)  # the password is never printed


def test_an_expired_token_is_renewed(auth_etcd, tmp_path):
    client = EtcdClient(auth_etcd.endpoints, SHORT, job_user(auth_etcd, "job-d", tmp_path))
    client.put("/livemig/job-d/k", b"1")
    assert client.reauths == 1
    time.sleep(3.5)  # past --auth-token-ttl 2 with no use: etcd forgot the token
    assert client.get("/livemig/job-d/k").value == b"1"
    assert client.reauths == 2


def test_the_cli_takes_credentials_from_flags_and_a_password_file(auth_etcd, tmp_path):
    sec = job_user(auth_etcd, "job-e", tmp_path)
    base = [sys.executable, "-m", "livemig.cli", "status", "--job", "job-e", "--etcd", auth_etcd.endpoints,
            "--etcd-ca", sec.ca, "--etcd-cert", sec.cert, "--etcd-key", sec.key]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEMIG_ETCD")}
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert out.returncode == 2 and "set LIVEMIG_ETCD_USER and LIVEMIG_ETCD_PASSWORD_FILE" in out.stderr, out.stderr
    out = subprocess.run([*base, "--etcd-user", sec.user, "--etcd-password-file", sec.password_file],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=env)  # fmt: skip
    assert out.returncode == 2 and "job-e" in out.stderr and "permission" not in out.stderr, out.stderr


def test_livemig_etcd_with_a_tls_dir_serves_tls_and_writes_a_bundle_for_the_other_hosts(procs, tmp_path):
    from livemig.rdzv.embedded import free_port
    from livemig.rdzv.security import Pki

    port, peer = free_port(), free_port()
    bundle = tmp_path / "bundle"
    p = procs.spawn([sys.executable, "-m", "livemig.cli", "etcd", "--listen", "127.0.0.1", "--client-port",
                     str(port), "--peer-port", str(peer), "--data-dir", str(tmp_path / "data"),
                     "--tls-dir", str(bundle)])  # fmt: skip
    line = p.stdout.readline().decode() + p.stdout.readline().decode()
    assert f"serving https://127.0.0.1:{port}" in line and "copy it to every host" in line, line
    sec = Pki(str(bundle)).client()
    url = f"https://127.0.0.1:{port}"
    client = EtcdClient(url, timedelta(seconds=10), sec)
    client.put("/livemig/x/k", b"v")
    assert client.get("/livemig/x/k").value == b"v"
    with pytest.raises(EtcdUnavailableError):
        EtcdClient(f"http://127.0.0.1:{port}", SHORT, EtcdSecurity()).get("/livemig/x/k")


def test_failover_across_members_works_over_tls():
    with EtcdCluster(size=3, tls=True) as cluster:
        client = EtcdClient(cluster.endpoints, timedelta(seconds=10), cluster.security)
        client.put("/livemig/f/k", b"1")
        in_use = client.raw.endpoint_in_use.netloc
        i = next(k for k, m in enumerate(cluster.members) if m.client_url.endswith(in_use))
        cluster.kill_member(i)
        client.put("/livemig/f/k", b"2")  # answered by another member, over TLS
        assert client.get("/livemig/f/k").value == b"2"
        assert client.raw.endpoint_in_use.netloc != in_use
