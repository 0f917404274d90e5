"""Many nodes: per-node agents (`livemig run --nnodes`), spares on a standby host
(`livemig-spare start --count`), a whole node lost. Hosts are simulated with network
namespaces on a Linux bridge (livemig/agent/netns.py Hosts): real addresses, real sockets,
real gloo, one kernel. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from livemig.errors import EtcdUnavailableError
from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import Rendezvous
from tests.e2e.conftest import REPO, reference_of
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
           quiet: bool = False, work: list[str] = WORK, hold: bool = False) -> subprocess.Popen:  # fmt: skip
    """`livemig run` as one node's agent. hold: its ranks wait at step 12 until
    _until_step_10_with_warm_spares saw the spares warm (a loaded machine warms them slower
    than the 60 steps take)."""
    env = _env(tmp_path, name)
    if hold:
        (tmp_path / "hold").touch()
        env["STATEFUL_HOLD"] = str(tmp_path / "hold")
    per = [] if "--nproc-per-node" in extra else ["--nproc-per-node", "1"]
    cmd = [*argv_prefix, sys.executable, "-m", "livemig.cli", "run", "--nnodes", "2", *per,
           "--etcd", etcd, "--job", job, "--lease-ttl", "2", *extra]  # fmt: skip
    if report:
        cmd += ["--report", str(report)]
    if quiet:
        with open(tmp_path / f"{name}.out", "wb") as f:
            return procs.spawn([*cmd, *work], env=env, stdout=f, stderr=subprocess.STDOUT)
    return procs.spawn([*cmd, *work], env=env)


def _standby(procs, hosts, etcd: str, job: str, tmp_path, count: int, work: list[str]) -> subprocess.Popen:
    """`count` spares on standby host 3 (their daemon's output in spares.out)."""
    with open(tmp_path / "spares.out", "wb") as out:  # the child keeps its own copy of the descriptor
        return procs.spawn(hosts.wrap(3, [sys.executable, "-m", "livemig.spare_pool.cli", "start", "--etcd", etcd,
                                          "--job", job, "--count", str(count), "--host", hosts.addrs[3], *work]),
                           env=_env(tmp_path, "h3"), stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def _until_step_10_with_warm_spares(client: EtcdClient, keys: JobKeys, count: int, step: int = 10,
                                    outs=None, release: bool = True) -> float:  # fmt: skip
    """Wait until rank 0 committed step `step`, `count` spares are warm and a leader leads;
    returns the test's deadline for what follows. Agents started with hold wait at step 12
    until the spares are warm and a leader leads (outs/hold removed then, unless not release:
    the test removes it once what it does to the job is under way). On failure it says
    which of the three was missing and the tails of the outputs in outs, so a CI failure
    explains itself."""
    deadline = time.monotonic() + 150
    seen: dict = {}
    while time.monotonic() < deadline:
        try:
            kv = client.get(keys.progress(0))
            spares = {k.key: (decode(k.value) or {}).get("state") for k in client.get_prefix(keys.spares_prefix)[0]}
            leader = client.get(keys.leader)
        except EtcdUnavailableError as e:  # an etcd member still joining its cluster: try again
            seen["etcd"] = repr(e)[:200]
            time.sleep(0.2)
            continue
        seen = {"step": kv and decode(kv.value)["step"], "spares": spares, "leader": leader and leader.value.decode()}
        ready = len([s for s in spares.values() if s == "warm"]) == count and leader is not None
        if ready and outs is not None and release:
            (outs / "hold").unlink(missing_ok=True)
        if ready and kv is not None and seen["step"] >= step:
            return deadline
        time.sleep(0.05)
    tails = ""
    for f in sorted(outs.glob("*.out")) if outs is not None else ():
        tails += f"\n--- {f.name}\n" + f.read_text(errors="replace")[-1500:]
    pytest.fail(f"the job never reached step {step} with {count} spares warm and a leader: last seen {seen}{tails}")


@pytest.fixture
def hosts():
    from livemig.agent.netns import Hosts

    with Hosts(4) as h:
        yield h


def _node_loss(tmp_path, procs, hosts, references, per_node: int, args: tuple[str, ...] = (),
               cut: bool = False, node_leases: bool = False) -> dict:  # fmt: skip
    """etcd on host 0, per_node ranks on each of hosts 1 and 2, per_node spares on standby
    host 3; every process of host 2 (agent, workers, coordinator candidate) SIGKILLed at
    step 10, or (cut) host 2's link taken down until its ranks were replaced, then healed.
    node_leases: the agents run with --node-leases (each node's workers' keys under its
    agent's lease, checked). Returns the surviving agent's report, checked against a
    fault-free run."""
    work = [*WORK, *args]
    world = 2 * per_node
    # the fault-free reference on one node, its buddies where the two-node job has them
    ref = reference_of(references, world, STATEFUL, work[1:], {"LIVEMIG_BUDDY_STRIDE": str(per_node)})
    etcd = _start_etcd(procs, hosts.wrap(0, []), hosts.addrs[0])
    job = "nodes"
    agent = ["--nproc-per-node", str(per_node), *(["--node-leases"] if node_leases else [])]
    a1 = _agent(procs, hosts.wrap(1, []), etcd, job, tmp_path, "h1", *agent, "--host", hosts.addrs[1],
                "--node-rank", "0", report=tmp_path / "r1.json", work=work, hold=True)  # fmt: skip
    a2 = _agent(procs, hosts.wrap(2, []), etcd, job, tmp_path, "h2", *agent, "--host", hosts.addrs[2],
                "--node-rank", "1", quiet=True, work=work, report=tmp_path / "r2.json", hold=True)  # fmt: skip
    spares = _standby(procs, hosts, etcd, job, tmp_path, per_node, work)
    client = EtcdClient(etcd)
    keys = JobKeys(job)
    deadline = _until_step_10_with_warm_spares(client, keys, per_node, outs=tmp_path)
    m = Rendezvous(client, keys.job).read()
    hosts_of = {r: mem.host for r, mem in m.members.items()}
    want = {r: hosts.addrs[1 + r // per_node] for r in range(world)}
    assert hosts_of == want, hosts_of  # ranks advertise --host; global rank = node rank x per node + i
    if node_leases:  # one lease a node: every worker's key is held by its agent's
        leases = {r: client.get(keys.member(r)).lease for r in range(world)}
        nodes = {k: client.get(keys.node(k)).lease for k in (0, 1)}
        assert leases == {r: nodes[r // per_node] for r in range(world)}, (leases, nodes)
    if cut:
        hosts.cut(2)
        while time.monotonic() < deadline:  # replaced: a committed generation without host 2
            m = Rendezvous(client, keys.job).read()
            if m.generation >= 2 and m.state == "committed":
                break
            time.sleep(0.1)
        hosts.heal(2)
    else:
        killed = hosts.kill_all(2)
        assert len(killed) >= 2 + per_node, killed  # the agent, its workers, its coordinator candidate
    out, err = a1.communicate(timeout=240)
    assert a1.returncode == 0, out.decode()[-2000:] + err.decode()[-2000:]
    rep = json.loads((tmp_path / "r1.json").read_text())
    assert rep["steps_completed"] == STEPS and rep["replicas_identical"]
    assert rep["rank_digests"] == ref.report["rank_digests"], "not bit-identical to the fault-free run"
    (rec,) = rep["recoveries"]  # the whole node in one recovery
    lost = list(range(per_node, world))
    fence = next(e for e in rep["timeline"] if e["phase"] == "fence")
    assert fence["ranks"] == lost, fence
    m = Rendezvous(client, keys.job).read()
    for r in lost:  # the lost ranks now run on the standby host
        assert m.members[r].host == hosts.addrs[3] and m.members[r].role == "spare", m.members
    assert rep["nodes"] == [{"node_rank": 0, "host": hosts.addrs[1], "ranks": list(range(per_node))},
                            {"node_rank": None, "host": hosts.addrs[3], "ranks": lost}], rep["nodes"]  # fmt: skip
    spares.wait(timeout=30)
    if cut:  # healed: host 2's processes found themselves fenced and stopped, writing nothing
        a2.wait(timeout=60)
        out2 = (tmp_path / "h2.out").read_text()  # its agent did not put its node key back: the node was replaced
        assert "not re-attaching its node key" in out2, out2[-3000:]
        rep2 = json.loads((tmp_path / "r2.json").read_text())
        codes = {p["name"]: p["exit_code"] for p in rep2["processes"] if p["role"] == "worker"}
        assert all(c in (3, -9) for c in codes.values()), codes
        assert rep2["rank_digests"] == rep["rank_digests"]
    print("node loss:", rec)
    return rep


@needs_netns
def test_a_whole_node_lost_is_replaced_from_a_standby_host_exactly(tmp_path, procs, hosts, references):
    _node_loss(tmp_path, procs, hosts, references, 1)


@needs_netns
def test_a_worker_host_cut_off_is_replaced_and_stops_as_fenced_when_healed(tmp_path, procs, hosts, references):
    _node_loss(tmp_path, procs, hosts, references, 1, cut=True)


@needs_netns
def test_a_node_of_two_zero1_ranks_with_local_state_lost_exactly(tmp_path, procs, hosts, references):
    """Each rank's ZeRO-1 shard and local= state are mirrored on the rank one node further
    (rank + nproc_per_node), so losing a whole node keeps a copy of each. With --node-leases:
    the lost node's two workers' keys go with its agent's one lease, one recovery."""
    _node_loss(tmp_path, procs, hosts, references, 2, ("--sharding", "zero1"), node_leases=True)


def test_agents_that_do_not_fit_the_run_are_refused(tmp_path, procs):
    """A second agent with a taken node rank, and one with another --nproc-per-node, are
    refused with one line; the agent of the missing node rank then joins, and a kill asked
    with `livemig inject --via-agent` (how a rank on another host is reached) is carried
    out by the agent holding the rank and recovered on its node's spare."""
    etcd = _start_etcd(procs, [], None)
    job = "fit"
    a0 = _agent(procs, [], etcd, job, tmp_path, "a0", "--node-rank", "0", "--host", "127.0.0.1", "--spares", "1",
                "--verify", report=tmp_path / "r0.json")  # fmt: skip
    client = EtcdClient(etcd)
    deadline = time.monotonic() + 30
    while client.get(JobKeys(job).node(0)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    st = subprocess.run([sys.executable, "-m", "livemig.cli", "status", "--etcd", etcd, "--job", job, "--json"],
                        capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    info = json.loads(st.stdout)
    assert info["run"]["nnodes"] == 2 and [n["node_rank"] for n in info["nodes"]] == [0], info
    assert info["nodes"][0]["host"] == "127.0.0.1"
    taken = _agent(procs, [], etcd, job, tmp_path, "a1", "--node-rank", "0", "--host", "127.0.0.1")
    _, err = taken.communicate(timeout=60)
    assert taken.returncode == 2 and "node rank 0 of job 'fit' is taken" in err.decode(), err.decode()
    other = procs.spawn([sys.executable, "-m", "livemig.cli", "run", "--nnodes", "2", "--nproc-per-node", "2",
                         "--etcd", etcd, "--job", job, *WORK], env=_env(tmp_path, "a2"),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    _, err = other.communicate(timeout=60)
    assert other.returncode == 2 and "nproc_per_node=1, this agent has 2" in err.decode(), err.decode()
    a1 = _agent(procs, [], etcd, job, tmp_path, "a3", "--node-rank", "auto", "--host", "127.0.0.1")
    inject = subprocess.run([sys.executable, "-m", "livemig.cli", "inject", "kill", "--etcd", etcd, "--job", job,
                             "--rank", "1", "--at-step", "15", "--via-agent", "--timeout", "120"],
                            capture_output=True, text=True, timeout=150, cwd=REPO)  # fmt: skip
    assert inject.returncode == 0 and "by its agent" in inject.stdout, inject.stdout + inject.stderr
    slow = subprocess.run([sys.executable, "-m", "livemig.cli", "inject", "slow", "--etcd", etcd, "--job", job,
                           "--rank", "0", "--at-step", "25", "--factor", "2", "--for", "2", "--via-agent",
                           "--timeout", "120"], capture_output=True, text=True, timeout=150, cwd=REPO)  # fmt: skip
    assert slow.returncode == 0 and "by its agent" in slow.stdout, slow.stdout + slow.stderr
    outs = {}
    for name, a in (("a0", a0), ("a1", a1)):
        out, err = a.communicate(timeout=120)
        assert a.returncode == 0, out.decode()[-1500:] + err.decode()[-1500:]
        outs[name] = out.decode()
    assert "slowing worker-0 2x for 2s (requested through etcd)" in outs["a0"], outs["a0"][-2000:]
    rep = json.loads((tmp_path / "r0.json").read_text())
    assert rep["steps_completed"] == STEPS and rep["replicas_identical"] and len(rep["recoveries"]) == 1, rep
    # --verify across nodes: the fault-free reference ran after the job, on a0's node, rank by rank
    assert rep["bit_identical"] and rep["ranks_differing"] == [], rep


def _lose_the_leaders_node(client, keys, hosts, agents, tmp_path, ref) -> tuple[dict, int, int]:  # noqa: ANN001
    """SIGKILL every process of the host (1 or 2) whose coordinator candidate leads; the other
    node's agent must see the job through, bit-identical. Returns (its report, lost host,
    surviving host)."""
    leader = client.get(keys.leader).value.decode()  # coordinator-<host>-<pid>-<random>
    victim = hosts.addrs.index(leader.split("-")[1])
    assert victim in (1, 2), leader
    hosts.kill_all(victim)
    survivor = 3 - victim
    agents[survivor].wait(timeout=240)
    rep = json.loads((tmp_path / f"r{survivor}.json").read_text())
    assert agents[survivor].returncode == 0, (tmp_path / f"h{survivor}.out").read_text()[-3000:]
    assert rep["steps_completed"] == STEPS and rep["rank_digests"] == ref.report["rank_digests"]
    return rep, victim, survivor


@needs_netns
def test_the_node_of_the_leader_and_an_etcd_member_lost_exactly(tmp_path, procs, hosts, references):
    """A 3-member etcd (`livemig etcd`) on hosts 0, 1 and 2; two ranks on each of hosts 1
    and 2; spares on host 3. The host whose coordinator candidate leads is lost with its
    etcd member: quorum holds, the other node's candidate takes over, both lost ranks are
    replaced in one recovery, exact."""
    per_node, world = 2, 4
    ref = reference_of(references, world, STATEFUL, WORK[1:], {"LIVEMIG_BUDDY_STRIDE": str(per_node)})
    cluster = ",".join(f"e{k}=http://{hosts.addrs[k]}:2380" for k in range(3))
    for k in range(3):
        procs.spawn(hosts.wrap(k, [sys.executable, "-m", "livemig.cli", "etcd", "--name", f"e{k}", "--listen",
                                   hosts.addrs[k], "--cluster", cluster, "--data-dir", str(tmp_path / f"etcd{k}")]),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    etcd = ",".join(f"http://{hosts.addrs[k]}:2379" for k in range(3))
    job = "ha"
    agents = {}
    for k in (1, 2):
        agents[k] = _agent(procs, hosts.wrap(k, []), etcd, job, tmp_path, f"h{k}", "--nproc-per-node", "2",
                           "--host", hosts.addrs[k], "--node-rank", str(k - 1), quiet=True,
                           report=tmp_path / f"r{k}.json", hold=True)  # fmt: skip
    _standby(procs, hosts, etcd, job, tmp_path, 2, WORK)
    client = EtcdClient(etcd)
    keys = JobKeys(job)
    _until_step_10_with_warm_spares(client, keys, 2, outs=tmp_path)
    # its agent, two workers, the leading coordinator, an etcd member
    rep, victim, survivor = _lose_the_leaders_node(client, keys, hosts, agents, tmp_path, ref)
    (rec,) = rep["recoveries"]
    lost = [r for r in range(world) if r // per_node == victim - 1]
    # both lost ranks replaced in the one recovery above (no commit between their fences). With
    # an etcd member lost too, the new etcd leader re-times the leases it inherits, so the two
    # ranks' leases can expire more than the node settle apart (CI: rank 1 fenced in generation
    # 2, rank 0 in 3, one recovery): the union of the fences is what is asserted, not one event
    fences = [e for e in rep["timeline"] if e["phase"] == "fence"]
    assert sorted({r for e in fences for r in e["ranks"]}) == lost, fences
    assert rec["generation"] >= max(e["generation"] for e in fences), (rec, fences)
    new_leader = client.get(keys.leader)
    assert new_leader is None or hosts.addrs[survivor] in new_leader.value.decode()
    print("leader node loss:", rec)


@needs_netns
def test_the_node_of_the_leading_coordinator_lost_costs_one_lease(tmp_path, procs, hosts, references):
    """etcd on host 0 (alive); a rank on each of hosts 1 and 2, spares on host 3. The host
    whose coordinator candidate leads is lost whole (agent, worker, leader): the other node's
    candidate takes over and the lost rank is replaced, exact, with downtime within the lease
    TTL plus one second (the takeover and the lost member's lease expire together)."""
    ttl = 2.0
    ref = reference_of(references, 2, STATEFUL, WORK[1:], {"LIVEMIG_BUDDY_STRIDE": "1"})
    etcd = _start_etcd(procs, hosts.wrap(0, []), hosts.addrs[0])
    job = "lead"
    agents = {}
    for k in (1, 2):
        agents[k] = _agent(procs, hosts.wrap(k, []), etcd, job, tmp_path, f"h{k}", "--host", hosts.addrs[k],
                           "--node-rank", str(k - 1), quiet=True, report=tmp_path / f"r{k}.json",
                           hold=True)  # fmt: skip
    _standby(procs, hosts, etcd, job, tmp_path, 1, WORK)
    client = EtcdClient(etcd)
    keys = JobKeys(job)
    # step 30: the other candidate has had ~2 s of training to start its c10d store (a loaded
    # machine imports torch slowly); a loss before it is up waits for it inside the claim
    _until_step_10_with_warm_spares(client, keys, 1, step=30, outs=tmp_path)
    rep, _, _ = _lose_the_leaders_node(client, keys, hosts, agents, tmp_path, ref)
    (rec,) = rep["recoveries"]
    print("leader node loss (etcd alive):", rec)
    assert rec["downtime_s"] <= ttl + 1.0, rec


def _drain_job(tmp_path, procs, hosts, job: str, spares: int, *extra: str,
               release: bool = True) -> tuple[dict, EtcdClient, JobKeys, str]:  # fmt: skip
    """etcd on host 0, one rank on each of hosts 1 and 2 (agents with --on-sigterm drain),
    `spares` spares on host 3; returns once the job trains at step 10 with them warm (not
    release: held at step 12 until the test removes tmp_path/hold)."""
    etcd = _start_etcd(procs, hosts.wrap(0, []), hosts.addrs[0])
    agents = {}
    for k in (1, 2):
        agents[k] = _agent(procs, hosts.wrap(k, []), etcd, job, tmp_path, f"h{k}", "--host", hosts.addrs[k],
                           "--node-rank", str(k - 1), "--on-sigterm", "drain", *extra, quiet=True,
                           report=tmp_path / f"r{k}.json", hold=True)  # fmt: skip
    if spares:
        _standby(procs, hosts, etcd, job, tmp_path, spares, WORK)
    client = EtcdClient(etcd)
    keys = JobKeys(job)
    _until_step_10_with_warm_spares(client, keys, spares, outs=tmp_path, release=release)
    return agents, client, keys, etcd


@needs_netns
def test_sigterm_to_a_nodes_agent_drains_its_ranks_onto_a_spare_and_the_job_goes_on_exactly(
    tmp_path, procs, hosts, references
):
    """What Slurm preemption or a Kubernetes drain sends first: SIGTERM to node 1's agent. Its
    rank moves to the warm spare on host 3 in one generation change, that agent exits 0 well
    within the grace, and the job finishes bit-identical to the fault-free run, rank by rank."""
    ref = reference_of(references, 2, STATEFUL, WORK[1:], {"LIVEMIG_BUDDY_STRIDE": "1"})
    launch = ("--launch-id", "indexed-job-uid")  # what the Indexed Job's pods all carry (deploy/kubernetes)
    agents, client, keys, etcd = _drain_job(tmp_path, procs, hosts, "drain", 1, *launch)
    t0 = time.monotonic()
    agents[2].send_signal(15)
    agents[2].wait(timeout=30)
    took = time.monotonic() - t0
    out2 = (tmp_path / "h2.out").read_text()
    assert agents[2].returncode == 0, out2[-3000:]
    assert took < 25, took
    assert "drained in" in out2, out2[-2000:]
    # the replacement (a Kubernetes Indexed Job's new pod for the index): the same --node-rank, mid-run,
    # joins as standby capacity and exits 0 with the job; where the job's last steps ended before it
    # joined (CI: a loaded machine starts it slowly), it learns its launch's run finished and exits 0
    again = _agent(procs, hosts.wrap(2, []), etcd, "drain", tmp_path, "h2b", "--host", hosts.addrs[2],
                   "--node-rank", "1", "--on-sigterm", "drain", *launch, quiet=True)  # fmt: skip
    agents[1].wait(timeout=240)
    again.wait(timeout=60)
    out2b = (tmp_path / "h2b.out").read_text()
    joined = "node 1 joins as 1 warm spare(s)" in out2b or "before node 1 joined it: nothing to start" in out2b
    assert again.returncode == 0 and joined, out2b[-3000:]
    rep = json.loads((tmp_path / "r1.json").read_text())
    assert agents[1].returncode == 0, (tmp_path / "h1.out").read_text()[-3000:]
    assert rep["steps_completed"] == STEPS and rep["rank_digests"] == ref.report["rank_digests"], rep["result"]
    (rec,) = rep["recoveries"]
    assert rec["rank"] == 1 and rec["spares"], rec
    m = Rendezvous(client, keys.job).read()
    assert m.members[1].host == hosts.addrs[3], m.members
    print(f"drain: agent exit {took:.2f}s after SIGTERM; job pause {rec['downtime_s']}s; phases {rec['phases']}")


@needs_netns
def test_sigterm_to_every_agent_stops_at_one_checkpoint_and_the_job_run_again_resumes_exactly(
    tmp_path, procs, hosts, references
):
    """What Slurm's time limit, `scancel`, preemption or a requeue send: SIGTERM to both agents,
    with a warm spare on host 3 (one node could drain onto it: the whole job is told to stop).
    The ranks agree on a step inside its collective and write one checkpoint of it, both agents
    exit 75; the job run again with the same --checkpoint-dir (a requeued sbatch) resumes there
    by itself and ends bit-identical to the fault-free run, rank by rank."""
    from livemig.checkpoint_dir import step_name

    ref = reference_of(references, 2, STATEFUL, WORK[1:], {"LIVEMIG_BUDDY_STRIDE": "1"})
    ck = ("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1000")
    agents, client, keys, etcd = _drain_job(tmp_path, procs, hosts, "whole", 1, *ck)
    t0 = time.monotonic()
    for k in (1, 2):
        agents[k].send_signal(15)
    for k in (1, 2):
        agents[k].wait(timeout=30)
    took = time.monotonic() - t0
    outs = {k: (tmp_path / f"h{k}.out").read_text() for k in (1, 2)}
    assert [agents[k].returncode for k in (1, 2)] == [75, 75], outs
    assert "every node of the job is draining" in outs[1] + outs[2], outs
    res = json.loads((tmp_path / "r1.json").read_text())["result"]
    assert res["state"] == "stopped" and 10 <= res["step"] < STEPS - 1, res
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step_")) == [step_name(res["step"])]
    client.close()

    again = tmp_path / "again"
    again.mkdir()
    for k in (1, 2):
        agents[k] = _agent(procs, hosts.wrap(k, []), etcd, "whole", again, f"h{k}", "--host", hosts.addrs[k],
                           "--node-rank", str(k - 1), *ck, quiet=True, report=again / f"r{k}.json")  # fmt: skip
    for k in (1, 2):
        agents[k].wait(timeout=240)
    out1 = (again / "h1.out").read_text()
    assert [agents[k].returncode for k in (1, 2)] == [0, 0], out1[-3000:]
    assert f"resuming from {tmp_path / 'ck' / step_name(res['step'])}" in out1, out1[-3000:]
    rep = json.loads((again / "r1.json").read_text())
    assert rep["steps_completed"] == STEPS and rep["rank_digests"] == ref.report["rank_digests"], rep["result"]
    print(f"whole-job stop: both agents exited {took:.2f}s after SIGTERM, checkpoint of step {res['step']}")


@needs_netns
def test_a_drain_with_no_spare_shrinks_within_min_nproc_and_without_it_stops_the_job(tmp_path, procs, hosts):
    """No spare: with --min-nproc 1 the survivor carries the drained node's rank and the job
    finishes (the drained agent exits 0; the drain asked from a shell, `livemig drain --node 1`);
    without it the drain says why it cannot and the job stops as before (interrupted, exit 130
    on both nodes: no --checkpoint-dir to stop at)."""
    agents, client, keys, etcd = _drain_job(tmp_path, procs, hosts, "drain-shrink", 0, "--min-nproc", "1",
                                            release=False)  # fmt: skip
    # the job waits at step 12 until the drain is asked: a loaded machine starts the command
    # slower than the job's last steps take
    cmd = procs.spawn([sys.executable, "-m", "livemig.cli", "drain", "--job", "drain-shrink", "--node", "1",
                       "--etcd", etcd, "--wait", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    first = cmd.stdout.readline().decode()
    (tmp_path / "hold").unlink()
    rest, _ = cmd.communicate(timeout=90)
    out = first + rest.decode()
    assert cmd.returncode == 0 and "node 1 drained" in out, out
    agents[2].wait(timeout=30)
    assert agents[2].returncode == 0, (tmp_path / "h2.out").read_text()[-3000:]
    agents[1].wait(timeout=240)
    rep = json.loads((tmp_path / "r1.json").read_text())
    assert agents[1].returncode == 0, (tmp_path / "h1.out").read_text()[-3000:]
    assert rep["steps_completed"] == STEPS and rep["recoveries"][0]["kind"] == "shrink", rep["recoveries"]
    client.close()

    sub = tmp_path / "stop"
    sub.mkdir()
    agents, client, keys, _ = _drain_job(sub, procs, hosts, "drain-stop", 0)
    t0 = time.monotonic()
    agents[2].send_signal(15)
    agents[2].wait(timeout=30)
    out2 = (sub / "h2.out").read_text()
    assert agents[2].returncode == 130 and "cannot drain (1 rank(s) of 1 draining node(s), 0 warm spare(s)" in out2, \
        out2[-2000:]  # fmt: skip
    agents[1].wait(timeout=60)
    assert agents[1].returncode == 130 and time.monotonic() - t0 < 30, (sub / "h1.out").read_text()[-2000:]
