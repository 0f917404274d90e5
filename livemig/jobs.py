"""Local job discovery: `livemig run` leaves a small file so that `status`,
`inject` and `livemig-spare` on the same machine find the job's etcd
without flags."""

from __future__ import annotations

import json
import os
import time

import psutil

from livemig.config import ENV_ETCD, ENV_STATE_DIR, validate_job_name
from livemig.errors import ConfigError


def state_dir() -> str:
    return os.environ.get(ENV_STATE_DIR) or os.path.join("/tmp", f"livemig-{os.getuid()}")


def job_file(job: str) -> str:
    return os.path.join(state_dir(), "jobs", f"{validate_job_name(job)}.json")


def write_job_file(job: str, etcd: str, pid: int | None = None) -> str:
    path = job_file(job)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"job": job, "etcd": etcd, "pid": pid or os.getpid(), "started": time.time()}, f)
    os.replace(tmp, path)
    return path


def remove_job_file(job: str) -> None:
    try:
        os.unlink(job_file(job))
    except OSError:
        pass


def resolve_etcd(job: str, etcd: str | None) -> str:
    """--etcd, then $LIVEMIG_ETCD, then a live local `livemig run` of `job`."""
    if etcd:
        return etcd
    if os.environ.get(ENV_ETCD):
        return os.environ[ENV_ETCD]
    path = job_file(job)
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        raise ConfigError(
            f"no etcd for job {job!r}: pass --etcd http://HOST:PORT (no local run found at {path})"
        ) from None
    if not psutil.pid_exists(int(info.get("pid", -1))):
        raise ConfigError(
            f"job {job!r} ran locally but its launcher (pid {info.get('pid')}) has exited; "
            "pass --etcd to reach another etcd"
        )
    return str(info["etcd"])
