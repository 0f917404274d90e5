"""`livemig stop --job J` and `livemig drain --job J --node K`: what an orchestrator's
SIGTERM does, from a shell.

- stop: the whole job stops at a checkpoint of its next step (runtime/stop.py): every member
  writes its part of it, the agents exit with status 75, and the job run again with the same
  `--checkpoint-dir` resumes there, exactly. The command waits for the job's end and prints
  the checkpoint's step.
- drain: node K's agent drains as on SIGTERM (agent/drain.py): its ranks move onto warm
  spares elsewhere (or the survivors carry them within `--min-nproc`), then it exits 0; when
  the job cannot do without the node, the whole job stops at a checkpoint instead. The
  command waits until node K left (or the job ended) and says which.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

from livemig.config import validate_job_name
from livemig.errors import ConfigError
from livemig.rdzv.client import EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.requests import request_drain, request_stop
from livemig.rdzv.security import add_arguments as add_security_arguments


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True)
    p.add_argument("--reason", default="requested by an operator")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the outcome (default 300; 0: don't)")
    p.add_argument("--etcd")
    p.add_argument("--etcd-timeout", type=float, default=5.0)
    add_security_arguments(p)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="stop the whole job at a checkpoint of its next step (resumable)")
    _common(p)
    p.set_defaults(fn=cmd_stop)
    p = sub.add_parser("drain", help="move one node's ranks elsewhere and let its agent exit (as SIGTERM)")
    _common(p)
    p.add_argument("--node", type=int, required=True, help="the node rank (livemig status lists them)")
    p.set_defaults(fn=cmd_drain)


def _result(client: EtcdClient, keys: JobKeys) -> dict[str, Any] | None:
    kv = client.get(keys.result)
    return conform(kv.value, {"state": (str,)}) if kv is not None else None


def _wait(client: EtcdClient, keys: JobKeys, timeout: float, done: Any) -> dict[str, Any] | None:
    """Poll until the job's result, or done() says the request was carried out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = _result(client, keys)
        if res is not None:
            return res
        if done():
            return None
        time.sleep(0.2)
    raise ConfigError(f"no outcome within {timeout:.0f}s (see `livemig status --job {keys.job}`)")


def _connect(a: argparse.Namespace) -> tuple[EtcdClient, JobKeys]:
    from livemig.agent.jobs import connect, require_live_job

    job = validate_job_name(a.job)
    client = connect(job, a.etcd, timedelta(seconds=a.etcd_timeout))
    try:
        require_live_job(client, job)
    except BaseException:
        client.close()
        raise
    return client, JobKeys(job)


def _stopped_line(res: dict[str, Any]) -> str:
    return (f"the job stopped at the checkpoint of step {res.get('step')}: run it again with the same "
            "--checkpoint-dir to resume there")  # fmt: skip


def cmd_stop(a: argparse.Namespace) -> int:
    client, keys = _connect(a)
    try:
        if not request_stop(client, keys, a.reason):
            print("livemig: a stop of this job was asked already: waiting for it", flush=True)
        else:
            print(f"stop of job {keys.job} requested: a checkpoint at its next step, then exit", flush=True)
        if a.wait <= 0:
            return 0
        res = _wait(client, keys, a.wait, lambda: False) or {}
    finally:
        client.close()
    if res.get("state") == "stopped":
        print(_stopped_line(res), flush=True)
        return 0
    print(f"livemig: the job ended {res.get('state')}: {res.get('reason') or 'no checkpoint of a stop'}", flush=True)
    return 1


def cmd_drain(a: argparse.Namespace) -> int:
    if a.node < 0:
        raise ConfigError("--node must be >= 0")
    client, keys = _connect(a)
    try:
        if client.get(keys.node(a.node)) is None:
            raise ConfigError(f"node {a.node} of job {keys.job} has no agent running (livemig status lists the nodes)")
        request_drain(client, keys, a.node, a.reason)
        print(f"drain of node {a.node} requested", flush=True)
        if a.wait <= 0:
            return 0
        res = _wait(client, keys, a.wait, lambda: client.get(keys.node(a.node)) is None)
    finally:
        client.close()
    if res is None:
        print(f"node {a.node} drained: its agent left, the job trains on", flush=True)
        return 0
    if res.get("state") == "stopped":
        print(_stopped_line(res), flush=True)
        return 0
    print(f"livemig: the job ended {res.get('state')} before node {a.node} drained: {res.get('reason', '')}",
          flush=True)  # fmt: skip
    return 1
