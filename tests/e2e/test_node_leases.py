"""--node-leases (issue 54, item 3): a node's workers register under their agent's lease, one
keep-alive per node at etcd's leader instead of one per rank. What the per-process lease did
must still happen: a killed worker and a stopped (hung) one are replaced, exactly; an etcd
outage that outlives the lease is ridden through (the agent's new lease reaches the workers,
who put their keys again), and a worker killed during it is recovered once etcd is back."""

from __future__ import annotations

import threading
import time

from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.keys import JobKeys
from tests.e2e.conftest import STATEFUL, explain, livemig_run, rank_files
from tests.e2e.test_exact_state import assert_rank_by_rank
from tests.e2e.test_outage import OUTAGE, TTL, assert_same_state, outage_run
from tests.e2e.test_outage import STEPS as OUTAGE_STEPS
from tests.e2e.test_outage import reference as reference  # noqa: F401 - the outage workload's fault-free run

NODE_LEASES = {"LIVEMIG_NODE_LEASES": "1"}
STEPS = 40


def _shared_lease(client: EtcdClient, keys: JobKeys, ranks: int, timeout: float = 120) -> tuple[int, dict]:
    """Once every rank registered: the node key's lease and each member key's lease."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node = client.get(keys.node(0))
        got = {r: client.get(keys.member(r)) for r in range(ranks)}
        if node is not None and all(kv is not None for kv in got.values()):
            return node.lease, {r: (kv.lease, (decode(kv.value) or {}).get("lease")) for r, kv in got.items()}
        time.sleep(0.05)
    raise AssertionError("the ranks never registered")


def test_workers_under_the_node_lease_are_replaced_exactly_after_a_kill_and_a_hang(tmp_path, etcd, stateful_reference):
    """One job, two faults: rank 1 killed at step 8, rank 0 stopped (SIGSTOP) at step 20 for
    5 s. Both ranks' keys are held by the agent's node lease (no lease of their own); the
    kill is seen from the agent's report, the stop by the agent (the worker stopped for a
    TTL: its key deleted, as its own lease's expiry did); both replaced by warm spares, rank
    by rank bit-identical to the fault-free run."""
    ref = stateful_reference(2, (), STEPS)
    dump = tmp_path / "dump"
    dump.mkdir()
    keys = JobKeys("nl")
    client = EtcdClient(etcd.endpoints)
    box: dict = {}
    env = {**NODE_LEASES, "STATEFUL_DUMP": str(dump), "STATEFUL_STEP_SLEEP": "0.05"}
    job = threading.Thread(target=lambda: box.setdefault("run", livemig_run(
        tmp_path, 2, spares=2, faults=("kill:rank=1:step=8", "hang:rank=0:step=20:resume=5"), extra=("--etcd",
        etcd.endpoints), env=env, job="nl", script=STATEFUL, workload=["--steps", str(STEPS)])))  # fmt: skip
    job.start()
    try:
        node_lease, members = _shared_lease(client, keys, 2)
    finally:
        job.join(300)
    run = box["run"]
    assert members == {0: (node_lease, "node"), 1: (node_lease, "node")}, (node_lease, members, explain(run))
    assert_rank_by_rank(run, rank_files(dump), ref)
    assert [r["rank"] for r in run.report["recoveries"]] == [1, 0], explain(run)
    hang = run.report["recoveries"][1]
    assert hang["phases"]["detect"] < TTL + 2, hang  # stopped for a TTL, then its key went
    codes = {p["name"]: p["exit_code"] for p in run.report["processes"]}
    assert codes["worker-0"] == 3, codes  # resumed, it found itself fenced and stopped


def test_an_etcd_outage_longer_than_the_node_lease_is_ridden_through_and_a_kill_in_it_recovered(tmp_path, reference):  # noqa: F811
    """etcd stopped for 3 x the TTL: the node lease expires under it; the agent takes a new
    one once etcd answers, and the workers put their keys under it again (no rank fenced for
    the outage); rank 1 killed during the outage is recovered once etcd is back, exactly."""
    run, ranks = outage_run(tmp_path, (OUTAGE, "kill:rank=1:step=7:after=2"), env=NODE_LEASES)
    assert_same_state(run, ranks, reference)
    assert run.report["steps_completed"] == OUTAGE_STEPS
    (outage,) = run.report["etcd_outages"]
    assert outage["seconds"] >= 3 * TTL
    (rec,) = run.report["recoveries"]
    assert rec["rank"] == 1, explain(run)
    codes = {p["name"]: p["exit_code"] for p in run.report["processes"]}
    assert codes["worker-0"] == 0, codes  # re-registered under the new lease, never fenced
    logs = {p["name"]: open(p["log"]).read() for p in run.report["processes"] if p["name"] == "worker-0"}
    assert "re-registered under the node's new lease" in logs["worker-0"], logs["worker-0"][-3000:]
