"""Settings: environment variable names and documented defaults.

Every wait in livemig takes its limit from here so that it is configurable
in one place; docs/operations.md lists the same table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from datetime import timedelta
from enum import StrEnum
from typing import Any

from livemig.errors import ConfigError


class Role(StrEnum):
    """What a livemig process is (LIVEMIG_ROLE; a member's table entry; the agent's children).
    A str: it goes over etcd and into reports as its value."""

    WORKER = "worker"
    SPARE = "spare"
    COORDINATOR = "coordinator"
    LOCAL = "local"  # the script run by hand: a world of one, no etcd


ENV_ETCD = "LIVEMIG_ETCD"  # comma-separated http://host:port endpoints
ENV_JOB = "LIVEMIG_JOB"
ENV_ETCD_BIN = "LIVEMIG_ETCD_BIN"
ENV_LEASE_TTL = "LIVEMIG_LEASE_TTL"
ENV_ETCD_TIMEOUT = "LIVEMIG_ETCD_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT = "LIVEMIG_COLLECTIVE_TIMEOUT"
ENV_RECOVERY_TIMEOUT = "LIVEMIG_RECOVERY_TIMEOUT"
ENV_SPARE_WAIT = "LIVEMIG_SPARE_WAIT"
ENV_OUTAGE_BUDGET = "LIVEMIG_ETCD_OUTAGE_BUDGET"
ENV_OUTAGE_GRACE = "LIVEMIG_ETCD_OUTAGE_GRACE"
ENV_STATE_DIR = "LIVEMIG_STATE_DIR"
ENV_GRAD_VIEWS = "LIVEMIG_GRAD_VIEWS"  # 0: .grad is a copy of the bucket's average, not a view into it

# Names read elsewhere, defined here so that every LIVEMIG_* setting is in one file
# (docs/operations.md lists them all).
ENV_CA = "LIVEMIG_ETCD_CA"
ENV_CERT = "LIVEMIG_ETCD_CERT"
ENV_KEY = "LIVEMIG_ETCD_KEY"
ENV_USER = "LIVEMIG_ETCD_USER"
ENV_PASSWORD_FILE = "LIVEMIG_ETCD_PASSWORD_FILE"
ENV_SHADOW_STEPS = "LIVEMIG_SHADOW_STEPS"
ENV_FOLLOW = "LIVEMIG_FOLLOW"  # 1: this spare follows the job's replicated state (--follow, runtime/follow.py)
ENV_FOLLOW_LAG = "LIVEMIG_FOLLOW_LAG"  # steps a follower may fall behind before it drops to warm (4)
ENV_LAZY_INIT = "LIVEMIG_LAZY_INIT"  # 0: a claimed spare builds its model with every random fill run (1)
ENV_FOLLOW_RETRY = "LIVEMIG_FOLLOW_RETRY_S"  # seconds a dropped follower waits before it follows again (30)
ENV_LOCAL_MAX_MB = "LIVEMIG_LOCAL_STATE_MAX_MB"  # per-rank local state (buffers + local=) mirrored each step
ENV_SHRUNK_BOUND = "LIVEMIG_VERIFY_SHRUNK_BOUND"  # --verify of a shrunk run: |run - ref| <= this x max|param|
ENV_VERIFY_DIR = "LIVEMIG_VERIFY_DIR"  # --verify: each rank's final values, for a shrunk run's bound (cli/run.py)
ENV_STEP_PRINTS = "LIVEMIG_STEP_PRINTS"  # 1: per-step state fingerprints in the final record (set by --verify)
ENV_PRELOOP_MAX_MB = "LIVEMIG_PRELOOP_MAX_MB"  # per-rank results of collectives before the loop, recorded (1)
ENV_FAULT_GATE = "LIVEMIG_FAULT_GATE"
ENV_FAULT_PLAN = "LIVEMIG_FAULT_PLAN"
ENV_GATE_TIMEOUT = "LIVEMIG_FAULT_GATE_TIMEOUT"
ENV_ENCRYPT = "LIVEMIG_TRANSFER_ENCRYPT"
ENV_VERIFIERS = "LIVEMIG_TRANSFER_VERIFIERS"
ENV_REDUCE = "LIVEMIG_ZERO1_REDUCE"  # "allreduce" (default on gloo) or "reduce_scatter" (default on nccl)
ENV_KEEP_RUNS = "LIVEMIG_KEEP_RUNS"  # run log directories kept under the state dir (default 20)
ENV_JOIN_TIMEOUT = "LIVEMIG_JOIN_TIMEOUT"  # every node of a run joins within this, s (default 300)
ENV_LAUNCH_ID = "LIVEMIG_LAUNCH_ID"  # `livemig run --launch-id`'s default (agent/nodes.py join_run)
ENV_FENCED_KILL_S = "LIVEMIG_FENCED_KILL_S"  # an agent kills a fenced child still running after this, s (default 5)
ENV_KILLED_WAIT_S = "LIVEMIG_KILLED_WAIT_S"  # an ending agent waits this long for a SIGKILLed child, s (default 5)
ENV_LOG_LEVEL = "LIVEMIG_LOG_LEVEL"

JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def validate_job_name(job: str) -> str:
    if not isinstance(job, str) or not JOB_NAME_RE.match(job):
        raise ConfigError(
            f"invalid job name {job!r}: use 1-63 characters from [A-Za-z0-9_.-], starting with a letter or digit"
        )
    return job


def env_mib(name: str, default: str) -> int:
    """A size setting given in MiB (fractions allowed), in bytes; anything else is one line."""
    raw = os.environ.get(name, default)
    try:
        return int(float(raw) * 2**20)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of MiB") from None


def _env_seconds(name: str, default: float) -> timedelta:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return timedelta(seconds=default)
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds; set e.g. {name}=5") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be > 0 seconds")
    return timedelta(seconds=value)


def env_seconds(name: str, default: float) -> float:
    """A setting in seconds read when used, not at import (a test or an operator may set it for
    one process): the default when unset, refused with one line when not a positive number."""
    return _env_seconds(name, default).total_seconds()


SPARE_WAIT_SHARE = 0.8  # the share of the recovery timeout a spare is waited for at most (Timeouts.spare_wait_s)


@dataclass(frozen=True)
class Timeouts:
    """Every limit livemig waits on.

    lease_ttl: a registration (worker, spare, coordinator) vanishes this long
        after its process stops renewing it; bounds detection of a lost node
        and the time a fenced process may still believe it is alive. etcd
        leases are whole seconds, so it is rounded up. Default 5 s.
    etcd: one etcd call, retries across endpoints included. Default 5 s.
    collective: the watchdog aborts a collective (or a process-group build)
        that has not finished after this long. Default 30 s.
    recovery: a member waits this long for the coordinator to finish a
        recovery before giving up. Default 120 s.
    spare_wait: with no warm spare, the coordinator waits this long for one
        before failing the job, at most `SPARE_WAIT_SHARE` (0.8) x `recovery` (`spare_wait_s`). Default 60 s.
    etcd_outage: while every etcd endpoint is unreachable, members train on
        in their group (docs/reliability.md, "etcd outages") for at most this
        long; then they stop as fenced. Waits on etcd during an outage end
        after it too, not after `recovery`. Default 60 s.
    """

    lease_ttl: timedelta = timedelta(seconds=5)
    etcd: timedelta = timedelta(seconds=5)
    collective: timedelta = timedelta(seconds=30)
    recovery: timedelta = timedelta(seconds=120)
    spare_wait: timedelta = timedelta(seconds=60)
    etcd_outage: timedelta = timedelta(seconds=60)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, timedelta) and v.total_seconds() <= 0:
                raise ConfigError(f"timeout {f.name} must be > 0 s, got {v.total_seconds()}")

    @property
    def spare_wait_s(self) -> float:
        """The spare wait the coordinator applies: at most SPARE_WAIT_SHARE x the recovery timeout, so that it
        fails the job saying no spare came before the members, waiting as long for the recovery,
        give up first and the job ends blaming the coordinator instead."""
        return min(self.spare_wait.total_seconds(), SPARE_WAIT_SHARE * self.recovery.total_seconds())

    @property
    def lease_ttl_s(self) -> int:
        return max(1, int(-(-self.lease_ttl.total_seconds() // 1)))

    @classmethod
    def from_env(cls) -> Timeouts:
        return cls(
            lease_ttl=_env_seconds(ENV_LEASE_TTL, 5),
            etcd=_env_seconds(ENV_ETCD_TIMEOUT, 5),
            collective=_env_seconds(ENV_COLLECTIVE_TIMEOUT, 30),
            recovery=_env_seconds(ENV_RECOVERY_TIMEOUT, 120),
            spare_wait=_env_seconds(ENV_SPARE_WAIT, 60),
            etcd_outage=_env_seconds(ENV_OUTAGE_BUDGET, 60),
        )

    def to_env(self) -> dict[str, str]:
        """The same settings as environment variables, for child processes."""
        return {
            ENV_LEASE_TTL: str(self.lease_ttl.total_seconds()),
            ENV_ETCD_TIMEOUT: str(self.etcd.total_seconds()),
            ENV_COLLECTIVE_TIMEOUT: str(self.collective.total_seconds()),
            ENV_RECOVERY_TIMEOUT: str(self.recovery.total_seconds()),
            ENV_SPARE_WAIT: str(self.spare_wait.total_seconds()),
            ENV_OUTAGE_BUDGET: str(self.etcd_outage.total_seconds()),
        }


# Set by `livemig run` / `livemig-spare start` for the processes they start.
ENV_ROLE = "LIVEMIG_ROLE"  # "worker" or "spare"
ENV_RANK = "LIVEMIG_RANK"
ENV_WORLD_SIZE = "LIVEMIG_WORLD_SIZE"
ENV_SPARE_ID = "LIVEMIG_SPARE_ID"
ENV_INCARNATION = "LIVEMIG_INCARNATION"
ENV_HOST = "LIVEMIG_HOST"  # address peers reach this process at (default 127.0.0.1)
ENV_NODE_RANK = "LIVEMIG_NODE_RANK"  # the node rank of the agent that started this process
# --node-leases: workers register under their agent's node lease (one keep-alive per node, not
# per rank); the agent writes the lease id to this file (again after an etcd outage re-attach)
ENV_NODE_LEASES = "LIVEMIG_NODE_LEASES"  # "1": `livemig run --node-leases`' default
ENV_NODE_LEASE_FILE = "LIVEMIG_NODE_LEASE_FILE"
ENV_BUDDY_STRIDE = "LIVEMIG_BUDDY_STRIDE"  # a rank's mirror (local state, ZeRO-1 shard) is rank + this
ENV_BACKEND = "LIVEMIG_BACKEND"  # "gloo" or "nccl" (default: livemig/device.py default_backend)
# how a generation's groups are formed: "swap" (default) or "reconfigure" (comm/communicator.py)
ENV_COMM = "LIVEMIG_COMM"
# "0": NCCL picks its algorithm and protocol per communicator (default: pinned, device.py)
ENV_NCCL_EXACT = "LIVEMIG_NCCL_EXACT"
ENV_ZERO1_MIRROR = "LIVEMIG_ZERO1_MIRROR"  # "0": no mirror of ZeRO-1 shards (benchmarks; a lost shard is fatal)
ENV_FSDP2_MIRROR = "LIVEMIG_FSDP2_MIRROR"  # 0: no mirror of each FSDP2 shard (default: on for plain FSDP)
# "0": a spare in standby warms its FSDP2 code on a mesh of one instead of the job's mesh shape
# (runtime/fsdp2_mesh.py, "A spare's warm-up on the job's mesh"; default 1)
ENV_SPARE_MESH = "LIVEMIG_SPARE_MESH"
# "0": every worker and spare is a fresh `python SCRIPT` instead of a fork of the agent's zygote,
# which imported torch once (agent/zygote.py; default 1)
ENV_PREFORK = "LIVEMIG_PREFORK"
# "1": members add to their progress records what the agent's --metrics-port reads (the first
# commit of their group and the last before it, the median step); set by the agent, off by default
ENV_METRICS = "LIVEMIG_METRICS"
# checkpoints (livemig/checkpoint_dir.py, runtime/checkpoint.py, coordinator/cold.py)
ENV_CHECKPOINT_DIR = "LIVEMIG_CHECKPOINT_DIR"
ENV_CHECKPOINT_EVERY = "LIVEMIG_CHECKPOINT_EVERY"
ENV_CHECKPOINT_KEEP = "LIVEMIG_CHECKPOINT_KEEP"
ENV_CHECKPOINT_INTERVAL = "LIVEMIG_CHECKPOINT_INTERVAL"  # checkpoint every SECONDS instead (--checkpoint-interval)
ENV_CHECKPOINT_PROBE = "LIVEMIG_CHECKPOINT_PROBE_STEPS"  # --checkpoint-interval is checked every N steps (10)
ENV_RESUME_PATH = "LIVEMIG_RESUME_PATH"  # the checkpoint step directory a worker loads before its first step
ENV_CHECKPOINT_WRITE_TIMEOUT = "LIVEMIG_CHECKPOINT_WRITE_TIMEOUT"  # s a checkpoint waits for the previous write (600)
ENV_CHECKPOINT_FAIL_WRITE = "LIVEMIG_CHECKPOINT_FAIL_WRITE"  # a test hook: "R:S" fails rank R's write of step S
ENV_MAX_RESTARTS = "LIVEMIG_MAX_RESTARTS"  # cold restarts a job may take (--max-restarts, default 3)
ENV_MIN_NPROC = "LIVEMIG_MIN_NPROC"  # shrink: the fewest ranks a job trains on (--min-nproc; default the world)
ENV_SHRINK_WAIT = "LIVEMIG_SHRINK_WAIT"  # shrink: the wait for a warm spare before it, s (--shrink-wait, 5)
# shrink, for comparison only (bench downtime's torchft_style row): "1" drops the lost ranks'
# batches and averages over the survivors, as torchft does; the run is then not the configured one
ENV_SHRINK_DROP = "LIVEMIG_SHRINK_DROP"


def shrink_settings(world: int) -> tuple[int, float]:
    """(min_nproc, shrink_wait_s): a job that loses a rank with no warm spare within
    shrink_wait trains on the survivors while at least min_nproc of them remain
    (runtime/virtual.py). min_nproc defaults to the world size: no shrink."""
    raw = os.environ.get(ENV_MIN_NPROC, "")
    n = int(raw) if raw.strip().isdigit() else world
    if not 1 <= n <= world:
        raise ConfigError(f"--min-nproc {n}: expected 1..{world} (the world size)")
    wait = os.environ.get(ENV_SHRINK_WAIT, "")
    try:
        w = float(wait) if wait else 5.0
    except ValueError:
        raise ConfigError(f"{ENV_SHRINK_WAIT}={wait!r}: expected seconds") from None
    if w < 0:
        raise ConfigError(f"--shrink-wait {w:g}: expected 0 or more seconds")
    return n, w


ENV_RECOVERY = "LIVEMIG_RECOVERY"  # live (default) or cold: every failure restarts from a checkpoint (--recovery)
ENV_STRAGGLER_FACTOR = "LIVEMIG_STRAGGLER_FACTOR"  # > 0 turns the straggler hook on (e.g. 1.5)
ENV_STRAGGLER_STEPS = "LIVEMIG_STRAGGLER_STEPS"  # consecutive slow steps before a migration (default 20)
# Seconds a rank may hold the others waiting in a collective before it is replaced as hung
# (default: max(5, 10 x the median step time); docs/reliability.md).
ENV_HANG_TIMEOUT = "LIVEMIG_HANG_TIMEOUT"
ENV_PROBE_TIMEOUT = "LIVEMIG_PROBE_TIMEOUT"  # a peer probe's TCP connect (link attribution), default 1 s
# Progress records the whole job may write to etcd per second (default 2000): each member
# writes at most one per world_size / budget seconds, the newest winning meanwhile.
ENV_PROGRESS_BUDGET = "LIVEMIG_PROGRESS_BUDGET"
PROGRESS_BUDGET = 2000.0


def progress_budget() -> float:
    """Progress writes a second for the whole job: a member writes at most one per
    world_size / budget seconds. Members publish each commit, and at scale those writes
    are most of etcd's writes (10,000 ranks at 5 steps a second: 50,000 a second, each
    watched by the coordinator); the budget bounds them (issue 54: <= 5,000 etcd writes a
    second at 10,000 ranks) while leaving a small job's records per step (2 ranks: one per
    ms). A sample is enough for what reads them: what the coordinator acts on goes out at
    once, outside the budget (a failed or long wait in a collective, which the hang and link
    checks read; a busy pause; a member's first commit in a new group, which measures the
    recovery); a record carries the compute times of every step since the last one written
    (the straggler hook); step-triggered test faults fire late by up to world / budget
    seconds (5 s at 10,000 ranks)."""
    raw = os.environ.get(ENV_PROGRESS_BUDGET, "")
    try:
        budget = float(raw) if raw else PROGRESS_BUDGET
    except ValueError:
        raise ConfigError(f"{ENV_PROGRESS_BUDGET}={raw!r} is not a number of writes a second; set e.g. 10000") from None
    if not budget > 0:
        raise ConfigError(f"{ENV_PROGRESS_BUDGET}={raw!r} must be > 0 writes a second")
    return budget


SHARDING_ENTRY = "<sharding>"  # the signature entry that names a job's optimizer sharding
LOCAL_STATE_ENTRY = "<local-state>"  # the signature entry of a job with rank-local state (buffers, local=)
# Faults injected from inside a worker, for tests and `--fault ...:during=...`:
# "selfkill:step=S:at=allreduce" or "drop_avg:step=S" (see livemig/faults.py).
ENV_SELF_FAULT = "LIVEMIG_SELF_FAULT"
ENV_PARENT_PID = "LIVEMIG_PARENT_PID"  # exit when this process (the launcher) is gone
ENV_FAST_EXIT = "LIVEMIG_FAST_EXIT"  # "0": a finished worker's interpreter collects its garbage at exit


def fast_exit(role: str) -> None:
    """Once a launched worker or spare has seen its job end, skip the interpreter's last
    garbage collection at exit: with torch (and torch._dynamo, which the first optimizer
    imports) loaded it takes ~0.5 s, and the job is not over until every process is gone.
    Objects are still freed by reference count (files close, buffers flush); only
    unreachable cycles are left to the OS, which Python does not promise to finalise at
    exit either. A plain `python train.py` (role local) is left alone; LIVEMIG_FAST_EXIT=0
    turns it off."""
    import atexit
    import gc

    if role in (Role.WORKER, Role.SPARE) and os.environ.get(ENV_FAST_EXIT, "1") not in ("0", "false", "no"):
        atexit.register(gc.freeze)


def exit_with_parent() -> None:
    """If started by a launcher, exit as soon as it is gone (even SIGKILLed),
    so no worker, spare or coordinator outlives the run that started it."""
    import threading
    import time

    raw = os.environ.get(ENV_PARENT_PID)
    if not raw:
        return
    parent = int(raw)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(70)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="livemig-parent-watch").start()


def make_interruptible() -> None:
    """Let SIGINT stop this process even if it was started with SIGINT ignored.

    A non-interactive shell starts a background job (`livemig run ... &` in a
    script, a CI step, a supervisor) with SIGINT set to SIG_IGN, and Python
    then never installs its KeyboardInterrupt handler: `kill -INT` would do
    nothing, and the embedded etcd (whose guard only sees its parent die)
    would live on with it. Processes that own an embedded etcd or supervise
    workers therefore take SIGINT back, as torchrun does. Only from the main
    thread (the only one that may set handlers), and only over SIG_IGN: a
    handler the application installed is left alone.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def metrics_on() -> bool:
    """Do the members publish the figures of the agent's metrics endpoint (ENV_METRICS)?"""
    return os.environ.get(ENV_METRICS, "") == "1"


def straggler_settings() -> tuple[float, int]:
    """(factor, steps) of the coordinator's straggler hook; factor 0 = off (the default)."""
    try:
        factor = float(os.environ.get(ENV_STRAGGLER_FACTOR, "0") or 0)
        steps = int(os.environ.get(ENV_STRAGGLER_STEPS, "20") or 20)
    except ValueError as exc:
        raise ConfigError(f"{ENV_STRAGGLER_FACTOR}/{ENV_STRAGGLER_STEPS}: not a number ({exc})") from exc
    return factor, max(1, steps)


ENV_ON_ERROR = "LIVEMIG_ON_ERROR"  # "fail" (default) or "replace:N"


def on_error_policy(raw: str | None = None) -> tuple[str, int]:
    """What an exception in the training function does: ("fail", 0) ends the job at once;
    ("replace", N) recovers on a spare, at most N times (runtime/bugs.py)."""
    raw = (raw if raw is not None else os.environ.get(ENV_ON_ERROR, "fail")) or "fail"
    if raw == "fail":
        return "fail", 0
    kind, _, n = raw.partition(":")
    if kind != "replace" or not (n or "1").isdigit():
        raise ConfigError(f"{ENV_ON_ERROR}={raw!r} / --on-error: expected fail or replace:N (N retries)")
    return "replace", int(n or 1)


def outage_grace_s(timeouts: Timeouts) -> float:
    """LIVEMIG_ETCD_OUTAGE_GRACE, else 2 x the lease TTL: how long after its own last
    failed etcd call the coordinator waits for members to re-attach expired leases."""
    raw = os.environ.get(ENV_OUTAGE_GRACE, "")
    return _env_seconds(ENV_OUTAGE_GRACE, 0).total_seconds() if raw else 2.0 * timeouts.lease_ttl_s


def is_host_port(v: object) -> bool:
    """host:port, as a store address read from etcd must be (anyone with etcd access can write one)."""
    if not isinstance(v, str) or ":" not in v:
        return False
    host, _, port = v.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def node_host() -> str:
    """This process's host as the job knows it: --host ($LIVEMIG_HOST), else the hostname."""
    import socket

    return os.environ.get(ENV_HOST) or socket.gethostname()


def node_rank() -> int | None:
    """The node rank of the agent that started this process (None: a standby host's spare)."""
    raw = os.environ.get(ENV_NODE_RANK, "")
    return int(raw) if raw.isdigit() else None


def buddy_stride(world: int, stride: int | None = None) -> int:
    """How far a rank's buddy is: its local state and ZeRO-1 shard are mirrored on rank +
    stride, mirrors of rank - stride are held. 1 on one node; nproc_per_node in a job of
    several nodes (set by the agents, and by livemig-spare from the run), so a buddy is on
    the next node and a lost node never takes both copies. Falls back to 1 when the value
    does not fit the world (a mirror on oneself)."""
    if stride is None:
        raw = os.environ.get(ENV_BUDDY_STRIDE, "")
        stride = int(raw) if raw.isdigit() else 1
    return stride if 0 < stride < world and world % stride == 0 else 1


def buddy_of(rank: int, world: int) -> int:
    """The rank that mirrors `rank`'s local state and shard (its right neighbour)."""
    return (rank + buddy_stride(world)) % world


def left_of(rank: int, world: int) -> int:
    """The rank whose local state and shard `rank` mirrors (its left neighbour)."""
    return (rank - buddy_stride(world)) % world


def zero1_layout(world: int, carried: dict[int, int] | None = None, stride: int = 1,
                 mirrored: bool = True) -> dict[int, tuple[int, int | None]]:  # fmt: skip
    """ZeRO-1 shard s -> (the member that owns it, the member that mirrors it or None).

    At full width rank s owns shard s and rank s + stride mirrors it (comm/zero1.py). In a
    shrunk job (`carried`: virtual rank -> its carrier) the carrier owns the shards of the
    ranks it carries, and a shard's mirror is the member running the next virtual rank
    (s + stride, s + 2*stride, ..., then s + 1, ...) that is not its owner: every shard keeps
    a copy on a second process as long as two remain. A function of the membership alone,
    so the coordinator, every member and a spare agree on it without a word exchanged."""
    carried = carried or {}
    stride = buddy_stride(world, stride)

    def host(v: int) -> int:
        return carried.get(v, v)

    out: dict[int, tuple[int, int | None]] = {}
    for s in range(world):
        owner = host(s)
        walk = [(s + k * stride) % world for k in range(1, world)] + [(s + k) % world for k in range(1, world)]
        mirror = next((host(v) for v in walk if host(v) != owner), None) if mirrored else None
        out[s] = (owner, mirror)
    return out


def stride_of(run: dict[str, Any] | None) -> int:
    """The buddy stride of a run record (buddy_stride): nproc_per_node with several nodes.
    Here, not in the agent that writes the record: the coordinator and livemig-spare read it."""
    run = run or {}
    nnodes, per = run.get("nnodes"), run.get("nproc_per_node")
    return per if isinstance(nnodes, int) and nnodes > 1 and isinstance(per, int) and per > 0 else 1
