"""`livemig inject kill|hang|resume --job J --rank R [--at-step S]`: signal
the process holding a rank, from another shell on the same machine."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from datetime import timedelta

from livemig.config import validate_job_name
from livemig.errors import ConfigError
from livemig.jobs import resolve_etcd
from livemig.launch import record_fault
from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.membership import Rendezvous

SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "resume": signal.SIGCONT}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inject", help="inject a fault into a running job's rank")
    p.add_argument("kind", choices=sorted(SIGNALS))
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--at-step", type=int, help="wait until the rank has committed this step")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting for --at-step after this, s")
    p.add_argument("--pid", type=int, help="signal this pid instead (e.g. to resume a fenced process)")
    p.add_argument("--etcd")
    p.add_argument("--etcd-timeout", type=float, default=5.0)
    p.set_defaults(fn=cmd_inject)


def cmd_inject(a: argparse.Namespace) -> int:
    job = validate_job_name(a.job)
    client = EtcdClient(resolve_etcd(job, a.etcd), timedelta(seconds=a.etcd_timeout))
    rdzv = Rendezvous(client, job)
    step = -1
    if a.at_step is not None:
        deadline = time.monotonic() + a.timeout
        while True:
            kv = client.get(rdzv.keys.progress(a.rank))
            step = decode(kv.value)["step"] if kv else -1
            if step >= a.at_step:
                break
            if time.monotonic() > deadline:
                raise ConfigError(f"rank {a.rank} did not reach step {a.at_step} within {a.timeout:.0f}s")
            time.sleep(0.005)
    pid = a.pid
    if pid is None:
        m = rdzv.read()
        mem = m.members.get(a.rank)
        if mem is None:
            raise ConfigError(f"job {job} has no member with rank {a.rank} (generation {m.generation})")
        if mem.host and mem.host != socket.gethostname():
            raise ConfigError(f"rank {a.rank} runs on host {mem.host}: run inject there")
        pid = mem.pid
    try:
        os.kill(pid, SIGNALS[a.kind])
    except ProcessLookupError:
        raise ConfigError(f"process {pid} of rank {a.rank} no longer exists") from None
    if a.kind != "resume":
        record_fault(client, rdzv.keys, a.kind, a.rank, step, time.time())
    print(f"injected {a.kind} into rank {a.rank} (pid {pid}) at step {step}")
    return 0
