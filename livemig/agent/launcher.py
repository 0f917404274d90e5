"""`livemig run`: start etcd (if none given), a coordinator, N workers and K
spares on this machine; act as their local agent (report a dead child to
etcd at once, inject planned faults); print progress; clean up everything.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from livemig import logs
from livemig.agent import report
from livemig.agent.child_watch import FINE_TICK_S, IDLE_TICK_S, PROBE_S, ChildWatch, Wakeup
from livemig.agent.children import Child, killed_wait_s
from livemig.agent.drain import Drain
from livemig.agent.events import EventLog
from livemig.agent.fault_driver import FaultDriver
from livemig.agent.jobs import (
    claim_job_file,
    prune_runs,
    prune_stale_dirs,
    refuse_duplicate,
    remove_job_file,
    state_dir,
)
from livemig.agent.nodes import default_host, formed
from livemig.agent.run_config import RunConfig
from livemig.agent.zygote import forkable
from livemig.checkpoint_dir import ENV_RESUME
from livemig.config import (
    ENV_BUDDY_STRIDE,
    ENV_ETCD,
    ENV_FAULT_GATE,
    ENV_FAULT_PLAN,
    ENV_FOLLOW,
    ENV_HOST,
    ENV_INCARNATION,
    ENV_JOB,
    ENV_MAX_RESTARTS,
    ENV_METRICS,
    ENV_MIN_NPROC,
    ENV_NODE_LEASE_FILE,
    ENV_NODE_RANK,
    ENV_ON_ERROR,
    ENV_PARENT_PID,
    ENV_PREFORK,
    ENV_RANK,
    ENV_RECOVERY,
    ENV_ROLE,
    ENV_SELF_FAULT,
    ENV_SHADOW_STEPS,
    ENV_SHRINK_WAIT,
    ENV_SPARE_ID,
    ENV_WORLD_SIZE,
    Role,
    make_interruptible,
)  # fmt: skip
from livemig.errors import ConfigError, EtcdUnavailableError, LivemigError
from livemig.fault_gate import plan_env
from livemig.rdzv.client import EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import Membership, new_incarnation
from livemig.rdzv.security import EtcdSecurity
from livemig.rdzv.watch import PrefixMirror
from livemig.rdzv.writes import put_if_absent

log = logging.getLogger("livemig.agent.launcher")


class Launcher:
    """One node's agent of a run: it owns the processes, the etcd client and the keys; its
    fault plan (FaultDriver) and the watch of its children (ChildWatch) are collaborators."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.keys = JobKeys(cfg.job)
        self.children: list[Child] = []
        self.cluster: Any = None
        self.client: EtcdClient | None = None
        self.logdir = os.path.join(state_dir(), "runs", f"{cfg.job}-{int(time.time())}")
        self.partition: Any = None
        self.net_env: dict[str, str] = {}
        self.spares_started = False
        self._outage = False  # etcd unreachable at the last look
        self._by_key: dict = {}  # the last snapshot of the job's keys (faults due during an outage)
        self.node_keeper: Any = None  # this agent's lease: holds its node key
        # --node-leases: where the workers read that lease's id (rdzv/lease.py NodeLease)
        self.node_lease_file = os.path.join(self.logdir, "node-lease") if cfg.node_leases else ""
        self.node_rank = 0
        self.run_id = ""
        # etcd credentials of this run: the embedded etcd's own, else the environment's
        self.security = EtcdSecurity.from_env()
        self._wake = Wakeup()  # what the agent loop sleeps on (agent/child_watch.py Wakeup)
        self._mirror: PrefixMirror | None = None  # the job's keys, watch-fed (supervise)
        self.tmpdir = ""  # the children's TMPDIR (start)
        self._t0 = time.time()
        self._launched = self._t0  # the goodput's launch (metrics and report alike): this agent's start
        self.drain = Drain(self, cfg.drain_grace)  # SIGTERM with --on-sigterm drain (agent/drain.py)
        self.standby_node = False  # joined a run that already trained: spares only (start())
        self.signal_name = "SIGINT"  # what interrupted the run, if anything did
        # collaborators, each owning its state: the fault plan's, the children's watch
        self.faults = FaultDriver(self, cfg.faults, self._wake.poke)
        self.watch = ChildWatch(self)
        self.metrics: Any = None  # the metrics endpoint (--metrics-port), once etcd answers
        self._metrics_env = cfg.metrics_port is not None  # members publish the figures (LIVEMIG_METRICS)
        self.zygote: Any = None  # the pre-imported parent of workers and spares (start; agent/zygote.py)
        self._fresh_seen: set[str] = set()  # the cold path's requests this agent answered
        self._fresh_count = 0
        self.resume = ""  # the checkpoint step directory the workers load (--resume-from; start)
        self.events: EventLog | None = None
        if cfg.events or logging.getLogger("livemig.events").isEnabledFor(logging.INFO):
            self.events = EventLog(cfg.events, cfg.job, self.keys)

    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            logs.say(msg)

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, role: Role, argv: list[str], env: dict[str, str],
               rank: int | None = None) -> Child:  # fmt: skip
        inc = new_incarnation(role, self.net_env.get(ENV_HOST))  # --host names the node, not the hostname
        full = dict(os.environ)
        full.update(self.cfg.timeouts.to_env())
        if self.cfg.on_error:
            full[ENV_ON_ERROR] = self.cfg.on_error
        full.update(EtcdSecurity().to_env_clear())
        full.update(self.security.to_env())
        if self._metrics_env:  # the members add the figures the endpoint reads
            full[ENV_METRICS] = "1"
        if self.cfg.checkpoint is not None:  # a spare that takes a rank writes its part too; the
            full.update(self.cfg.checkpoint.to_env())  # coordinator restarts from them (coordinator/cold.py)
        if role == Role.COORDINATOR and self.cfg.max_restarts is not None:
            full[ENV_MAX_RESTARTS] = str(self.cfg.max_restarts)
        if role == Role.COORDINATOR and self.cfg.min_nproc is not None:
            full[ENV_MIN_NPROC] = str(self.cfg.min_nproc)
        if role == Role.COORDINATOR and self.cfg.shrink_wait is not None:
            full[ENV_SHRINK_WAIT] = str(self.cfg.shrink_wait)
        if role == Role.COORDINATOR and self.cfg.recovery != "live":
            full[ENV_RECOVERY] = self.cfg.recovery
        if self.tmpdir:  # what the child leaves in its temporary directory goes with the run
            full["TMPDIR"] = self.tmpdir
        full.update({ENV_ETCD: self.etcd, ENV_JOB: self.cfg.job, ENV_INCARNATION: inc,
                     ENV_PARENT_PID: str(os.getpid()), **env})  # fmt: skip
        if role in (Role.WORKER, Role.SPARE) and self.cfg.faults:
            full[ENV_FAULT_PLAN] = plan_env(self.cfg.faults)
            if self.faults.gate is not None:
                full[ENV_FAULT_GATE] = self.faults.gate.path
        path = os.path.join(self.logdir, f"{name}.log")
        proc: Any = None
        if self.zygote is not None and role in (Role.WORKER, Role.SPARE) and forkable(argv) and self.zygote.usable():
            try:
                proc = self.zygote.spawn(argv, full, path)
            except OSError as exc:
                log.warning("prefork failed: spawning instead", extra={"child": name, "why": str(exc)})
        if proc is None:
            with open(path, "ab") as logf:
                proc = subprocess.Popen(argv, env=full, stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        child = Child(name, role, inc, proc, path, rank=rank)
        self.children.append(child)
        return child

    def start(self) -> None:
        cfg = self.cfg
        if not cfg.etcd:  # on an external etcd the run's own keys refuse a second run (nodes.attach_node)
            refuse_duplicate(cfg.job)
        self.resume = self._resume_path()  # before any process starts: a bad directory is one line
        os.makedirs(self.logdir, exist_ok=True)
        prune_runs(os.path.dirname(self.logdir))  # the newest LIVEMIG_KEEP_RUNS (20) run logs stay
        # the children's TMPDIR (forkserver sockets, torch's caches), removed at stop: short,
        # under the caller's TMPDIR, as Unix socket paths inside it must stay under 108 bytes
        self.tmpdir = tempfile.mkdtemp(prefix=f"livemig-{cfg.job[:24]}-")
        if os.environ.get(ENV_PREFORK, "1") != "0":  # torch imported once, while etcd starts (agent/zygote.py)
            from livemig.agent.zygote import Zygote

            self.zygote = Zygote({**os.environ, "TMPDIR": self.tmpdir}, self._wake.poke,
                                 os.path.join(self.logdir, "zygote.log"))  # fmt: skip
        part_rank = None
        if cfg.etcd:  # a fault that needs the embedded etcd was refused with the plan (RunConfig)
            self.etcd = cfg.etcd
        else:
            from livemig.rdzv.embedded import EtcdCluster

            part_rank = next((f.rank for f in cfg.faults if f.kind in ("partition", "link")), None)
            if part_rank is not None:
                from livemig.agent.netns import Partition

                self.partition = Partition().setup()
                self.net_env = {ENV_HOST: self.partition.host_ip, "GLOO_SOCKET_IFNAME": self.partition.host_if}
            # secure by default: TLS only, client certificates from a CA made for this run
            tls_root = os.path.join(state_dir(), "tls")
            prune_stale_dirs(tls_root)
            # embedded etcds' data of runs killed by SIGKILL (EtcdCluster.launch: mkdtemp's 8 characters, our pid)
            prune_stale_dirs(tempfile.gettempdir(), r"livemig-etcd-[a-z0-9_]{8}-\d+")
            self.cluster = EtcdCluster(
                cfg.etcd_members, cfg.etcd_bin, extra_host=self.partition.etcd_ip if self.partition else None,
                tls=True, tls_dir=os.path.join(tls_root, f"{cfg.job}-{os.getpid()}"),
                names=[cfg.host] if cfg.host else [],
            ).launch()  # fmt: skip
            self.etcd = self.cluster.endpoints
            self.security = self.cluster.security
        if cfg.etcd and not self.net_env:  # every address another host reaches: --host
            self.net_env = {ENV_HOST: cfg.host or default_host(self.etcd)}
        host = self.net_env.get(ENV_HOST, "127.0.0.1")
        # One node on its own etcd: node rank 0 is certain, so the job's processes start now
        # and import torch while etcd comes up (their first etcd call is seconds away).
        early = self.cluster is not None and cfg.nnodes == 1
        if early:
            self._spawn_job(host, part_rank)
            if not cfg.cold_spares:  # with the workers: warm before a short job's first faults
                self.spawn_spares()
        if self.cluster is not None:
            self.cluster.wait_started()
        self.client = EtcdClient(self.etcd, cfg.timeouts.etcd, self.security)
        if cfg.metrics_port is not None:
            from livemig.agent.metrics import JobMetrics, MetricsServer

            collector = JobMetrics(self.keys, lambda: self._by_key, self.client, launched_at=self._launched)
            self.metrics = MetricsServer(collector, cfg.metrics_port)  # its .port: the one --metrics-port 0 got
            self.say(f"livemig: metrics of job {cfg.job} on http://{host}:{self.metrics.port}/metrics")
        self._join(host, fresh=early)
        claim_job_file(cfg.job, self.etcd, security=self.security)
        ended = None if early else self.client.get(self.keys.result)
        if ended is not None:
            # the run this agent joined ended while it joined (a replacement pod starting as the
            # job finishes): nothing to run; supervise() reads the result and exits with it
            state = (conform(ended.value, {"state": (str,)}) or {}).get("state", "?")
            who = f"node {self.node_rank}" if self.node_rank >= 0 else "this node"
            self.say(f"livemig: job {cfg.job}'s run {self.run_id} ended ({state}) before {who} joined it: "
                     "nothing to start")  # fmt: skip
            return
        if not early and formed(self.client, self.keys):
            # A node joining a run that already trains (a replacement pod of an Indexed Job, a
            # restarted node): its node rank's ranks run elsewhere now, so it brings standby
            # capacity, spares for as many ranks as it would have run, and exits with the job.
            self.standby_node = True
            self.say(f"livemig: job {cfg.job} already trains: node {self.node_rank} joins as "
                     f"{cfg.nproc_per_node} warm spare(s)")  # fmt: skip
            self._spawn_job(host, part_rank, workers=False)
            self.spawn_spares(cfg.nproc_per_node, "join")
        elif not early:
            self._spawn_job(host, part_rank)
        elif self.node_rank != 0:  # pragma: no cover - a fresh etcd of our own has no other node
            raise LivemigError(f"node rank {self.node_rank} on a job's own etcd: expected 0")
        if not cfg.cold_spares and not self.spares_started:  # a spare guards the job from its first step
            self.spawn_spares()
        self.faults.pending = [f for f in cfg.faults if not f.in_process]
        where = f" (node {self.node_rank} of {cfg.nnodes}, {host})" if cfg.nnodes > 1 else ""
        self.say(f"livemig: job {cfg.job}: {cfg.nproc} workers, {cfg.spares} spare(s), etcd {self.etcd}; "
                 f"logs in {self.logdir}{where}")  # fmt: skip

    def _spawn_job(self, host: str, part_rank: int | None, workers: bool = True) -> None:
        """The coordinator candidates and this node's workers."""
        cfg = self.cfg
        self.net_env[ENV_NODE_RANK] = str(self.node_rank)
        stride = cfg.buddy_stride or (cfg.nproc_per_node if cfg.nnodes > 1 else 0)
        if stride:  # a buddy on the next node (config.buddy_stride)
            self.net_env[ENV_BUDDY_STRIDE] = str(stride)
        for i in range(cfg.coordinators):
            self._spawn(f"coordinator-{i}", Role.COORDINATOR,
                        [sys.executable, "-m", "livemig.coordinator", "--etcd", self.etcd, "--job", cfg.job,
                         "--world-size", str(cfg.nproc), "--host", host], dict(self.net_env))  # fmt: skip
        by_rank: dict[int, str] = {}
        for f in cfg.faults:
            if f.in_process and f.rank is not None:
                by_rank[f.rank] = f.self_spec()
        if not workers:
            return
        base = [sys.executable, cfg.script, *cfg.args]
        first = self.node_rank * cfg.nproc_per_node
        resume = self.resume
        for r in range(first, first + cfg.nproc_per_node):
            env = {ENV_ROLE: Role.WORKER, ENV_RANK: str(r), ENV_WORLD_SIZE: str(cfg.nproc)}
            if resume:
                env[ENV_RESUME] = resume
            if r in by_rank:
                env[ENV_SELF_FAULT] = by_rank[r]
            argv = base
            if self.partition is not None and r == part_rank:
                argv = self.partition.wrap(base)
                env.update({ENV_HOST: self.partition.ns_ip, "GLOO_SOCKET_IFNAME": self.partition.ns_if,
                            ENV_ETCD: self.cluster.endpoints_on(self.partition.etcd_ip)})  # fmt: skip
            else:
                env.update(self.net_env)
            if self.node_lease_file:
                env[ENV_NODE_LEASE_FILE] = self.node_lease_file
            self._spawn(f"worker-{r}", Role.WORKER, argv, env, rank=r)

    def _resume_path(self) -> str:
        """--resume-from DIR: the newest complete, intact checkpoint there (each one that is
        not is skipped with a line naming it), chosen once so every worker loads the same.
        Without it, --checkpoint-dir's newest checkpoint of this job, unless the job finished
        after it (checkpoint_dir.resumable): a requeued job goes on where it stopped."""
        from livemig.checkpoint_dir import choose, resumable, step_dir

        ck = self.cfg.checkpoint
        if not self.cfg.resume_from and ck is not None:  # a requeued or restarted job: where it stopped
            mine = resumable(ck.dir, self.cfg.job)
            if mine is not None:
                self.say(f"livemig: resuming from {step_dir(ck.dir, mine[0])}, the newest checkpoint job "
                         f"{self.cfg.job} wrote in --checkpoint-dir ({mine[1]['world']} rank(s); --resume-from picks "
                         "another)")  # fmt: skip
                return step_dir(os.path.abspath(ck.dir), mine[0])
        if not self.cfg.resume_from:
            return ""

        got = choose(self.cfg.resume_from)
        if got is None:
            raise ConfigError(f"--resume-from {self.cfg.resume_from}: no complete checkpoint there "
                              "(written by --checkpoint-dir with --checkpoint-every)")  # fmt: skip
        step, man = got
        self.say(f"livemig: resuming from {step_dir(self.cfg.resume_from, step)} (the boundary of step {step}, "
                 f"{man['world']} rank(s))")  # fmt: skip
        return step_dir(os.path.abspath(self.cfg.resume_from), step)

    def _join(self, host: str, fresh: bool = False) -> None:
        """Create or join the job's run and take a node rank (nodes.attach_node)."""
        from livemig.agent.nodes import RunEnded, attach_node

        assert self.client is not None
        try:
            mine = lambda: {c.incarnation for c in self.children}  # noqa: E731
            follow = self._node_lease_moved if self.node_lease_file else None
            self.node_keeper, self.run_id, self.node_rank = attach_node(
                self.client, self.keys, self.cfg, host, mine, self.say, fresh, follow
            )
        except RunEnded as exc:  # start() reads the run's result and starts nothing
            self.run_id = exc.run_id
            self.node_rank = self.cfg.node_rank if self.cfg.node_rank is not None else -1
            return
        if self.node_lease_file:
            self._node_lease_moved(self.node_keeper.lease_id)
        if self.cfg.nnodes > 1 and not self._metrics_env:  # the run's first agent serves metrics: so do
            kv = self.client.get(self.keys.run)  # this node's members publish the figures it reads
            rec = conform(kv.value, {}, {"metrics": (bool,)}) if kv else None
            self._metrics_env = bool((rec or {}).get("metrics"))

    def _node_lease_moved(self, lease: int) -> None:
        """--node-leases: the lease this node's workers register under (its first, or the one an
        etcd outage re-attach granted: each worker puts its key again under it)."""
        from livemig.rdzv.lease import write_node_lease

        write_node_lease(self.node_lease_file, lease)

    def spawn_spares(self, count: int | None = None, name: str = "spare") -> None:
        """--spares (or `count`) warm spares on this node, named <name>-<i>."""
        cfg = self.cfg
        cold = {ENV_SHADOW_STEPS: "0"} if cfg.cold_spares else {}
        cold.update((ENV_SELF_FAULT, f.self_spec()) for f in cfg.faults if f.kind == "spare-hang" and f.in_process)
        pre = f"n{self.node_rank}-" if cfg.nnodes > 1 else ""
        for i in range(cfg.spares if count is None else count):
            follow = {ENV_FOLLOW: "1"} if count is None and i < cfg.follow else {}  # --follow K: the first K
            self._spawn(f"{name}-{i}", Role.SPARE, [sys.executable, cfg.script, *cfg.args],
                        {ENV_ROLE: Role.SPARE, ENV_SPARE_ID: f"{pre}{name}-{i}", ENV_WORLD_SIZE: str(cfg.nproc),
                         **self.net_env, **cold, **follow})  # fmt: skip
        self.spares_started = True

    def _fresh_requests(self, by_key: dict[str, Any]) -> None:
        """The coordinator asks for a fresh process for each lost rank it has no spare for
        (coordinator.py, _request_fresh): this agent starts one for each of those ranks it launched, a
        spare without warm-up iterations, which the coordinator claims for the rank."""
        pre, first = self.keys.recoveries_prefix, self.node_rank * self.cfg.nproc_per_node
        for key, kv in by_key.items():
            if not (key.startswith(pre) and key.endswith("/cold")) or key in self._fresh_seen:
                continue
            self._fresh_seen.add(key)
            rec = conform(kv.value, {}, {"ranks": (list,)}) or {}
            last = first + self.cfg.nproc_per_node
            mine = [r for r in rec.get("ranks", []) if isinstance(r, int) and first <= r < last]
            for r in mine:
                self._fresh_count += 1
                name = f"fresh-{self._fresh_count}"
                pre_id = f"n{self.node_rank}-" if self.cfg.nnodes > 1 else ""
                log.warning("starting a fresh process for a lost rank", extra={"rank": r, "child": name})
                self._spawn(name, Role.SPARE, [sys.executable, self.cfg.script, *self.cfg.args],
                            {ENV_ROLE: Role.SPARE, ENV_SPARE_ID: f"{pre_id}{name}", ENV_SHADOW_STEPS: "0",
                             ENV_WORLD_SIZE: str(self.cfg.nproc), **self.net_env})  # fmt: skip

    # -- the agent loop ----------------------------------------------------------------------
    def supervise(self) -> dict[str, Any]:
        assert self.client is not None
        t0 = time.time()
        deadline = time.monotonic() + self.cfg.max_wall
        # The job's keys come from a watch-fed mirror (no prefix read and decode every pass).
        # Passes run when a child exits or a key other than a progress record changes, else
        # at the tick: FINE_TICK_S while a fault plan is live, IDLE_TICK_S otherwise.
        wake = self._wake
        progress_prefix = self.keys.progress_prefix

        def on_change(events: list) -> None:
            if not events or any(not e.key.startswith(progress_prefix) for e in events):
                wake.poke()

        self._t0 = t0
        try:
            result = self._watch_job(deadline, wake, on_change)
        finally:  # also on Ctrl-C: a watch left running would warn once its etcd stops
            if self.events is not None and self._by_key:
                self.events.emit(self._by_key)  # the job's last events (its end)
            if self._mirror is not None:
                self._mirror.cancel()
                self._mirror = None
        return self._report(result)

    def _watch_job(self, deadline: float, wake: Wakeup, on_change: Any) -> dict[str, Any] | None:
        """The agent loop proper: until the job's result (or a reason it cannot run)."""
        assert self.client is not None
        result = None
        result_seen_at = None
        probed = 0.0
        while time.monotonic() < deadline:
            try:
                self.watch.reap()
                self.watch.stopped()
                if self._mirror is None:
                    self._mirror = PrefixMirror(self.client, self.keys.prefix, on_change)
                mirror = self._mirror
                # A small read with a short deadline is how an outage shows (during one the
                # loop must still carry out timed faults): every pass while faults are
                # planned, else once per PROBE_S.
                if self.faults.busy() or time.monotonic() - probed >= PROBE_S:
                    self.client.get(self.keys.result, timedelta(seconds=1))
                    probed = time.monotonic()
                kvs, _ = mirror.kvs()
            except EtcdUnavailableError as exc:  # an outage: deaths are reported once etcd is back
                if not self._outage:
                    log.warning("etcd unreachable; the agent keeps watching its children", extra={"err": str(exc)})
                self._outage = True
                self.faults.tick(self._by_key)  # a fault plan's timed faults still land
                time.sleep(0.1)
                continue
            self._outage = False
            by_key = self._by_key = {kv.key: kv for kv in kvs}
            self.faults.record_pending()
            self.faults.tick(by_key)
            self.watch.note_warm_spares(by_key)
            self.watch.kill_fenced(by_key)
            self.watch.forget_fenced(by_key)
            self.faults.inject_requests(by_key)
            self._fresh_requests(by_key)
            self.watch.progress(by_key)
            if self.events is not None:
                self.events.emit(by_key)
            res = by_key.get(self.keys.result)
            if res is not None and result is None:
                result = conform(res.value, {"state": (str,)})  # not a result record: not the end
                result_seen_at = time.monotonic() if result is not None else None
            if result is not None and result.get("state") == "interrupted":
                break  # another agent of the run was interrupted: this node stops too, at once
            if not self.drain.active and by_key.get(self.keys.drain_request(self.node_rank)) and self.can_drain():
                self.client.delete(self.keys.drain_request(self.node_rank))  # `livemig drain --node K`: as SIGTERM
                self.drain.request()
            if self.drain.active and result is None:
                drained = self.drain.step(by_key)
                if drained is not None:
                    result = drained
                    break
                wake.wait(self.children, FINE_TICK_S)
                continue
            if result is not None:
                members_alive = [c for c in self.children if c.role in (Role.WORKER, Role.SPARE)
                                 and c.proc.poll() is None and self.watch.is_member(c, by_key)]  # fmt: skip
                # Carry out the whole fault plan (a pending SIGCONT or heal), then give
                # replaced workers a moment to notice they were fenced and exit by themselves.
                replaced_alive = [c for c in self.children if c.role == Role.WORKER and c.proc.poll() is None]
                waited = time.monotonic() - (result_seen_at or 0)
                if (
                    waited > 30
                    or not members_alive
                    and not self.faults.resumes_due()
                    and (not replaced_alive or waited > 10)
                ):
                    break
            elif all(c.proc.poll() is not None for c in self.children if c.role == Role.COORDINATOR):
                result = {"state": "failed", "reason": "every coordinator exited before the job finished"}
                break
            elif why := self.watch.cannot_form(by_key):
                result = {"state": "failed", "reason": why, "time": time.time()}
                # every agent of the run ends on it (the coordinator writes none)
                ok = put_if_absent(self.client, self.keys.result, result)
                raw = None if ok else self.client.get(self.keys.result)
                if raw is not None:  # the coordinator said it first (the worker reported its error): its words
                    result = conform(raw.value, {"state": (str,)}) or result
                break
            wake.wait(self.children, FINE_TICK_S if self.faults.busy() else IDLE_TICK_S)
        else:
            result = {"state": "failed", "reason": f"run exceeded {self.cfg.max_wall:.0f}s"}
        return result

    def _report(self, result: dict[str, Any] | None) -> dict[str, Any]:
        assert self.client is not None
        wall = time.time() - self._t0
        stops = [f["time"] for f in self.faults.injected if f["kind"] == "etcd-stop"]
        ends = [f["time"] for f in self.faults.injected if f["kind"] == "etcd-resume"]
        rep = report.build(self.client, self.cfg.job, self.cfg.nproc, wall, list(zip(stops, ends, strict=False)),
                           self.watch.spares_warm, launched_at=self._launched)  # fmt: skip
        if result is not None and rep["result"] is None:
            rep["result"] = result
        return rep

    def can_drain(self) -> bool:
        """A drain hands this node's ranks to the rest of the job: only with --on-sigterm drain,
        other nodes, and a job that trains (before it formed, or once it ended, SIGTERM stops)."""
        if self.cfg.on_sigterm != "drain" or self.cfg.nnodes < 2 or self.client is None:
            return False
        raw = self._by_key.get(self.keys.membership)
        return Membership.from_bytes(raw.value if raw else None).trains

    def processes(self) -> list[dict[str, Any]]:
        """Every process this agent started; a spare that took a rank has that rank (the
        last table it saw)."""
        m = Membership.from_kvs(self._by_key, self.keys)
        return [{"name": c.name, "role": c.role, "rank": c.rank if c.rank is not None else m.rank_of(c.incarnation),
                 "incarnation": c.incarnation, "pid": c.proc.pid, "exit_code": c.proc.returncode, "log": c.log_path}
                for c in self.children]  # fmt: skip

    # -- shutdown -----------------------------------------------------------------------------
    def _terminate(self) -> None:
        """SIGTERM every child's process group, also of a child that already exited: what
        it started in its group (the coordinator's store process while it imports torch, a
        worker's data-loader processes) goes with it."""
        for c in self.children:
            try:
                os.killpg(c.proc.pid, signal.SIGCONT)
                os.killpg(c.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def interrupted(self) -> dict[str, Any]:
        """Ctrl-C or SIGTERM of the run. The children are told to stop first (they go while
        etcd is written); the job is marked ended with an "interrupted" result, which ends
        every other agent of the run and every standby spare, also one started from another
        shell; on an external etcd, which outlives us, the job's secret goes with it. The
        report is then built as at a normal end, so `--report` and the summary are written."""
        self._terminate()
        result = {"state": "interrupted", "reason": f"interrupted by {self.signal_name} (node {self.node_rank})",
                  "time": time.time()}  # fmt: skip
        rep = None
        if self.client is not None:
            try:
                put_if_absent(self.client, self.keys.result, result)
                if self.cfg.etcd:
                    self.client.delete(self.keys.secret)
                rep = self._report(None)
            except LivemigError as exc:  # etcd gone too: a report of what this agent knows
                log.info("the interrupted job's keys were not written", extra={"err": str(exc)})
        if rep is None:
            rep = report.empty(self.cfg.job, self.cfg.nproc, time.time() - self._t0)
        rep["result"] = result
        return rep

    def stop(self, grace: float = 5.0) -> None:
        """grace: how long children have after SIGTERM before SIGKILL."""
        t0 = time.monotonic()
        self._terminate()
        deadline = t0 + grace
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_s = killed_wait_s()
                try:  # bounded: a zygote child's exit is learnt from the zygote, which may be gone or wedged
                    c.proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    log.warning(f"{c.name} (pid {c.proc.pid}) was not seen to exit {wait_s:.0f} s after "
                                "SIGKILL; the agent exits without it", extra={"pid": c.proc.pid})  # fmt: skip
        for c in self.children:  # whatever is left in their groups
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        log.info("children stopped", extra={"s": round(time.monotonic() - t0, 3)})
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        if self.events is not None:
            self.events.close()
        if self.node_keeper is not None:
            self.node_keeper.stop(revoke=True)
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.stop()
        if self.partition is not None:
            self.partition.teardown()
        log.info("run stopped", extra={"s": round(time.monotonic() - t0, 3)})
        remove_job_file(self.cfg.job)
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        if self.faults.gate is not None:
            self.faults.gate.close()
        self._wake.close()

    def failure_tail(self) -> str:
        """The last lines of a failed worker's log, to show the user."""
        for c in self.children:
            if c.role == Role.WORKER and c.proc.returncode not in (0, None, -9, -19):
                try:
                    with open(c.log_path) as f:
                        return f"{c.name}: " + "".join(f.readlines()[-5:]).strip()
                except OSError:
                    pass
        return ""


# SIGTERM and SIGINT stop the run in the same way: what the launcher does on them (interrupted)
INTERRUPT_GRACE_S = 1.5  # after Ctrl-C: children's time to exit on SIGTERM before SIGKILL


def run(cfg: RunConfig) -> dict[str, Any]:
    launcher = Launcher(cfg)
    rep: dict[str, Any] | None = None
    make_interruptible()
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_term(signum: int, _frame: Any) -> None:
        launcher.signal_name = signal.Signals(signum).name
        if signum == signal.SIGTERM and launcher.can_drain() and launcher.drain.request():
            return  # the agent loop drains this node (agent/drain.py); a second SIGTERM stops
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_term)
    grace = 5.0
    try:
        try:
            launcher.start()
            rep = launcher.supervise()
        except KeyboardInterrupt:
            # a second Ctrl-C must not cut the clean-up short: it is bounded (INTERRUPT_GRACE_S)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            grace = INTERRUPT_GRACE_S
            rep = launcher.interrupted()
        rep["faults_injected"] = launcher.faults.injected
        # a planned fault the run ended before: nothing was recovered from it, and --verify must say so
        rep["faults_not_fired"] = [str(f) for f in launcher.faults.pending]
        if cfg.spares and cfg.nnodes == 1:  # this agent's own spares (others may serve the job too)
            used = {s for r in rep["recoveries"] for s in r.get("spares", [])}
            used |= {s for m in rep.get("migrations", []) if m.get("outcome") == "done" for s in m.get("spares", [])}
            rep["spares_left"] = sum(1 for i in range(cfg.spares) if f"spare-{i}" not in used)
        if rep["result"] and rep["result"].get("state") == "done" and cfg.checkpoint is not None:
            from livemig.checkpoint_dir import mark_finished  # a later run of the job starts afresh

            mark_finished(cfg.checkpoint.dir, cfg.job, rep["steps_completed"])
        if rep["result"] and rep["result"].get("state") not in ("done", "stopped"):
            tail = launcher.failure_tail()
            if tail:
                rep["result"]["log_tail"] = tail
        return rep
    finally:
        launcher.stop(grace)
        if rep is not None:
            rep["processes"] = launcher.processes()
        for signum, handler in old.items():
            signal.signal(signum, handler)
