"""Requests to a running job that more than one piece writes: `livemig migrate` and a
fault plan's migrate (the agent's fault driver) ask for a planned migration with the same
one-key write, which lives here, below both (the coordinator's straggler hook writes the
same record under its leader guard)."""

from __future__ import annotations

import secrets
import time

from livemig.errors import ConfigError
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.keys import JobKeys


def request_migration(client: EtcdClient, keys: JobKeys, rank: int, reason: str = "") -> str:
    """Ask for rank's migration; refused while another request waits. Returns the request id."""
    rid = secrets.token_hex(4)
    t = client.txn_ops
    req = {"id": rid, "rank": rank, "time": time.time(), "reason": reason}
    ok, _ = client.txn([t.version(keys.migrate_request) == 0], [t.put(keys.migrate_request, encode(req))])
    if not ok:
        raise ConfigError("another migration request is waiting: retry once it is done")
    return rid


def request_stop(client: EtcdClient, keys: JobKeys, reason: str, node: int | None = None) -> bool:
    """Ask the whole job to stop at a checkpoint of its next step (runtime/stop.py); False if
    a stop was asked already (the first reason stands)."""
    from livemig.rdzv.writes import put_if_absent

    return put_if_absent(client, keys.stop, {"reason": reason, "node": node, "time": time.time()})


def request_drain(client: EtcdClient, keys: JobKeys, node: int, reason: str) -> None:
    """Ask node `node`'s agent to drain as on SIGTERM (agent/drain.py, `livemig drain`)."""
    client.put(keys.drain_request(node), encode({"reason": reason, "time": time.time()}))
