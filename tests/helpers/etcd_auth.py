"""An external etcd with auth on, as an operator sets one up: a root user, auth enabled,
and one user and role per job made by scripts/etcd-job-user.sh (the script users run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from livemig.rdzv.embedded import EtcdCluster, find_etcd_binary
from livemig.rdzv.security import EtcdSecurity

REPO = Path(__file__).resolve().parents[2]
ROOT_PASSWORD = "root-secret"


def etcdctl_env(cluster: EtcdCluster, admin: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env["ETCDCTL_API"] = "3"
    env["ETCDCTL_ENDPOINTS"] = cluster.endpoints
    env["ETCDCTL_BIN"] = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    if cluster.pki is not None:
        env.update(ETCDCTL_CACERT=cluster.pki.ca, ETCDCTL_CERT=cluster.pki.client_cert,
                   ETCDCTL_KEY=cluster.pki.client_key)  # fmt: skip
    if admin:
        env.update(ETCDCTL_USER="root", ETCDCTL_PASSWORD=ROOT_PASSWORD)
    return env


def enable_auth(cluster: EtcdCluster) -> None:
    env = etcdctl_env(cluster, admin=False)
    ctl = env["ETCDCTL_BIN"]
    subprocess.run([ctl, "user", "add", "root", "--interactive=false"], input=ROOT_PASSWORD.encode(),
                   env=env, check=True, capture_output=True, timeout=30)  # fmt: skip
    subprocess.run([ctl, "auth", "enable"], env=env, check=True, capture_output=True, timeout=30)


def job_user(cluster: EtcdCluster, job: str, tmp_path: Path, password: str | None = None) -> EtcdSecurity:
    """The job's user made by the script; returns what a livemig process of the job presents."""
    pwfile = tmp_path / f"{job}.password"
    pwfile.write_text((password or f"{job}-pw") + "\n")
    pwfile.chmod(0o600)
    out = subprocess.run(["bash", str(REPO / "scripts" / "etcd-job-user.sh"), job, str(pwfile)],
                         env=etcdctl_env(cluster), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    base = cluster.security
    return EtcdSecurity(ca=base.ca, cert=base.cert, key=base.key, user=f"livemig-{job}", password_file=str(pwfile))
