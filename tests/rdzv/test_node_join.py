"""An agent's entry into a run (livemig/agent/nodes.py) on a real etcd, where a replacement
node arrives late: a run that already trains does not wait for a node it lost, and an agent
waiting for its other nodes stops waiting once the run has ended (a replacement pod starting
as the job finishes must not sit out the join timeout and then fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from livemig.agent.nodes import RunEnded, attach_node, join_run, script_signature, wait_nodes
from livemig.config import Timeouts
from livemig.rdzv.client import EtcdClient
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Member, Membership
from livemig.rdzv.writes import put_if_absent

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(job: str, node_rank: int, nnodes: int = 2) -> SimpleNamespace:
    return SimpleNamespace(job=job, nnodes=nnodes, nproc_per_node=1, script="train.py", args=["--steps", "60"],
                           node_rank=node_rank, metrics_port=None, checkpoint=None, join_timeout=30.0,
                           timeouts=Timeouts(), launch_id="")  # fmt: skip


def _run_with_node_0(client: EtcdClient, keys: JobKeys, cfg: SimpleNamespace) -> str:
    """A run created by node 0's agent (its key under a lease of its own)."""
    sig = script_signature(cfg.script, cfg.args)
    run_id, k = join_run(client, keys, cfg.nnodes, 1, sig, 0, {"host": "a"}, client.grant(30))
    assert k == 0
    return run_id


def test_a_node_joining_a_run_that_trains_does_not_wait_for_a_node_it_lost(etcd):
    """Three nodes; node 2 was lost (its ranks run on spares), node 1's agent drained away; the
    replacement for node 1 joins at once (it waited for node 2 up to the join timeout)."""
    client = EtcdClient(etcd.endpoints)
    keys = JobKeys("join-formed")
    cfg = _cfg(keys.job, 1, nnodes=3)
    run_id = _run_with_node_0(client, keys, cfg)
    head = Membership(state=GenState.COMMITTED.value, generation=3, world_size=3, members={0: Member(0, "w0")})
    client.put(keys.membership, head.to_bytes())
    t0 = time.monotonic()
    keeper, got_run, rank = attach_node(client, keys, cfg, "b", lambda: set(), lambda _m: None)
    try:
        assert (got_run, rank) == (run_id, 1)
        assert time.monotonic() - t0 < 10, "waited for a node the formed run lost"
    finally:
        keeper.stop()


def test_waiting_for_the_other_nodes_ends_when_the_run_ends(etcd):
    client = EtcdClient(etcd.endpoints)
    keys = JobKeys("join-ended")
    cfg = _cfg(keys.job, 0)
    run_id = _run_with_node_0(client, keys, cfg)
    timer = threading.Timer(0.5, lambda: put_if_absent(client, keys.result, {"state": "done"}))
    timer.start()
    t0 = time.monotonic()
    try:
        assert wait_nodes(client, keys, 2, run_id, 30.0) == {}
        assert time.monotonic() - t0 < 10, "waited past the run's end"
    finally:
        timer.cancel()
    # without an end the wait still names the missing node rank, within its timeout
    keys2 = JobKeys("join-missing")
    run2 = _run_with_node_0(client, keys2, _cfg(keys2.job, 0))
    try:
        wait_nodes(client, keys2, 2, run2, 0.5)
    except Exception as exc:  # noqa: BLE001 - the one line is what is asserted
        assert "node rank(s) [1] did not join" in str(exc), exc
    else:
        raise AssertionError("wait_nodes returned without node 1")


def test_an_agent_of_the_launch_whose_run_finished_ends_with_it_and_others_start_a_new_run(etcd):
    """--launch-id: the late agent of the launch (a replacement pod as the Job completes) learns
    the run finished; an agent of another launch, or of none, or after a run that stopped at a
    checkpoint (the launch's new pods resume it), starts a new run."""
    client = EtcdClient(etcd.endpoints)
    sig = script_signature("train.py", ["--steps", "60"])

    def ended(job: str, launch: str, state: str) -> tuple[JobKeys, str]:
        keys = JobKeys(job)
        lease = client.grant(30)
        run_id, _ = join_run(client, keys, 2, 1, sig, 0, {"host": "a"}, lease, launch=launch)
        join_run(client, keys, 2, 1, sig, 1, {"host": "b"}, lease, launch=launch)
        put_if_absent(client, keys.result, {"state": state})
        client.revoke(lease)  # both agents exited with the run
        return keys, run_id

    keys, run_id = ended("late-done", "uid-1", "done")
    with pytest.raises(RunEnded) as got:
        join_run(client, keys, 2, 1, sig, 1, {"host": "c"}, client.grant(30), launch="uid-1")
    assert got.value.run_id == run_id and client.get(keys.result) is not None  # nothing removed
    for launch in ("uid-2", ""):
        new, _ = join_run(client, keys, 2, 1, sig, 1, {"host": "c"}, client.grant(30), launch=launch)
        assert new != run_id and client.get(keys.result) is None
        put_if_absent(client, keys.result, {"state": "done"})
    keys, run_id = ended("late-stopped", "uid-3", "stopped")
    new, _ = join_run(client, keys, 2, 1, sig, 1, {"host": "c"}, client.grant(30), launch="uid-3")
    assert new != run_id


def test_livemig_run_of_the_launch_arriving_after_its_run_finished_exits_0_at_once(etcd, tmp_path):
    """The same through `livemig run`: the late agent starts nothing (no worker, no spare, no
    coordinator), says why in one line, and exits 0 with the run's result."""
    client = EtcdClient(etcd.endpoints)
    keys = JobKeys("late-cli")
    script = os.path.join(REPO, "examples", "stateful.py")
    sig = script_signature(script, ["--steps", "60"])
    lease = client.grant(30)
    run_id, _ = join_run(client, keys, 2, 1, sig, 0, {"host": "a"}, lease, launch="uid-9")
    put_if_absent(client, keys.result, {"state": "done"})
    client.revoke(lease)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "livemig.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
                        "--node-rank", "1", "--etcd", etcd.endpoints, "--job", keys.job, "--launch-id", "uid-9",
                        "--report", str(tmp_path / "r.json"), script, "--steps", "60"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LIVEMIG_JOIN_TIMEOUT": "30"})  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"run {run_id} ended (done) before node 1 joined it: nothing to start" in out, out[-3000:]
    assert time.monotonic() - t0 < 25, out[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["result"]["state"] == "done" and rep["processes"] == [], rep
