"""Local job discovery: `livemig run` leaves a small file so that `status`,
`inject` and `livemig-spare` on the same machine find the job's etcd
without flags."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import psutil

from livemig.config import ENV_ETCD, ENV_KEEP_RUNS, ENV_STATE_DIR, validate_job_name
from livemig.errors import ConfigError
from livemig.rdzv.security import EtcdSecurity

if TYPE_CHECKING:
    from livemig.rdzv.client import EtcdClient


def state_dir() -> str:
    return os.environ.get(ENV_STATE_DIR) or os.path.join("/tmp", f"livemig-{os.getuid()}")


def job_file(job: str) -> str:
    return os.path.join(state_dir(), "jobs", f"{validate_job_name(job)}.json")


def write_job_file(job: str, etcd: str, pid: int | None = None, security: EtcdSecurity | None = None) -> str:
    """The job's etcd and the credentials that reach it (paths, never a password): 0600 in a
    0700 directory, since the client key it names opens the job."""
    path = job_file(job)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    info = {"job": job, "etcd": etcd, "pid": pid or os.getpid(), "started": time.time()}
    if security is not None and security.tls:
        info["tls"] = {"ca": security.ca, "cert": security.cert, "key": security.key}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    return path


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def live_owner(job: str) -> dict | None:
    """The job file of a `livemig run` of `job` on this machine that is still alive and is
    not this process: its launcher's pid exists and started before the file was written
    (a recycled pid is not the run)."""
    info = _read(job_file(job))
    if info is None:
        return None
    try:
        pid = int(info.get("pid", -1))
        if pid == os.getpid() or not psutil.pid_exists(pid):
            return None
        if psutil.Process(pid).create_time() > float(info.get("started", 0)) + 1:
            return None
    except (psutil.Error, TypeError, ValueError):
        return None
    return info


def refuse_duplicate(job: str) -> None:
    """One job name, one job on this machine: a second `livemig run` of a live name would
    point `status`, `inject` and `livemig-spare` at itself, so it is refused before it starts."""
    info = live_owner(job)
    if info is not None:
        since = time.strftime("%H:%M:%S", time.localtime(float(info.get("started", 0))))
        raise ConfigError(
            f"job {job} is already running on this machine (livemig run pid {info['pid']}, since {since}, "
            f"etcd {info.get('etcd')}): name this one with --job NAME"
        )


def claim_job_file(job: str, etcd: str, security: EtcdSecurity | None = None) -> bool:
    """Write the job file unless another live run of `job` holds it (a further node of a
    `--nnodes` run on this machine joins that run: the first node's file stays)."""
    if live_owner(job) is not None:
        return False
    write_job_file(job, etcd, security=security)
    return True


def remove_job_file(job: str) -> None:
    """Only our own: a run never removes the file of another run of the same name."""
    path = job_file(job)
    info = _read(path)
    if info is not None and info.get("pid") not in (None, os.getpid()):
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def resolve(job: str, etcd: str | None) -> tuple[str, EtcdSecurity]:
    """The job's etcd and the credentials to present: --etcd, then $LIVEMIG_ETCD, then a
    live local `livemig run` of `job`; credentials from the flags/environment, else (a
    local run's embedded etcd, TLS with its own certificates) from the job file."""
    given = etcd or os.environ.get(ENV_ETCD)
    env = EtcdSecurity.from_env()
    path = job_file(job)
    info = _read(path)
    security = env
    if info is not None and isinstance(info.get("tls"), dict) and not (env.tls or env.user):
        if not given or set(given.split(",")) <= set(str(info.get("etcd", "")).split(",")):
            tls = info["tls"]
            security = EtcdSecurity(ca=tls.get("ca"), cert=tls.get("cert"), key=tls.get("key"))
    if given:
        return given, security
    if info is None:
        raise ConfigError(
            f"no etcd for job {job!r}: pass --etcd https://HOST:PORT (no local run found at {path})"
        ) from None
    if not psutil.pid_exists(int(info.get("pid", -1))):
        raise ConfigError(
            f"job {job!r} ran locally but its launcher (pid {info.get('pid')}) has exited; "
            "pass --etcd to reach another etcd"
        )
    return str(info["etcd"]), security


def connect(job: str, etcd: str | None, timeout: timedelta) -> EtcdClient:
    """A client of the job's etcd (resolve()): what every CLI command uses."""
    from livemig.rdzv.client import EtcdClient

    endpoints, security = resolve(job, etcd)
    return EtcdClient(endpoints, timeout, security)


def prune_stale_dirs(root: str, pattern: str = r".*-\d+") -> None:
    """Remove `root/NAME-PID` directories whose process is gone
    (a launcher killed by SIGKILL leaves its run's certificates, or its embedded etcd's data
    under the temp dir, behind: the next run removes them). `pattern`: the names (a regex,
    whole name) that are ours to remove, so nothing else in a shared directory is touched."""
    import re
    import shutil

    try:
        entries = os.listdir(root)
    except OSError:
        return
    for name in entries:
        pid = name.rsplit("-", 1)[-1]
        if re.fullmatch(pattern, name) and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


KEEP_RUNS_DEFAULT = 20  # run log directories kept under the state dir ($LIVEMIG_KEEP_RUNS)


def prune_runs(root: str, keep: int | None = None) -> None:
    """Keep the newest `keep` run log directories under root (state_dir()/runs): every run
    leaves one, and nothing else ever removes them."""
    if keep is None:
        raw = os.environ.get(ENV_KEEP_RUNS, "")
        if raw and not raw.isdigit():
            raise ConfigError(f"{ENV_KEEP_RUNS}={raw!r}: expected a number of run directories to keep")
        keep = int(raw) if raw else KEEP_RUNS_DEFAULT
    import shutil

    try:
        entries = [os.path.join(root, n) for n in os.listdir(root)]
    except OSError:
        return

    def touched(path: str) -> float:  # a live run appends to its logs: its newest file is recent
        try:
            return max([os.stat(path).st_mtime, *(e.stat().st_mtime for e in os.scandir(path))])
        except OSError:
            return 0.0

    now = time.time()
    dirs = sorted(((touched(p), p) for p in entries if os.path.isdir(p)), reverse=True)
    for t, path in dirs[max(keep, 1) :]:  # never this run's own (the newest), nor one written lately
        if now - t > 600:
            shutil.rmtree(path, ignore_errors=True)


def require_live_job(client: EtcdClient, job: str) -> None:
    """Refuse at once a command aimed at a job etcd does not hold, or one that has ended,
    rather than wait out its timeout (and, for migrate, leave a request behind)."""
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import GenState, Membership

    keys = JobKeys(job)
    kvs, _ = client.get_prefix(keys.prefix)
    if not kvs:
        raise ConfigError(
            f"job {job} is not in this etcd: is it running, under that name? (livemig status --job {job})"
        )
    m = Membership.from_kvs({kv.key: kv for kv in kvs}, keys)
    if m.state in (GenState.DONE, GenState.FAILED):
        raise ConfigError(f"job {job} has ended ({m.state}): there is nothing to act on")
