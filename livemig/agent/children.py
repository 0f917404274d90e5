"""What every agent does for the processes it started (`livemig run` for workers
and spares, `livemig-spare start` for a spare on a standby host).

- A child that died is reported at once as a suspect: the fast detection path
  (a lease would take its TTL). Deaths seen while etcd is unreachable are
  reported once it answers, with the time they were seen.
- A fenced child still running FENCED_KILL_S after its fence is wedged (its
  training thread cannot see the fence): it is killed, so no replaced process
  lingers (docs/reliability.md).
- Once the agent has reaped a fenced child it removes the fence key: only it
  knows the process can no longer write (a bounded etcd footprint).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from livemig.config import ENV_FENCED_KILL_S, ENV_KILLED_WAIT_S, Role, env_seconds
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.keys import JobKeys

log = logging.getLogger("livemig.agent")
# A fenced process that has not exited this long after its fence is wedged: its agent kills it.
FENCED_KILL_S = 5.0  # default of $LIVEMIG_FENCED_KILL_S


def fenced_kill_s() -> float:
    return env_seconds(ENV_FENCED_KILL_S, FENCED_KILL_S)


def report_death(client: EtcdClient, keys: JobKeys, incarnation: str, name: str, code: int, seen: float) -> None:
    """The suspect record of a child that exited with `code` (raises while etcd is away)."""
    why = f"signal {-code}" if code < 0 else f"exit code {code}"
    client.put(keys.suspect(incarnation), encode({"time": seen, "reason": f"{name} exited ({why})", "by": "agent"}))
    log.warning("child died", extra={"child": name, "why": why})


# How long an agent waits for a child it SIGKILLed to be reported gone before it exits anyway (a
# zygote child's exit reaches the agent through the zygote): an agent never hangs at its end.
KILLED_WAIT_S = 5.0  # default of $LIVEMIG_KILLED_WAIT_S


def killed_wait_s() -> float:
    return env_seconds(ENV_KILLED_WAIT_S, KILLED_WAIT_S)


def kill_group(pid: int, name: str, say: bool = True) -> None:
    if say:
        log.warning("fenced child still running: killed", extra={"child": name})
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def fenced_too_long(first_seen: dict[str, float], incarnation: str) -> bool:
    """Record when a child's fence was first seen; True once FENCED_KILL_S passed."""
    now = time.monotonic()
    return now - first_seen.setdefault(incarnation, now) > fenced_kill_s()


@dataclass
class Child:
    """One process an agent started, and what the agent knows of it."""

    name: str
    role: Role
    incarnation: str
    proc: subprocess.Popen
    log_path: str
    reported: bool = False
    rank: int | None = None
    died_at: float | None = None  # when the agent first saw it dead (reported once etcd answers)
    started: float = field(default_factory=time.monotonic)
    stopped: bool = False  # SIGSTOPped by the fault plan's `slow` (agent/fault_driver.py)


class Agent(Protocol):
    """What an agent's collaborators (FaultDriver, ChildWatch) use of it: the Launcher is
    one. A protocol, so they need not import the launcher that composes them."""

    cfg: Any
    client: Any
    keys: Any
    children: list[Child]
    cluster: Any
    partition: Any
    faults: Any
    watch: Any
    spares_started: bool
    node_lease_file: str

    def say(self, msg: str) -> None: ...

    def spawn_spares(self) -> None: ...
