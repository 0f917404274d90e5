"""The Slurm deployment on a real Slurm (scripts/check_slurm.sh installs it): a one-host cluster
of Debian's slurm-wlm 22.05 with munge, one slurmctld and three slurmd node names (n1..n3, each
its own port), running deploy/slurm/livemig.sbatch and spares.sbatch unchanged.

Two jobs, each checked against a fault-free run of the same training (a digest per rank):
  A. workers on n1 and n2, two spares on n3: a worker SIGKILLed, then node n1's agent sent
     SIGTERM (a drain: its rank moves to a spare, that agent exits 0 within the grace);
  B. workers on n1 and n2, one spare on n3: node n2 lost (its slurmd stopped, every process of
     its step SIGKILLed); --no-kill keeps the allocation, the rank moves to the spare.
  C. workers on n1 and n2 with --checkpoint-dir: the whole job signalled (`scancel
     --signal=TERM`, every step, etcd's too): one checkpoint at the step the ranks agree on,
     the agents exit 75, the job COMPLETED; then `scontrol requeue`: the same job id, a fresh
     etcd, the agents resume from the checkpoint by themselves; then the time limit's warning
     (USR1 to the batch script, as --signal=B:USR1@90 sends it): stopped at a second
     checkpoint, requeued by the script itself, resumed again, and finished.
Each must end COMPLETED with ExitCode 0:0 and bit-identical ranks, and leave nothing behind
(no process of the jobs, no etcd data directory).

Prints `SKIPPED: <reason>` and exits 0 where it cannot run (not root, no Slurm), 1 then with
LIVEMIG_CI_STRICT=1; exits 1 on any failed check with one line saying which.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
NODES = ("n1", "n2", "n3")
STEPS = 300
SLEEP = "0.05"  # s per step: the job trains ~20 s, long enough for its faults
ETCD = "http://127.0.0.1:2379"  # livemig.sbatch's etcd on n1 (NodeAddr 127.0.0.1)
WORK = ["--steps", str(STEPS)]

CONF = """ClusterName=livemigci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdTimeout=10
ReturnToService=2
MpiDefault=none
KillWait=10
JobAcctGatherType=jobacct_gather/none
PartitionName=ci Nodes=n1,n2,n3 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Failed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


class Cluster:
    """The one-host cluster: started here, stopped (daemons, jobs, files) whatever happens."""

    def __init__(self, d: str) -> None:
        self.d = d
        self.conf = os.path.join(d, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.munged = False

    def start(self) -> None:
        for sub in ("state", "run", "log", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(self.d, sub), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(CONF.format(d=self.d))
            for i, n in enumerate(NODES):
                f.write(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={17001 + i} CPUs=2 "
                        "RealMemory=3000 State=UNKNOWN\n")  # fmt: skip
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["munged", "--force"], check=True, capture_output=True)
            self.munged = True
        subprocess.run(["slurmctld", "-f", self.conf], check=True, env=self.env)
        for n in NODES:
            self.slurmd(n)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%t %N")
            if out.startswith("idle") and "n[1-3]" in out:
                return
            time.sleep(0.5)
        raise Failed(f"the cluster did not come up: sinfo says {out!r}")

    def slurmd(self, n: str) -> None:
        subprocess.run(["slurmd", "-f", self.conf, "-N", n], check=True, env=self.env)

    def run(self, *argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=30).stdout.strip()

    def pid(self, what: str) -> int | None:
        try:
            with open(os.path.join(self.d, "run", f"{what}.pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def job_state(self, jid: str) -> tuple[str, str]:
        out = self.run("scontrol", "show", "job", jid)
        fields = dict(x.split("=", 1) for x in out.split() if "=" in x)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def wait_job(self, jid: str, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, code = self.job_state(jid)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "?"):
                return state, code
            time.sleep(0.5)
        return self.job_state(jid)

    def stop(self) -> None:
        self.run("scancel", "--partition", "ci")
        for what in ("slurmctld", *(f"slurmd-{n}" for n in NODES)):
            pid = self.pid(what)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        time.sleep(1)
        if self.munged:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)


def digests_at_end(client, keys, timeout: float) -> dict[str, str]:  # noqa: ANN001
    """Each rank's final digest, read while the job's etcd lingers after its end."""
    from livemig.agent.report import rank_digests, read_finals
    from livemig.errors import LivemigError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            res = client.get(keys.result)
            if res is not None:
                finals = read_finals(client, keys)
                if len(finals) == 2:
                    return rank_digests(finals)
        except LivemigError:
            pass
        time.sleep(0.2)
    raise Failed("no final record of both ranks was read from the job's etcd")


def wait_for(pred, what: str, timeout: float = 120):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = pred()
        except Exception:  # noqa: BLE001 - etcd not up yet, a record half written
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise Failed(f"timed out waiting for {what}")


def reference(d: str) -> dict[str, str]:
    """The fault-free digests: the same world as local processes, each rank's mirror where the
    two-node job has it (the next node: buddy stride 1)."""
    report = os.path.join(d, "ref.json")
    env = dict(os.environ, LIVEMIG_STATE_DIR=os.path.join(d, "ref-state"), LIVEMIG_BUDDY_STRIDE="1")
    r = subprocess.run([sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--report", report,
                        os.path.join(REPO, "examples", "stateful.py"), *WORK], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=300)  # fmt: skip
    check(r.returncode == 0, f"the fault-free reference failed: {r.stdout[-500:]} {r.stderr[-1500:]}")
    with open(report) as f:
        return json.load(f)["rank_digests"]


def _env(cl: Cluster, d: str, name: str, spares: int, run_args: str = "") -> dict[str, str]:
    env = dict(cl.env, TRAIN=os.path.join(REPO, "examples", "stateful.py"), LIVEMIG_JOB=name,
               LIVEMIG_ETCD_FILE=os.path.join(d, f"{name}.etcd"), STATEFUL_STEP_SLEEP=SLEEP,
               LIVEMIG_RUN_ARGS=f"--lease-ttl 2 {run_args}".strip(), TMPDIR=os.path.join(d, "tmp"),
               LIVEMIG_STATE_DIR=os.path.join(d, name), SPARES_PER_NODE=str(spares), LIVEMIG_ETCD_LINGER="10",
               PYTHONPATH=REPO)  # fmt: skip
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def submit_workers(d: str, name: str, env: dict[str, str]) -> str:
    wk = subprocess.run(["sbatch", "--parsable", "--nodes=2", "-w", "n1,n2", "-o", os.path.join(d, f"{name}.out"),
                         os.path.join(REPO, "deploy", "slurm", "livemig.sbatch"), *WORK], capture_output=True,
                        text=True, env=env, cwd=d)  # fmt: skip
    check(wk.returncode == 0, f"sbatch failed: {wk.stderr}")
    return wk.stdout.strip().split(";")[0]


def submit(cl: Cluster, d: str, name: str, spares: int) -> tuple[str, str]:
    """The spares job on n3 and the workers' job on n1 and n2, as an operator submits them."""
    env = _env(cl, d, name, spares)
    workers_env = dict(env, SPARES_PER_NODE="0")
    sp = subprocess.run(["sbatch", "--parsable", "-w", "n3", "-o", os.path.join(d, f"{name}-spares.out"),
                         os.path.join(REPO, "deploy", "slurm", "spares.sbatch"), *WORK], capture_output=True,
                        text=True, env=env, cwd=d)  # fmt: skip
    wk = subprocess.run(["sbatch", "--parsable", "--nodes=2", "-w", "n1,n2", "-o", os.path.join(d, f"{name}.out"),
                         os.path.join(REPO, "deploy", "slurm", "livemig.sbatch"), *WORK], capture_output=True,
                        text=True, env=workers_env, cwd=d)  # fmt: skip
    check(sp.returncode == 0 and wk.returncode == 0, f"sbatch failed: {sp.stderr} {wk.stderr}")
    return wk.stdout.strip().split(";")[0], sp.stdout.strip().split(";")[0]


def job_keys(name: str):  # noqa: ANN201
    from livemig.rdzv.client import EtcdClient
    from livemig.rdzv.keys import JobKeys

    return EtcdClient(ETCD), JobKeys(name)


def trains_with_spares(client, keys, spares: int) -> None:  # noqa: ANN001
    from livemig.rdzv.client import decode

    def ready() -> bool:
        kv = client.get(keys.progress(0))
        warm = [k for k in client.get_prefix(keys.spares_prefix)[0] if (decode(k.value) or {}).get("state") == "warm"]
        return kv is not None and decode(kv.value)["step"] >= 20 and len(warm) >= spares

    wait_for(ready, f"the job to train with {spares} warm spare(s)")


def table(client, keys):  # noqa: ANN001, ANN201
    from livemig.rdzv.membership import Rendezvous

    return Rendezvous(client, keys.job).read()


def node_agent(client, keys, k: int) -> int:  # noqa: ANN001
    from livemig.rdzv.client import decode

    kv = client.get(keys.node(k))
    check(kv is not None, f"node {k} holds no node key")
    return int(decode(kv.value)["pid"])


def replaced(client, keys, rank: int, old: str) -> bool:  # noqa: ANN001
    m = table(client, keys)
    return m.state == "committed" and m.members[rank].incarnation != old


def scenario_kill_and_drain(cl: Cluster, d: str, ref: dict[str, str]) -> str:
    jid, sid = submit(cl, d, "slurm-a", 2)
    client, keys = job_keys("slurm-a")
    trains_with_spares(client, keys, 2)
    m = table(client, keys)
    old = m.members[1].incarnation
    os.kill(m.members[1].pid, signal.SIGKILL)
    wait_for(lambda: replaced(client, keys, 1, old), "rank 1 replaced after its worker's SIGKILL")
    agent = node_agent(client, keys, 0)
    ranks0 = [r for r, mem in table(client, keys).members.items() if mem.pid and _child_of(mem.pid, agent)]
    t0 = time.monotonic()
    os.kill(agent, signal.SIGTERM)
    wait_for(lambda: not _alive(agent), "node 0's agent to exit after SIGTERM", timeout=30)
    took = time.monotonic() - t0
    check(took < 25, f"the drain took {took:.1f}s, over the grace")
    digests = digests_at_end(client, keys, 180)
    state, code = cl.wait_job(jid, 120)
    if state == "RUNNING":
        raise Failed(f"job A still RUNNING 120 s after its end: {stuck(d, 'slurm-a')}")
    check(
        (state, code) == ("COMPLETED", "0:0"), f"job A ended {state} {code} (want COMPLETED 0:0): {_tail(d, 'slurm-a')}"
    )
    sstate, scode = cl.wait_job(sid, 60)
    check((sstate, scode) == ("COMPLETED", "0:0"), f"spares job A ended {sstate} {scode}")
    check(digests == ref, f"job A is not bit-identical to the fault-free run: {digests} vs {ref}")
    client.close()
    return f"A: worker killed, node 0 (ranks {ranks0}) drained in {took:.1f}s: COMPLETED 0:0, bit-identical"


def scenario_lost_node(cl: Cluster, d: str, ref: dict[str, str]) -> str:
    jid, sid = submit(cl, d, "slurm-b", 1)
    client, keys = job_keys("slurm-b")
    trains_with_spares(client, keys, 1)
    agent = node_agent(client, keys, 1)
    node = _env_of(agent).get("SLURMD_NODENAME", "")
    check(node in NODES, f"node 1's agent runs on no known node ({node!r})")
    slurmd = cl.pid(f"slurmd-{node}")
    if slurmd:
        os.kill(slurmd, signal.SIGKILL)  # the node's daemon first, then everything it ran
    import psutil

    procs = [psutil.Process(agent), *psutil.Process(agent).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    digests = digests_at_end(client, keys, 180)
    state, code = cl.wait_job(jid, 120)
    check(
        (state, code) == ("COMPLETED", "0:0"), f"job B ended {state} {code} (want COMPLETED 0:0): {_tail(d, 'slurm-b')}"
    )
    check(digests == ref, f"job B is not bit-identical to the fault-free run: {digests} vs {ref}")
    cl.wait_job(sid, 60)
    cl.slurmd(node)
    cl.run("scontrol", "update", f"nodename={node}", "state=resume")
    client.close()
    return f"B: node {node} lost (slurmd and its processes killed): COMPLETED 0:0, bit-identical"


def _stopped(cl: Cluster, d: str, client, keys, what: str) -> dict:  # noqa: ANN001
    from livemig.rdzv.client import decode

    res = wait_for(lambda: decode(client.get(keys.result).value), f"the job's result after {what}", 60)
    check(res.get("state") == "stopped", f"job C ended {res} on {what} (want stopped): {_tail(d, 'slurm-c')}")
    return res


def _start_requeued(cl: Cluster, jid: str) -> None:
    # Slurm holds a requeued job until now + cred_expire (120 s by default) + 1: start it now, but
    # not within the second its old credential was revoked: slurmd compares whole seconds and kills a
    # job whose credential is no newer than the revocation ("Killing non-startable batch JobId=5: Job
    # credential revoked", JobState=FAILED; seen once in CI when the start landed 0.2 s after it)
    wait_for(lambda: cl.job_state(jid)[0] == "PENDING", "the job to be pending again after its requeue", 60)
    time.sleep(2.0)
    cl.run("scontrol", "update", f"JobId={jid}", "StartTime=now")
    try:
        wait_for(lambda: cl.job_state(jid)[0] == "RUNNING", "the requeued job to run", 120)
    except Failed as exc:
        raise Failed(f"{exc}: {cl.run('scontrol', 'show', 'job', jid)}") from None


def scenario_stop_and_requeue(cl: Cluster, d: str, ref: dict[str, str]) -> str:
    from livemig.rdzv.client import decode

    ck = os.path.join(d, "ck-c")
    env = dict(_env(cl, d, "slurm-c", 0, f"--checkpoint-dir {ck} --checkpoint-every 100000"), LIVEMIG_ETCD_LINGER="2")
    jid = submit_workers(d, "slurm-c", env)  # no spares job to see the end: etcd need not linger
    client, keys = job_keys("slurm-c")
    trains_with_spares(client, keys, 0)
    t0 = time.monotonic()
    cl.run("scancel", "--signal=TERM", jid)  # every step: both agents and etcd (which lingers)
    first = _stopped(cl, d, client, keys, "scancel --signal=TERM")
    took = time.monotonic() - t0
    state, code = cl.wait_job(jid, 90)
    check((state, code) == ("COMPLETED", "0:0"), f"job C stopped {state} {code} (want COMPLETED 0:0): "
                                                 f"{_tail(d, 'slurm-c')}")  # fmt: skip
    client.close()
    out = cl.run("scontrol", "requeue", jid)
    _start_requeued(cl, jid)
    # the time limit's warning (--signal=B:USR1@90), as Slurm sends it: the script stops the job at
    # a checkpoint and requeues it itself
    client, keys = job_keys("slurm-c")
    wait_for(lambda: decode(client.get(keys.progress(0)).value)["step"] >= first["step"] + 10,
             "the requeued job to train", 120)  # fmt: skip
    cl.run("scancel", "--batch", "--signal=USR1", jid)
    second = _stopped(cl, d, client, keys, "the time limit's USR1")
    check(second["step"] > first["step"], f"the second stop's step {second['step']} is not past {first['step']}")
    client.close()
    _start_requeued(cl, jid)
    client, keys = job_keys("slurm-c")
    digests = digests_at_end(client, keys, 240)
    state, code = cl.wait_job(jid, 120)
    log = _tail(d, "slurm-c")
    check((state, code) == ("COMPLETED", "0:0"), f"job C requeued ended {state} {code}: {out} {log}")
    with open(os.path.join(d, "slurm-c.out")) as f:
        text = f.read()
    for res in (first, second):
        check(f"resuming from {ck}/step_{res['step']:010d}" in text,
              f"a requeued run did not resume from the stop's checkpoint of step {res['step']}: {log}")  # fmt: skip
    check(digests == ref, f"job C is not bit-identical to the fault-free run: {digests} vs {ref}")
    client.close()
    return (f"C: scancel --signal=TERM stopped at the checkpoint of step {first['step']} in {took:.1f}s, requeued, "
            f"resumed there; the time limit's USR1 stopped it at step {second['step']} and requeued it; resumed, "
            "COMPLETED 0:0, bit-identical")  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _child_of(pid: int, ancestor: int) -> bool:
    import psutil

    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def _env_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(x.split("=", 1) for x in f.read().decode(errors="replace").split("\0") if "=" in x)


def _tail(d: str, name: str, chars: int = 1500) -> str:
    try:
        with open(os.path.join(d, f"{name}.out")) as f:
            return f.read()[-chars:]
    except OSError:
        return "(no output)"


def _processes():  # noqa: ANN202
    """(process, cmdline, environ) of every process whose environment is readable."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            env = p.info["environ"] or {}
        except psutil.Error:
            continue
        yield p, p.info["cmdline"] or [], env


def stuck(d: str, name: str) -> str:
    """A job Slurm still sees RUNNING after livemig's job ended: which of its processes are left,
    and every agent's thread stacks (`livemig run` and `livemig-spare start` print them on
    SIGQUIT, livemig/logs.py stacks_on_sigquit), so the failure says where one waits."""
    left = []
    for p, cmd, env in _processes():
        if env.get("LIVEMIG_JOB") != name or p.pid == os.getpid():
            continue
        left.append(f"{p.pid} {' '.join(cmd)[:160]}")
        if any(x in ("run", "start") for x in cmd[1:4]) and any("livemig" in x for x in cmd[:3]):
            try:
                os.kill(p.pid, signal.SIGQUIT)
            except ProcessLookupError:
                pass
    time.sleep(1.0)
    out = _tail(d, name, 8000)
    return "processes left:\n" + "\n".join(left) + "\noutput (stacks of the agents left, after SIGQUIT):\n" + out


def leftovers(d: str) -> list[str]:
    out = []
    for p, cmd, env in _processes():
        ours = cmd and os.path.basename(cmd[0]) in ("slurmctld", "slurmd")  # the cluster's daemons: stopped after
        if env.get("LIVEMIG_JOB", "").startswith("slurm-") or d in " ".join(cmd):
            if p.pid != os.getpid() and not ours:
                out.append(f"{p.pid} {' '.join(cmd)[:120]}")
    out += [f"etcd data {x}" for x in os.listdir(os.path.join(d, "tmp")) if x.startswith("livemig-etcd")]
    return out


def main() -> int:
    strict = os.environ.get("LIVEMIG_CI_STRICT") == "1"
    why = ""
    if os.geteuid() != 0:
        why = "not root (the check starts slurmctld, slurmd and munged)"
    elif not all(shutil.which(x) for x in ("slurmctld", "slurmd", "sbatch", "munged")):
        why = "Slurm is not installed (scripts/check_slurm.sh installs Debian's slurm-wlm and munge)"
    if why:
        print(f"SKIPPED: {why}")
        return 1 if strict else 0
    d = tempfile.mkdtemp(prefix="livemig-slurm-")
    cl = Cluster(d)
    t0 = time.monotonic()
    try:
        cl.start()
        ref = reference(d)
        lines = [
            scenario_kill_and_drain(cl, d, ref),
            scenario_lost_node(cl, d, ref),
            scenario_stop_and_requeue(cl, d, ref),
        ]
        time.sleep(2)
        left = leftovers(d)
        check(not left, f"left behind: {left}")
        for line in lines:
            print(f"check_slurm: {line}")
        print(f"check_slurm: passed in {time.monotonic() - t0:.0f}s")
        return 0
    except Failed as exc:
        print(f"check_slurm: FAILED: {exc}", file=sys.stderr)
        for log in ("slurmctld.log",):
            try:
                with open(os.path.join(d, "log", log)) as f:
                    print(f.read()[-1500:], file=sys.stderr)
            except OSError:
                pass
        # the jobs' own output too: a requeued job that never trained said why only there
        for out in sorted(f for f in os.listdir(d) if f.endswith(".out")):
            print(f"--- {out} (tail)\n{_tail(d, out[: -len('.out')], 3000)}", file=sys.stderr)
        return 1
    finally:
        cl.stop()
        if os.environ.get("LIVEMIG_SLURM_KEEP") == "1":  # for a look at the jobs' output
            print(f"check_slurm: kept {d}", file=sys.stderr)
        else:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
