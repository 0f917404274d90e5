"""Many nodes: per-node agents (`livemig run --nnodes`), spares on a standby host
(`livemig-spare start --count`), a whole node lost. Hosts are simulated with network
namespaces on a Linux bridge (livemig/netns.py Hosts): real addresses, real sockets,
real gloo, one kernel. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.keys import JobKeys
from tests.e2e.conftest import REPO, livemig_run
from tests.e2e.test_exact_state import STATEFUL

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                 reason="needs root and iproute2 (network namespaces)")  # fmt: skip
STEPS = 60
WORK = [STATEFUL, "--steps", str(STEPS)]
SLEEP = {"STATEFUL_STEP_SLEEP": "0.1"}


def _env(tmp_path, name: str) -> dict[str, str]:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    return dict(os.environ, LIVEMIG_STATE_DIR=str(d), PYTHONPATH=REPO, LIVEMIG_RECOVERY_TIMEOUT="60", **SLEEP)


def _start_etcd(procs, argv_prefix: list[str], addr: str | None) -> str:
    p = procs.spawn([*argv_prefix, sys.executable, os.path.join(REPO, "tests", "helpers", "etcd_proc.py"),
                     *([addr] if addr else [])], stdout=subprocess.PIPE)  # fmt: skip
    url = p.stdout.readline().decode().strip()
    assert url.startswith("http://"), url
    return url


def _agent(procs, argv_prefix, etcd, job, tmp_path, name, *extra: str, report=None,
           quiet: bool = False) -> subprocess.Popen:  # fmt: skip
    cmd = [*argv_prefix, sys.executable, "-m", "livemig.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
           "--etcd", etcd, "--job", job, "--lease-ttl", "2", *extra]  # fmt: skip
    if report:
        cmd += ["--report", str(report)]
    if quiet:
        with open(tmp_path / f"{name}.out", "wb") as f:
            return procs.spawn([*cmd, *WORK], env=_env(tmp_path, name), stdout=f, stderr=subprocess.STDOUT)
    return procs.spawn([*cmd, *WORK], env=_env(tmp_path, name))


@pytest.fixture
def hosts():
    from livemig.netns import Hosts

    with Hosts(4) as h:
        yield h


@needs_netns
def test_a_whole_node_lost_is_replaced_from_a_standby_host_exactly(tmp_path, procs, hosts):
    """etcd on host 0, one rank on each of hosts 1 and 2, two spares on standby host 3:
    every process of host 2 (agent, worker, coordinator candidate) SIGKILLed at step 10."""
    ref = livemig_run(tmp_path, 2, job="ref", script=STATEFUL, workload=WORK[1:], env=SLEEP)
    assert ref.rc == 0, ref.stderr
    etcd = _start_etcd(procs, hosts.wrap(0, []), hosts.addrs[0])
    job = "nodes"
    a1 = _agent(procs, hosts.wrap(1, []), etcd, job, tmp_path, "h1", "--host", hosts.addrs[1],
                report=tmp_path / "r1.json")  # fmt: skip
    _agent(procs, hosts.wrap(2, []), etcd, job, tmp_path, "h2", "--host", hosts.addrs[2], quiet=True)
    spares = procs.spawn(hosts.wrap(3, [sys.executable, "-m", "livemig.spare_pool.cli", "start", "--etcd", etcd,
                                        "--job", job, "--count", "2", "--host", hosts.addrs[3], "--world-size",
                                        "2", *WORK]),
                         env=_env(tmp_path, "h3"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    client = EtcdClient(etcd)
    keys = JobKeys(job)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        kv = client.get(keys.progress(0))
        warm = [k for k in client.get_prefix(keys.spares_prefix)[0] if (decode(k.value) or {}).get("state") == "warm"]
        if kv is not None and decode(kv.value)["step"] >= 10 and len(warm) == 2:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the job never reached step 10 with two warm spares")
    m = decode(client.get(keys.membership).value)
    hosts_of = {int(r): mem["host"] for r, mem in m["members"].items()}
    assert hosts_of == {0: hosts.addrs[1], 1: hosts.addrs[2]}, hosts_of  # ranks advertise --host
    killed = hosts.kill_all(2)
    assert len(killed) >= 3, (killed, (tmp_path / "h2.out").read_text()[-3000:])  # agent, worker, coordinator
    out, err = a1.communicate(timeout=180)
    assert a1.returncode == 0, out.decode()[-2000:] + err.decode()[-2000:]
    rep = json.loads((tmp_path / "r1.json").read_text())
    assert rep["steps_completed"] == STEPS and rep["replicas_identical"]
    assert rep["rank_digests"] == ref.report["rank_digests"], "not bit-identical to the fault-free run"
    (rec,) = rep["recoveries"]
    assert rec["rank"] == 1
    member = rep["members"]["1"]
    assert member["role"] == "spare"  # rank 1 now runs on the standby host
    m = decode(client.get(keys.membership).value)
    assert m["members"][1]["host"] == hosts.addrs[3] and m["members"][1]["role"] == "spare", m["members"]
    spares.wait(timeout=30)


def test_agents_that_do_not_fit_the_run_are_refused(tmp_path, procs):
    """A second agent with a taken node rank, and one with another --nproc-per-node, are
    refused with one line; the agent of the missing node rank then completes the job."""
    etcd = _start_etcd(procs, [], None)
    job = "fit"
    a0 = _agent(procs, [], etcd, job, tmp_path, "a0", "--node-rank", "0", "--host", "127.0.0.1")
    client = EtcdClient(etcd)
    deadline = time.monotonic() + 30
    while client.get(JobKeys(job).node(0)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    taken = _agent(procs, [], etcd, job, tmp_path, "a1", "--node-rank", "0", "--host", "127.0.0.1")
    _, err = taken.communicate(timeout=60)
    assert taken.returncode == 2 and "node rank 0 of job 'fit' is taken" in err.decode(), err.decode()
    other = procs.spawn([sys.executable, "-m", "livemig.cli", "run", "--nnodes", "2", "--nproc-per-node", "2",
                         "--etcd", etcd, "--job", job, *WORK], env=_env(tmp_path, "a2"),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    _, err = other.communicate(timeout=60)
    assert other.returncode == 2 and "nproc_per_node=1, this agent has 2" in err.decode(), err.decode()
    a1 = _agent(procs, [], etcd, job, tmp_path, "a3", "--node-rank", "auto", "--host", "127.0.0.1")
    for a in (a0, a1):
        out, err = a.communicate(timeout=120)
        assert a.returncode == 0, out.decode()[-1500:] + err.decode()[-1500:]
