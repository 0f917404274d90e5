"""`livemig migrate --job J --rank R`: move a healthy worker onto a warm spare
while training continues (a straggler, a node going to maintenance).

The request is one etcd key; the leader coordinator claims a spare, the
spare catches up from the leaving worker, the members agree on the switch
step inside a training collective, and the leaving worker exits 0. The
command waits for the outcome (done, rejected, aborted) and prints it.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

from livemig.config import validate_job_name
from livemig.errors import ConfigError
from livemig.rdzv.client import EtcdClient, conform, decode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.requests import request_migration
from livemig.rdzv.security import add_arguments as add_security_arguments


def wait_result(client: EtcdClient, keys: JobKeys, rid: str, timeout: float) -> dict[str, Any]:
    """The request's outcome; a job that ends first answers too (its request then goes, so
    no phantom job stays behind in `livemig status`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = client.get(keys.migrate_result)
        if kv is not None:
            res = decode(kv.value)
            if res.get("id") == rid:
                return res
        ended = client.get(keys.result)
        if ended is not None:
            state = (conform(ended.value, {"state": (str,)}) or {}).get("state", "ended")
            req = client.get(keys.migrate_request)
            if req is not None and (decode(req.value) or {}).get("id") == rid:
                client.delete(keys.migrate_request)
            return {"state": "not done", "reason": f"the job ended ({state}) before the migration ran"}
        time.sleep(0.1)
    raise ConfigError(f"no outcome within {timeout:.0f}s (the request stays queued; see `livemig status`)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="move a healthy worker onto a warm spare while training continues")
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--reason", default="requested by an operator")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the outcome (default 300; 0: don't)")
    p.add_argument("--etcd")
    p.add_argument("--etcd-timeout", type=float, default=5.0)
    add_security_arguments(p)
    p.set_defaults(fn=cmd_migrate)


def cmd_migrate(a: argparse.Namespace) -> int:
    from livemig.agent.jobs import connect, require_live_job

    job = validate_job_name(a.job)
    if a.rank < 0:
        raise ConfigError("--rank must be >= 0")
    client = connect(job, a.etcd, timedelta(seconds=a.etcd_timeout))
    keys = JobKeys(job)
    try:
        require_live_job(client, job)  # else the request key would outlive the wait, a phantom job
        rid = request_migration(client, keys, a.rank, a.reason)
        print(f"migration of rank {a.rank} requested (id {rid})", flush=True)
        spares = [conform(kv.value, {"state": (str,)}) or {} for kv in client.get_prefix(keys.spares_prefix)[0]]
        if not any(x.get("state") == "warm" for x in spares):
            print(f"livemig: no spare of job {job} is warm yet: the migration starts once one is "
                  "(livemig-spare start; LIVEMIG_SPARE_WAIT bounds the wait)", flush=True)  # fmt: skip
        if a.wait <= 0:
            return 0
        res = wait_result(client, keys, rid, a.wait)
    finally:
        client.close()
    if res["state"] == "done":
        print(f"rank {a.rank} now runs on spare {res.get('spare')} (generation {res.get('generation')}, "
              f"switched after step {res.get('switch_step')})")  # fmt: skip
        return 0
    print(f"livemig: migration {res['state']}: {res.get('reason', '')}")
    return 4
