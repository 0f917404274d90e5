"""Runs and nodes: how the agents of one job (`livemig run` on each worker node)
find each other without destroying anything a live run holds.

- `run` names the current run: a run id, nnodes, nproc_per_node and the script
  signature. The first agent creates it with a create-if-absent CAS, in the same
  transaction as its own node key; later agents of the same run join it. A run is
  live while it has no result and at least one agent holds a node key (they are
  leased): a job name whose last run ended (done, failed, or every agent gone) may
  start a new run, and the old run's keys are removed in that same transaction,
  here and nowhere else.
- `nodes/<k>` is held by the agent of node rank k under its lease; `auto` takes
  the first free k (a CAS each), a given k that is taken is refused, unless the
  run already trains: an agent joining a formed run (a replacement pod, a node
  restarted) brings spares for its node's ranks instead of workers (with the key
  if it is free, without it if the old agent still holds it).
- An agent joining a live run with another nnodes, nproc_per_node or script is
  refused with one line, before it starts anything.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from livemig.config import ENV_HOST
from livemig.errors import ConfigError, EtcdUnavailableError
from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.writes import Put, delete_prefix_if, put_if_absent

log = logging.getLogger("livemig.agent.nodes")


def default_host(etcd: str) -> str:
    """--host's default: $LIVEMIG_HOST, else the local address of the route to the first
    etcd endpoint (the address other hosts reach us at), 127.0.0.1 when etcd is local."""
    if os.environ.get(ENV_HOST):
        return os.environ[ENV_HOST]
    first = etcd.split(",")[0].strip()
    host = urlsplit(first if "://" in first else f"http://{first}").hostname or "127.0.0.1"
    try:
        addr = socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(f"cannot resolve etcd host {host!r} ({exc}): pass --host ADDR") from None
    if addr.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError as exc:
            raise ConfigError(f"no route to etcd at {addr} ({exc}): pass --host ADDR") from None


def script_signature(script: str, args: list[str]) -> str:
    """What every agent of one run must agree on: the script's file name and its arguments."""
    return " ".join([os.path.basename(script), *args])


def _run_live(client: EtcdClient, keys: JobKeys) -> bool:
    if client.get(keys.result) is not None:
        return False
    kvs, _ = client.get_prefix(keys.nodes_prefix)
    return bool(kvs)


def formed(client: EtcdClient, keys: JobKeys) -> bool:
    """Whether the job's run already formed: it trains or recovers (not before, not ended)."""
    from livemig.rdzv.membership import Membership

    raw = client.get(keys.membership)
    return Membership.from_bytes(raw.value if raw else None).trains


class RunEnded(Exception):
    """The run this agent's launch started finished (done) before the agent joined it."""

    def __init__(self, run_id: str, launch: str) -> None:
        super().__init__(f"run {run_id} of launch {launch} finished")
        self.run_id = run_id


def join_run(client: EtcdClient, keys: JobKeys, nnodes: int, nproc_per_node: int, signature: str,
             node_rank: int | None, node_info: dict[str, Any], lease: int,
             fresh: bool = False, metrics: bool = False,
             checkpoint: dict[str, str] | None = None, launch: str = "") -> tuple[str, int]:  # fmt: skip
    """Create or join the job's run and take a node rank: (run id, node rank). fresh: the
    agent's own new etcd, where the job's processes may already be writing: nothing stale
    to remove (removing it would take their election and secret away). metrics: the run
    record says the job's metrics are on, so that `livemig-spare start` turns them on in
    its spares too (a claimed spare is a member); checkpoint: the run's checkpoint settings
    (as environment), which such spares write their parts with once they take a rank.
    launch: --launch-id, kept in the run record; an agent of the same launch finding that run
    finished (a Kubernetes replacement pod starting as the job ends) raises RunEnded instead
    of starting a new run nobody else joins. A stopped or failed run is not finished: the
    launch's new pods (a job stopped at a checkpoint, a Job's retries) start a new run."""
    want = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "signature": signature}
    for _ in range(20):  # a few rounds of lost races, never more
        kv = client.get(keys.run)
        run = (decode(kv.value) or {}) if kv is not None else {}
        if launch and run.get("launch") == launch:
            res = client.get(keys.result)
            if res is not None and (decode(res.value) or {}).get("state") == "done":
                raise RunEnded(run.get("run_id", "?"), launch)
        if kv is None or not _run_live(client, keys):
            # Remove what an ended run (or a run that never formed) left, then create ours:
            # two transactions (etcd refuses a put inside a range deleted by the same txn).
            if not fresh:
                delete_prefix_if(client, keys.prefix, keys.run, kv)
            run_id = uuid.uuid4().hex[:12]
            k = 0 if node_rank is None else node_rank
            rec = {"run_id": run_id, **want, "created": time.time(), **({"metrics": True} if metrics else {}),
                   **({"checkpoint": checkpoint} if checkpoint else {}),
                   **({"launch": launch} if launch else {})}  # fmt: skip
            if put_if_absent(client, keys.run, rec, also=[Put(keys.node(k), {**node_info, "run_id": run_id}, lease)]):
                log.info("run created", extra={"run": run_id, "node_rank": k})
                return run_id, k
            continue
        for field, value in want.items():
            if run.get(field) != value:
                raise ConfigError(
                    f"job {keys.job!r} is running with {field}={run.get(field)!r}, this agent has {value!r}: "
                    "start every agent of a job with the same --nnodes, --nproc-per-node and script"
                )
        run_id = run["run_id"]
        ranks = [node_rank] if node_rank is not None else list(range(nnodes))
        for k in ranks:
            if put_if_absent(client, keys.node(k), {**node_info, "run_id": run_id}, lease, unchanged=kv):
                log.info("joined run", extra={"run": run_id, "node_rank": k})
                return run_id, k
        if node_rank is not None:
            held = client.get(keys.node(node_rank))
            who = decode(held.value) if held else {}
            if held is not None and formed(client, keys):
                # the run trains and this node rank's agent still holds it (a replacement pod started
                # before the lost one's lease ended): join without the key, as standby capacity
                log.info("node rank held in a formed run: joining as standby", extra={"node_rank": node_rank})
                return run_id, node_rank
            if held is not None:
                raise ConfigError(
                    f"node rank {node_rank} of job {keys.job!r} is taken by the agent on {who.get('host', '?')} "
                    f"(pid {who.get('pid', '?')}): pass another --node-rank, or --node-rank auto"
                )
        elif all(client.get(keys.node(k)) is not None for k in range(nnodes)):
            raise ConfigError(f"job {keys.job!r} already has its {nnodes} nodes: this agent is one too many")
    raise ConfigError(f"could not join job {keys.job!r}: the run changed under us 20 times; try again")


def wait_nodes(client: EtcdClient, keys: JobKeys, nnodes: int, run_id: str, timeout: float) -> dict[int, dict]:
    """Block until every node rank of the run is held, or the run ended (its result written:
    the caller reads it, nothing is left to wait for); one line naming the missing ones."""
    deadline = time.monotonic() + timeout
    while True:
        if client.get(keys.result) is not None:
            return {}
        kvs, _ = client.get_prefix(keys.nodes_prefix)
        nodes = {}
        for kv in kvs:
            rest = kv.key[len(keys.nodes_prefix) :]
            info = decode(kv.value) or {}
            if rest.isdigit() and info.get("run_id") == run_id:
                nodes[int(rest)] = info
        missing = [k for k in range(nnodes) if k not in nodes]
        if not missing:
            return nodes
        if time.monotonic() > deadline:
            raise ConfigError(
                f"job {keys.job!r}: node rank(s) {missing} did not join within {timeout:.0f}s: start "
                f"`livemig run --nnodes {nnodes} ... --job {keys.job}` on those nodes (LIVEMIG_JOIN_TIMEOUT)"
            )
        time.sleep(0.1)


def attach_node(client: EtcdClient, keys: JobKeys, cfg: Any, host: str, incarnations: Callable[[], set[str]],
                say: Callable[[str], None], fresh: bool = False,
                on_reattach: Callable[[int], None] | None = None) -> tuple[Any, str, int]:  # fmt: skip
    """An agent's entry into its job: wait for etcd (up to cfg.join_timeout), create or join
    the run, take a node rank, wait for every node. The node key lives under the agent's
    lease: its loss is the node's. Returns (the lease keeper, run id, node rank).
    incarnations: this agent's processes, which decide whether a re-attach is due;
    on_reattach: told the new lease after one (--node-leases: the workers' keys follow it)."""
    from livemig.rdzv.lease import LeaseKeeper
    from livemig.rdzv.membership import Rendezvous, new_incarnation

    info = {"host": host, "pid": os.getpid(), "agent": new_incarnation("agent")}
    box: dict[str, Any] = {}

    def reattach(lease: int) -> None:  # after an etcd outage or a healed cut: the node key, a new lease
        """Only while the node still holds ranks: a node whose ranks were replaced while it was
        cut off stays gone (its processes learn they are fenced and stop), and only where the
        key is absent (a CAS: never over another agent's)."""
        m = Rendezvous(client, keys.job).read()
        mine = incarnations()
        if m.members and not any(mem.incarnation in mine for mem in m.members.values()):
            log.warning("this node's ranks were replaced while it was away; not re-attaching its node key",
                        extra={"node_rank": box["rank"]})  # fmt: skip
            return
        put_if_absent(client, keys.node(box["rank"]), {**info, "run_id": box["run"]}, lease)
        if on_reattach is not None:
            on_reattach(lease)

    # etcd may come up with the agents (a batch script, a pod): wait for it up to the join timeout
    deadline = time.monotonic() + cfg.join_timeout
    announced = False
    while True:
        try:
            client.get(keys.run)
            break
        except EtcdUnavailableError:
            if time.monotonic() > deadline:
                raise ConfigError(f"etcd at {client.describe()} did not answer within {cfg.join_timeout:.0f} s: "
                                  "is it running, and is --etcd its client URL?") from None  # fmt: skip
            if not announced:  # once: the wait is expected where etcd comes up with the agents
                say(f"livemig: etcd at {client.describe()} does not answer yet; waiting up to "
                    f"{cfg.join_timeout:.0f} s (LIVEMIG_JOIN_TIMEOUT)")  # fmt: skip
                announced = True
            time.sleep(0.5)
    keeper = LeaseKeeper(client, cfg.timeouts.lease_ttl_s, name="node",
                         outage_budget_s=cfg.timeouts.etcd_outage.total_seconds(), reattach=reattach)  # fmt: skip
    try:
        box["run"], box["rank"] = join_run(client, keys, cfg.nnodes, cfg.nproc_per_node,
                                           script_signature(cfg.script, cfg.args), cfg.node_rank, info,
                                           keeper.lease_id, fresh, cfg.metrics_port is not None,
                                           cfg.checkpoint.to_env() if cfg.checkpoint is not None else None,
                                           cfg.launch_id)  # fmt: skip
    except BaseException:
        keeper.stop(revoke=True)
        raise
    # A run that already trains does not wait for every node: a node it lost runs on spares
    # now, and one whose agent ended with the run never comes back (a replacement pod
    # starting as the job finishes would wait out the join timeout for it, then fail).
    if cfg.nnodes > 1 and not formed(client, keys):
        say(f"livemig: job {cfg.job}: node {box['rank']} of {cfg.nnodes} joined run {box['run']}; "
            "waiting for the other nodes")  # fmt: skip
        wait_nodes(client, keys, cfg.nnodes, box["run"], cfg.join_timeout)
    return keeper, box["run"], box["rank"]
