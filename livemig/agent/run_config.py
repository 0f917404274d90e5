"""What `livemig run` (or a bench) asks of one run: the script, the world, the spares, the
faults and every setting, checked as a whole before anything starts (`__post_init__`), so a
bad flag is one line and no process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from livemig.config import (
    ENV_JOIN_TIMEOUT,
    ENV_LAUNCH_ID,
    ENV_NODE_LEASES,
    Timeouts,
    on_error_policy,
    validate_job_name,
)
from livemig.errors import ConfigError
from livemig.faults import Fault


@dataclass
class RunConfig:
    script: str
    args: list[str]
    nproc: int
    spares: int = 0
    follow: int = 0  # --follow K: the first K spares follow the job's state (runtime/follow.py)
    coordinators: int = 1
    job: str = ""
    etcd: str | None = None
    etcd_bin: str | None = None
    etcd_members: int = 1
    faults: list[Fault] = field(default_factory=list)
    report: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts.from_env)
    log_every: int = 10
    quiet: bool = False
    max_wall: float = 3600.0
    cold_spares: bool = False  # start the spares only when the first fault lands (bench warmup)
    on_error: str = ""  # "fail" or "replace:N" (--on-error; default $LIVEMIG_ON_ERROR, else fail)
    nnodes: int = 1  # agents of the job, one per node; nproc is the whole world (nnodes x per node)
    node_rank: int | None = None  # None: the first free node rank (auto)
    host: str | None = None  # address other hosts reach this node at (default: nodes.default_host)
    buddy_stride: int = 0  # mirror rank-local state on rank + this (default: nproc_per_node with nnodes > 1)
    metrics_port: int | None = None  # --metrics-port: serve the job's Prometheus metrics (agent/metrics.py)
    events: str | None = None  # --events FILE: the job's events as JSON lines (agent/events.py)
    checkpoint: Any = None  # checkpoints.Settings: --checkpoint-dir/--checkpoint-every/--checkpoint-keep
    resume_from: str | None = None  # --resume-from DIR: start from the newest complete checkpoint in DIR
    max_restarts: int | None = None  # --max-restarts: cold restarts from a checkpoint (default 3)
    recovery: str = "live"  # --recovery cold: every failure takes the cold path (coordinator/cold.py)
    min_nproc: int | None = None  # --min-nproc: shrink onto the survivors with no spare (runtime/virtual.py)
    shrink_wait: float | None = None  # --shrink-wait: s to wait for a warm spare first (default 5)
    on_sigterm: str = "stop"  # --on-sigterm: drain (hand this node's ranks to the job, agent/drain.py) or stop
    drain_grace: float = 25.0  # --drain-grace: s a drain may take before the job is stopped as before
    # --node-leases: this node's workers register under the agent's lease (one keep-alive per node)
    node_leases: bool = field(default_factory=lambda: os.environ.get(ENV_NODE_LEASES, "") == "1")
    # --launch-id: the launcher's one identity for every agent it starts (a Kubernetes Job's uid):
    # an agent of that launch arriving after its run finished exits 0 instead of starting a new run
    launch_id: str = field(default_factory=lambda: os.environ.get(ENV_LAUNCH_ID, ""))
    # how long to wait for every node of the run to join, s
    join_timeout: float = field(default_factory=lambda: float(os.environ.get(ENV_JOIN_TIMEOUT, "") or 300))

    @property
    def nproc_per_node(self) -> int:
        return self.nproc // self.nnodes

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if not 0 <= self.follow <= self.spares:
            raise ConfigError(f"--follow {self.follow}: expected 0..{self.spares} (the spares started, --spares)")
        if self.nnodes < 1 or self.nproc % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} does not divide the world size {self.nproc}")
        if self.nnodes > 1 and not self.etcd:
            raise ConfigError("--nnodes > 1 needs --etcd URL[,URL...], an etcd every node reaches")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1}")
        if self.spares < 0 or self.coordinators < 1:
            raise ConfigError("--spares must be >= 0 and --coordinators >= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port}: expected a TCP port, 0-65535")
        on_error_policy(self.on_error or None)  # a bad value is refused before anything starts
        if not os.path.isfile(self.script):
            raise ConfigError(f"training script {self.script!r} not found")
        for f in self.faults:  # the whole plan, before anything starts
            if f.rank is not None and f.rank >= self.nproc:
                raise ConfigError(f"fault targets rank {f.rank}, but --nproc is {self.nproc}")
            if f.kind in ("etcd-kill", "etcd-stop", "partition", "link") and self.etcd:
                raise ConfigError(f"a {f.kind} fault needs the embedded etcd (drop --etcd)")
            if f.kind == "etcd-kill" and (self.etcd_members < 2 or f.member >= self.etcd_members):
                raise ConfigError(f"etcd-kill:member={f.member} needs an embedded cluster holding that member: "
                                  f"--etcd-members {max(3, f.member + 1)} (now {self.etcd_members})")  # fmt: skip
        self.job = validate_job_name(self.job or os.path.splitext(os.path.basename(self.script))[0])
