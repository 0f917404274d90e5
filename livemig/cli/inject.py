"""`livemig inject KIND --job J ...`: inject a fault into a running job from
another shell on the same machine (the same kinds as `--fault` plans; see
livemig/faults.py and docs/reliability.md)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
import uuid
from datetime import timedelta

import psutil

from livemig.agent.fault_driver import in_flight_spares, phase_reached, record_fault, step_reached
from livemig.agent.jobs import connect, require_live_job
from livemig.config import validate_job_name
from livemig.errors import ConfigError
from livemig.faults import KINDS, PHASE_DURING, Fault
from livemig.rdzv.client import EtcdClient, decode, encode
from livemig.rdzv.membership import Rendezvous
from livemig.rdzv.security import add_arguments as add_security_arguments

# drop_avg is in-process only; partition needs the worker started in a namespace by `livemig run`;
# migrate is `livemig migrate`, stop `livemig stop`
CLI_KINDS = tuple(k for k in KINDS if k not in ("drop_avg", "partition", "link", "etcd-stop", "migrate", "stop")) + (
    "resume",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inject", help="inject a fault into a running job")
    p.add_argument("kind", choices=sorted(CLI_KINDS))
    p.add_argument("--job", required=True)
    p.add_argument(
        "--rank",
        type=int,
        help="target rank (kill, hang, resume, slow, corrupt, wedge, break); spare-kill and "
        "spare-hang take a claimed (else a standby) spare, never a rank",
    )
    p.add_argument("--at-step", type=int, default=0, help="wait until the rank (any rank) committed this step")
    p.add_argument("--during", choices=PHASE_DURING, help="wait until a recovery reaches this phase")
    p.add_argument("--factor", type=float, default=4.0, help="slow: this many times slower (default 4)")
    p.add_argument("--for", dest="duration", type=float, default=30.0, help="slow: for this long, s (default 30)")
    p.add_argument("--member", type=int, default=0, help="etcd-kill: index of the etcd member (default 0)")
    p.add_argument("--pid", type=int, help="signal this pid instead (e.g. to resume a fenced process)")
    p.add_argument("--via-agent", action="store_true",
                   help="kill/hang/resume/slow: ask the target's agent through etcd even if it runs here "
                        "(automatic for a process on another host)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting after this long, s")
    p.add_argument("--etcd")
    p.add_argument("--etcd-timeout", type=float, default=5.0)
    add_security_arguments(p)
    p.set_defaults(fn=cmd_inject)


def _is_local(host: str) -> bool:
    if not host or host in (socket.gethostname(), "sim"):
        return True
    return any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)


def _local(host: str, what: str) -> None:
    if not _is_local(host):
        raise ConfigError(f"{what} runs on host {host}: run `livemig inject` there")


def _via_agent(a: argparse.Namespace, client: EtcdClient, rdzv: Rendezvous, step: int) -> int:
    """kill / hang / resume / slow of a rank on another host: a request its agent carries out."""
    m = rdzv.read()
    mem = m.members.get(a.rank) if a.rank is not None else None
    if mem is None:
        raise ConfigError(f"job {a.job} has no member with rank {a.rank} (generation {m.generation})")
    rid = uuid.uuid4().hex[:8]
    key = rdzv.keys.inject_request(rid)
    client.put(key, encode({"kind": a.kind, "rank": a.rank, "incarnation": mem.incarnation, "step": step,
                            "time": time.time(), "factor": a.factor, "duration": a.duration}))  # fmt: skip
    _await_taken(client, key, 30.0, f"no agent carried out {a.kind} of rank {a.rank} ({mem.host}) within 30 s: "
                                    "is its `livemig run` alive?")  # fmt: skip
    print(f"injected {a.kind} into rank {a.rank} on {mem.host} (by its agent) at step {step}")
    return 0


def _await_taken(client: EtcdClient, key: str, bound: float, unanswered: str) -> None:
    """A request's key is deleted by whoever carries it out: wait for that, up to bound
    seconds; unanswered, the request goes and the command fails with that line."""
    deadline = time.monotonic() + bound
    while client.get(key) is not None:
        if time.monotonic() > deadline:
            client.delete(key)
            raise ConfigError(unanswered)
        time.sleep(0.05)


def _ask_member(a: argparse.Namespace, client: EtcdClient, rdzv: Rendezvous, step: int) -> int:
    """wedge / break land inside the worker's own step: asked through etcd (keys.inject_self,
    keyed by the process, never a later holder of the rank), taken at its next boundary. The
    worker deletes the request when it takes it: that is the answer waited for here."""
    if a.rank is None:
        raise ConfigError(f"inject {a.kind} needs --rank")
    mem = rdzv.read().members.get(a.rank)
    if mem is None:
        raise ConfigError(f"job {a.job} has no member with rank {a.rank}")
    key = rdzv.keys.inject_self(mem.incarnation)
    client.put(key, encode({"kind": a.kind, "time": time.time()}))
    bound = min(a.timeout, 30.0)
    _await_taken(client, key, bound, f"rank {a.rank} did not take the {a.kind} request within {bound:.0f} s: "
                                     "is it training (livemig status)?")  # fmt: skip
    record_fault(client, rdzv.keys, a.kind, a.rank, step, time.time())
    what = "blocks its training thread" if a.kind == "wedge" else "fails its gradient collective"
    print(f"injected {a.kind} into rank {a.rank} (pid {mem.pid}): it {what} in its next step, after step {step}")
    return 0


def _target_pid(a: argparse.Namespace, rdzv: Rendezvous, client: EtcdClient) -> int:
    if a.pid is not None:
        return a.pid
    m = rdzv.read()
    if a.kind == "coordinator-kill":
        kv = client.get(rdzv.keys.leader)
        if kv is None:
            raise ConfigError(f"job {a.job} has no coordinator leader right now")
        parts = kv.value.decode().split("-")  # coordinator-HOST-PID-RANDOM
        _local("-".join(parts[1:-2]), "the leader coordinator")
        return int(parts[-2])
    if a.kind in ("spare-kill", "spare-hang"):
        # the spare a recovery in flight claimed, else one in standby (never a member)
        kvs, _ = client.get_prefix(rdzv.keys.prefix)
        claimed = [mem for mem in in_flight_spares(rdzv.keys, {kv.key: kv for kv in kvs}, m) if mem.pid]
        if claimed:
            _local(claimed[0].host, "the claimed spare")
            return claimed[0].pid
        kvs, _ = client.get_prefix(rdzv.keys.spares_prefix)
        for kv in kvs:
            info = decode(kv.value)
            _local(info.get("host", ""), "the spare")
            return int(info["pid"])
        raise ConfigError(f"job {a.job} has no spare")
    if a.kind == "etcd-kill":
        ports = sorted({int(u.rsplit(":", 1)[1]) for e in client.raw.members for u in e.client_urls})
        if a.member >= len(ports):
            raise ConfigError(f"etcd has {len(ports)} member(s); --member {a.member} does not exist")
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == ports[a.member] and c.pid:
                return c.pid
        raise ConfigError(f"etcd member {a.member} (port {ports[a.member]}) is not a process on this machine")
    if a.rank is None:
        raise ConfigError(f"inject {a.kind} needs --rank")
    mem = m.members.get(a.rank)
    if mem is None:
        raise ConfigError(f"job {a.job} has no member with rank {a.rank} (generation {m.generation})")
    _local(mem.host, f"rank {a.rank}")
    return mem.pid


def cmd_inject(a: argparse.Namespace) -> int:
    job = validate_job_name(a.job)
    if a.kind in ("spare-kill", "spare-hang", "coordinator-kill", "etcd-kill") and a.rank is not None:
        raise ConfigError(f"inject {a.kind} takes no --rank: it targets a spare, the leader or an etcd member")
    client = connect(job, a.etcd, timedelta(seconds=a.etcd_timeout))
    rdzv = Rendezvous(client, job)
    keys = rdzv.keys
    f = Fault(a.kind if a.kind != "resume" else "hang", a.rank, a.at_step, a.during or "")
    require_live_job(client, job)  # a job etcd does not hold: one line now, not the --timeout wait
    deadline = time.monotonic() + a.timeout
    armed = None
    while True:
        kvs, _ = client.get_prefix(keys.prefix)
        by_key = {kv.key: kv for kv in kvs}
        step = step_reached(keys, f, by_key)
        if step >= a.at_step:
            armed = armed or time.time()
            if not a.during or phase_reached(keys, f, by_key, armed):
                break
        if time.monotonic() > deadline:
            raise ConfigError(f"step {a.at_step}{' / phase ' + a.during if a.during else ''} not reached "
                              f"within {a.timeout:.0f}s")  # fmt: skip
        time.sleep(0.01)
    if a.kind in ("wedge", "break"):
        return _ask_member(a, client, rdzv, step)
    if a.kind == "corrupt":
        if a.rank is None:
            raise ConfigError("inject corrupt needs --rank (the member whose next served chunk is altered)")
        mem = rdzv.read().members.get(a.rank)
        if mem is None:
            raise ConfigError(f"job {a.job} has no member with rank {a.rank}")
        client.put(keys.inject_self(mem.incarnation), encode({"kind": "corrupt", "time": time.time()}))
        print(f"rank {a.rank} will corrupt the next chunk it serves")
        return 0
    if a.kind in ("kill", "hang", "resume", "slow") and a.pid is None and a.rank is not None:
        mem = rdzv.read().members.get(a.rank)
        if a.via_agent or (mem is not None and not _is_local(mem.host)):
            return _via_agent(a, client, rdzv, step)
    pid = _target_pid(a, rdzv, client)
    sig = {"hang": signal.SIGSTOP, "spare-hang": signal.SIGSTOP, "resume": signal.SIGCONT}.get(a.kind, signal.SIGKILL)
    try:
        if a.kind == "slow":
            print(f"slowing pid {pid} {a.factor:g}x for {a.duration:g}s", flush=True)
            end = time.monotonic() + a.duration
            while time.monotonic() < end:
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.1 / a.factor)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.1 - 0.1 / a.factor)
            os.kill(pid, signal.SIGCONT)
        else:
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                _until_stopped(pid)
    except ProcessLookupError:
        raise ConfigError(f"process {pid} no longer exists") from None
    if a.kind not in ("resume", "slow", "spare-hang"):  # a stopped spare starts no downtime
        record_fault(client, keys, a.kind, a.rank, step, time.time())
    print(f"injected {a.kind} into pid {pid} at step {step}")
    return 0


def _until_stopped(pid: int, timeout: float = 2.0) -> None:
    """A signal is delivered asynchronously: return once the process is stopped, so what the
    command reports has happened (a caller that then reads the process sees it stopped)."""
    import psutil

    end = time.monotonic() + timeout
    try:
        proc = psutil.Process(pid)
        while proc.status() != psutil.STATUS_STOPPED and time.monotonic() < end:
            time.sleep(0.005)
    except psutil.NoSuchProcess:
        raise ProcessLookupError(pid) from None
