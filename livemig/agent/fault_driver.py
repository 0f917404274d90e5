"""The agent's fault side (`livemig run --fault`, `livemig inject` through etcd): carry
out a fault plan's faults when their step or recovery phase is reached, the `slow`
duty cycle, SIGCONT and heals, etcd stops; and the helpers `livemig inject` shares.
Composed by agent/launcher.py's Launcher, which owns the children, the client and the keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from livemig.config import ENV_GATE_TIMEOUT, Role
from livemig.errors import ConfigError, EtcdUnavailableError
from livemig.fault_gate import Arrival, GateServer, gate_timeout, gated, onward
from livemig.faults import Fault
from livemig.rdzv.client import EtcdClient, conform, encode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership

if TYPE_CHECKING:
    from livemig.agent.children import Agent, Child

log = logging.getLogger("livemig.agent.launcher")
FOLLOW_WAIT_S = 10.0  # a failure waits at most this long (and half the gate's timeout) for the followers


class FaultDriver:
    """The fault plan of one agent and everything in flight for it: what is pending, what
    landed, the SIGCONTs and heals due, slow duty cycles, the gates its children wait at.
    It owns that state; the processes, the client and the keys are its agent's."""

    def __init__(self, agent: Agent, faults: list[Fault], poke: Any) -> None:
        self.agent = agent
        self.pending = list(faults)  # the agent narrows it to its own faults once started
        self.injected: list[dict] = []
        self.armed_in_process = [f for f in faults if f.in_process]  # fired by the workers themselves (`died`)
        self._resumes: list[tuple[float, Child]] = []
        self._slow: list[tuple[Child, float, float]] = []  # (target, factor, until: monotonic)
        self._armed: dict[int, float] = {}
        self._unrecorded: list[tuple] = []  # fault events to write once etcd answers
        # A fault plan's gates (livemig/fault_gate.py): where our children stop at a fault's step.
        self.gate = GateServer(poke) if any(gated(f) for f in faults) else None
        self._arrived: list[Arrival] = []  # children waiting at a gate, not answered yet
        self._held: list[tuple[Arrival, float, Fault]] = []  # (gate, until, migrate fault): held for its claim
        self._migration_ids: dict[int, str] = {}  # id(fault) -> the migration request it made
        self._follow_wait: dict[int, float] = {}  # fault -> when it first waited for the followers
        self._follow_said: set[int] = set()
        self._gates_passed: set[int] = set()  # steps whose gate went by without its fault (not our target)

    def resumes_due(self) -> bool:
        """A SIGCONT or heal of the plan is still to come: the run's end waits for it."""
        return bool(self._resumes)

    def busy(self) -> bool:
        """A fault plan is live: step triggers, timed resumes and slow duty cycles need the fine tick."""
        return bool(self.pending or self._resumes or self._slow or self._held)

    def record_pending(self) -> None:
        """Write the fault events an etcd outage held back (the downtime a report measures)."""
        while self._unrecorded:
            record_fault(self.agent.client, self.agent.keys, *self._unrecorded[0])
            self._unrecorded.pop(0)

    def slowing(self, c: Child) -> bool:
        """Under a `slow` fault: stopped and resumed in short cycles, a slow process, not a hang."""
        return any(t is c for t, _, _ in self._slow)

    def stopped_by_plan(self, c: Child) -> bool:
        """Stopped by the plan (a SIGSTOP with its SIGCONT due, or cut off from etcd by a
        partition): a fence it cannot see yet is no sign of a wedge."""
        # a link cut still sees etcd: only a partition hides the fence
        cut_off = (self.agent.partition is not None and c.name == self.partition_target()
                   and any(f.kind == "partition" for f in self.agent.cfg.faults))  # fmt: skip
        return any(t is c for _, t in self._resumes) or c.stopped or cut_off

    def inject_requests(self, by_key: dict) -> None:
        """`livemig inject` from another host (inject.py): kill, hang, resume or slow one of our children."""
        assert self.agent.client is not None
        for key, kv in by_key.items():
            if not key.startswith(self.agent.keys.inject_requests_prefix):
                continue
            req = conform(kv.value, {"kind": (str,), "incarnation": (str,)}, {"step": (int,), "rank": (int,)})
            if req is None:  # not a request livemig wrote: dropped, once
                log.warning("dropping a malformed inject request", extra={"key": key})
                self.agent.client.delete(key)
                continue
            child = next((c for c in self.agent.children if c.incarnation == req.get("incarnation")), None)
            if child is None or child.proc.poll() is not None:
                continue
            sig = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "resume": signal.SIGCONT}.get(req.get("kind"))
            if req.get("kind") == "slow":
                factor, duration = req.get("factor"), req.get("duration")
                if isinstance(factor, int | float) and factor > 1 and isinstance(duration, int | float):
                    self._slow.append((child, float(factor), time.monotonic() + float(duration)))
                    self.agent.say(
                        f"livemig: slowing {child.name} {factor:g}x for {duration:g}s (requested through etcd)"
                    )
            elif sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, sig)
                if req["kind"] != "resume":
                    record_fault(self.agent.client, self.agent.keys, req["kind"], req.get("rank"),
                                 int(req.get("step", 0)), time.time())  # fmt: skip
                self.agent.say(f"livemig: injected {req['kind']} of {child.name} (requested through etcd)")
            self.agent.client.delete(key)

    def _holder(self, rank: int, by_key: dict) -> Child | None:
        m = Membership.from_kvs(by_key, self.agent.keys)
        mem = m.members.get(rank)
        return next((c for c in self.agent.children if mem and c.incarnation == mem.incarnation), None)

    def tick(self, by_key: dict) -> None:
        now = time.monotonic()
        if self.gate is not None:
            self._arrived += self.gate.take()
        for f in list(self.pending):
            step = step_reached(self.agent.keys, f, by_key)
            if onward(f):
                self._onward(f, by_key, step, now)
                continue
            if gated(f) and f.step not in self._gates_passed:
                # At the gate: the target stopped after committing S (livemig/fault_gate.py).
                # Without a gate of ours (a process another agent started), once it is past S.
                arr = next((a for a in self._arrived if a.step == f.step and f.rank in (None, a.rank)), None)
                if arr is None and step <= f.step:
                    continue
                if arr is not None and not self._followers_current(f, now):
                    if f.kind == "spare-hang":  # not held: a follower attaches at a boundary of its feeder
                        self._arrived.remove(arr)
                        self.gate.release(arr)
                        self._gates_passed.add(f.step)  # from here the unheld path below lands it
                    continue  # --follow: the fault lands once the followers hold step S (held at the gate meanwhile)
                holder = None
                if arr is not None:
                    self._arrived.remove(arr)  # the process at the gate holds the rank, whatever by_key says yet
                    holder = next((c for c in self.agent.children if c.incarnation == arr.incarnation), None)
                if not self.inject(f, by_key, f.step if arr is not None else step, holder):
                    if arr is not None:  # not ours to carry out (another agent's target): its trigger decides
                        self.gate.release(arr)
                        self._gates_passed.add(f.step)
                    continue
                self.pending.remove(f)
                if arr is not None and f.kind == "migrate":
                    self._held.append((arr, now + gate_timeout() - 1.0, f))
                elif arr is not None:
                    self.gate.release(arr)
                continue
            if step < f.step:
                continue
            armed = self._armed.setdefault(id(f), time.time())
            if time.time() < armed + f.after:
                continue
            if f.phase and not phase_reached(self.agent.keys, f, by_key, armed):
                continue
            if f.kind == "spare-hang" and not self._followers_current(f, now):
                continue  # --follow: a stop of the follower once it follows (what the plan tests)
            if self.inject(f, by_key, step):
                self.pending.remove(f)
        self._release_gates(by_key, now)
        for due, target in list(self._resumes):
            if now >= due:
                self._resumes.remove((due, target))
                if self.agent.partition is not None and target.name == self.partition_target():
                    self.agent.partition.heal()
                    self.agent.say(f"livemig: healed the partition of {target.name}")
                elif target.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):  # it exited since the poll
                        os.killpg(target.proc.pid, signal.SIGCONT)
                    self.agent.say(f"livemig: resumed {target.name} (SIGCONT)")
        for entry in list(self._slow):
            target, factor, until = entry
            if target.proc.poll() is not None:
                self._slow.remove(entry)
                continue
            # migrated away or fenced: let it exit at full speed; or its time is up (inject slow --for)
            if not self.agent.watch.is_member(target, by_key) or time.monotonic() >= until:
                self._slow.remove(entry)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(target.proc.pid, signal.SIGCONT)
                target.stopped = False
                continue
            # Duty cycle of 100 ms: run 100/factor ms, stopped the rest.
            phase = (now * 10) % 1.0
            want_stopped = phase >= 1.0 / factor
            if want_stopped != target.stopped:
                try:  # the slowed worker may end (the job done) between the poll above and here
                    os.killpg(target.proc.pid, signal.SIGSTOP if want_stopped else signal.SIGCONT)
                except ProcessLookupError:
                    self._slow.remove(entry)
                    continue
                target.stopped = want_stopped

    def _onward(self, f: Fault, by_key: dict, step: int, now: float) -> None:
        """A fault that lands at the first boundary from step S on at which the job's planned
        migration is over (`during=migrated`): its target stops at each such boundary and goes
        on at once while the migration runs, so the group (and the migration's switch vote)
        never waits for it; a target another agent started is hit once past S, ungated."""
        assert self.gate is not None
        arrs = [a for a in self._arrived if a.step >= f.step and a.rank == f.rank]
        if not migration_settled(self.agent.keys, by_key):
            for a in arrs:
                self._arrived.remove(a)
                self.gate.release(a)
            return
        for a in arrs[:-1]:
            self._arrived.remove(a)
            self.gate.release(a)
        arr = arrs[-1] if arrs else None
        if arr is None and (step <= f.step or self._holder(f.rank, by_key) is not None):  # type: ignore[arg-type]
            return  # ours: it stops at its next boundary
        if arr is not None and not self._followers_current(f, now):
            return  # --follow: held at the gate until the followers hold its step
        holder = None
        if arr is not None:
            self._arrived.remove(arr)
            holder = next((c for c in self.agent.children if c.incarnation == arr.incarnation), None)
        if self.inject(f, by_key, arr.step if arr is not None else step, holder):
            self.pending.remove(f)
        if arr is not None:
            self.gate.release(arr)

    def _release_gates(self, by_key: dict, now: float) -> None:
        """Answer the gates no pending fault waits on ("end" where no onward fault waits for
        that rank either), and a migration's gate once the coordinator took its request (a
        spare claimed, or the request refused)."""
        if self.gate is None:
            return
        waiting = {(f.rank, f.step) for f in self.pending if gated(f) and f.step not in self._gates_passed}
        ahead = {f.rank for f in self.pending if onward(f)}
        for arr in list(self._arrived):
            if (arr.rank, arr.step) not in waiting and (None, arr.step) not in waiting:
                self._arrived.remove(arr)
                self.gate.release(arr, b"go" if arr.rank in ahead else b"end")
        for entry in list(self._held):
            arr, until, f = entry
            if self._migration_started(by_key, self._migration_ids.get(id(f), "")) or now >= until:
                if now >= until:
                    self.agent.say(
                        f"livemig: the migration of rank {f.rank} did not start within "
                        f"{gate_timeout() - 1:.0f}s ({ENV_GATE_TIMEOUT}); rank {f.rank} goes on training"
                    )
                self._held.remove(entry)
                self.gate.release(arr)

    def _migration_started(self, by_key: dict, rid: str) -> bool:
        """Has the coordinator taken migration request `rid`: a spare claimed (MIGRATING), or an outcome?"""
        res = by_key.get(self.agent.keys.migrate_result)
        if res is not None and (conform(res.value, {"id": (str,)}) or {}).get("id") == rid:
            return True
        raw = by_key.get(self.agent.keys.membership)
        m = Membership.from_bytes(raw.value if raw else None)
        return m.migration.get("id") == rid

    def _followers_current(self, f: Fault, now: float) -> bool:
        """With --follow, a failure held at its gate is injected once every follower holds the
        state after its step (it is what the run measures), or after FOLLOW_WAIT_S: each
        follower's status (runtime/follow.py, written about once a second) says its step, or
        that it stays warm. Not held while a follower is still attaching: its feeder serves the
        snapshot at a boundary, which the held group does not reach. A spare-hang waits (unheld)
        until the followers follow."""
        if not self.agent.cfg.follow or f.kind not in ("kill", "hang", "partition", "link", "spare-hang", "migrate"):
            return True
        since = self._follow_wait.setdefault(id(f), now)
        wait = min(FOLLOW_WAIT_S, gate_timeout() / 2)
        if now - since > wait:
            if id(f) not in self._follow_said:
                self._follow_said.add(id(f))
                self.agent.say(f"livemig: the followers did not reach step {f.step} in {wait:g} s: "
                               f"injecting {f.kind} anyway")  # fmt: skip
            return True
        assert self.agent.client is not None
        try:
            kvs, _ = self.agent.client.get_prefix(self.agent.keys.follow_prefix)
        except EtcdUnavailableError:
            return False
        states = [conform(kv.value, {"state": (str,), "step": (int,)}) or {} for kv in kvs]
        following = [s for s in states if s.get("state") == "following"]
        others = sum(s.get("state") in ("warm", "unsupported", "claimed", "stopped") for s in states)
        if len(following) + others < self.agent.cfg.follow:  # a follower still warming up or attaching
            if f.kind == "spare-hang":
                return False
            if id(f) not in self._follow_said:
                self._follow_said.add(id(f))
                self.agent.say(f"livemig: a follower is still attaching at step {f.step}: {f.kind} lands now "
                               "(its recovery streams the state)")  # fmt: skip
            return True
        return f.kind == "spare-hang" or all(s["step"] >= f.step for s in following)

    def _no_warm_spare(self, by_key: dict) -> str:
        """'' if a spare of the job is warm; else a few words on the spares' warm-up."""
        if any(k.startswith(self.agent.keys.spares_prefix) and (conform(kv.value, {"state": (str,)}) or {}).get("state")
               == "warm" for k, kv in by_key.items()):  # fmt: skip
            return ""
        mine = [c for c in self.agent.children if c.role == Role.SPARE and c.proc.poll() is None]
        if not mine:
            return "no spare is running here: start one with `livemig-spare start`"
        return ", ".join(f"{c.name} warming up ({time.monotonic() - c.started:.1f}s since start)" for c in mine)

    def partition_target(self) -> str:
        rank = next((f.rank for f in self.agent.cfg.faults if f.kind in ("partition", "link")), None)
        return f"worker-{rank}"

    def inject(self, f: Fault, by_key: dict, step: int, holder: Child | None = None) -> bool:
        """Carry out one fault; False if its target is not there (yet). holder: the process
        of rank f.rank waiting at the fault's gate."""
        assert self.agent.client is not None
        target: Child | None = None
        if f.kind == "etcd-kill":
            assert self.agent.cluster is not None  # RunConfig refused the plan without one
            self.agent.cluster.kill_member(f.member)
            what = f"etcd member {f.member}"
        elif f.kind == "etcd-stop":
            return self._etcd_stop(f, step)
        elif f.kind == "stop":
            from livemig.rdzv.requests import request_stop

            request_stop(self.agent.client, self.agent.keys, f"fault plan after step {step}")
            what = "the whole job"
        else:
            if f.kind == "coordinator-kill":
                leader = by_key.get(self.agent.keys.leader)
                lid = leader.value.decode() if leader else ""
                target = next((c for c in self.agent.children if c.incarnation == lid), None)
            elif f.kind in ("spare-kill", "spare-hang"):
                target = self._claimed_spare(by_key)
            else:
                target = holder or self._holder(f.rank, by_key)  # type: ignore[arg-type]
            if target is None or target.proc.poll() is not None:
                return False
            what = f"{target.name}" + (f" (rank {target.rank})" if target.rank is not None else "")
            if f.kind == "slow":
                self._slow.append((target, f.factor, float("inf")))
            elif f.kind in ("partition", "link"):
                if self.agent.partition is None or target.rank != f.rank or target.name != f"worker-{f.rank}":
                    raise ConfigError(f"{f.kind} targets the worker started in the namespace (its first holder)")
                if f.kind == "link":
                    self.agent.partition.cut_peers()
                else:
                    self.agent.partition.cut()
                if f.resume_after is not None:
                    self._resumes.append((time.monotonic() + f.resume_after, target))
            elif f.kind == "corrupt":
                # asked of the process holding the rank, through the watch it keeps for injections
                self.agent.client.put(self.agent.keys.inject_self(target.incarnation),
                                      encode({"kind": "corrupt", "time": time.time()}))  # fmt: skip
            elif f.kind == "migrate":
                from livemig.rdzv.requests import request_migration

                self._migration_ids[id(f)] = request_migration(self.agent.client, self.agent.keys, f.rank,  # type: ignore[arg-type]
                                                               f"fault plan after step {step}")  # fmt: skip
                cold = self._no_warm_spare(by_key)
                if cold:
                    self.agent.say(f"livemig: migration of rank {f.rank} requested after step {step} waits for a warm "
                             f"spare: {cold}")  # fmt: skip
            else:
                stop = f.kind in ("hang", "spare-hang")
                os.killpg(target.proc.pid, signal.SIGSTOP if stop else signal.SIGKILL)
                if stop and f.resume_after is not None:
                    self._resumes.append((time.monotonic() + f.resume_after, target))
        now = time.time()
        if f.kind not in ("slow", "corrupt", "migrate", "spare-hang", "stop"):  # these do not start a downtime
            try:
                record_fault(self.agent.client, self.agent.keys, f.kind, f.rank, step, now)
            except EtcdUnavailableError:
                self._unrecorded.append((f.kind, f.rank, step, now))
        if self.agent.cfg.cold_spares and not self.agent.spares_started:
            self.agent.spawn_spares()  # a cold start: a fresh process at the moment of failure
        self.injected.append({"kind": f.kind, "rank": f.rank, "step": step, "during": f.during, "time": now,
                              "target": what})  # fmt: skip
        when = f" during {f.during}" if f.phase else ""
        self.agent.say(f"livemig: injected {f.kind} of {what} after step {step}{when}")
        return True

    def died(self, c: Child, code: int) -> None:
        """A child died: if it was the first worker of a rank whose in-process kill the plan
        armed (`kill:...:during=allreduce` and the like, fired by the worker itself:
        runtime/self_faults.py), that fault landed; it is reported as the agent's own are."""
        if code != -signal.SIGKILL or c.role != Role.WORKER or c.rank is None or not c.name.startswith("worker-"):
            return
        for f in self.armed_in_process:
            if f.kind == "kill" and f.rank == c.rank:
                self.armed_in_process.remove(f)
                what = f"{c.name} (rank {c.rank})"
                now = c.died_at or time.time()
                self.injected.append({"kind": f.kind, "rank": f.rank, "step": f.step, "during": f.during, "time": now,
                                      "target": what, "in_process": True})  # fmt: skip
                self.agent.say(f"livemig: injected kill of {what} in step {f.step} during {f.during} (in-process)")
                return

    def _etcd_stop(self, f: Fault, step: int) -> bool:
        """SIGSTOP every embedded etcd member (an outage of the whole cluster); SIGCONT
        after `resume` seconds from a timer, since this agent's own etcd calls block."""

        assert self.agent.cluster is not None  # RunConfig refused the plan without one
        assert self.agent.client is not None
        now = time.time()
        record_fault(self.agent.client, self.agent.keys, f.kind, None, step, now)  # before etcd stops answering
        self.agent.cluster.pause()
        resume = f.resume_after if f.resume_after is not None else 10.0

        def cont() -> None:
            self.agent.cluster.resume()
            self.injected.append({"kind": "etcd-resume", "rank": None, "step": step, "time": time.time()})
            self.agent.say(f"livemig: resumed etcd after {resume:g}s")

        threading.Timer(resume, cont).start()
        self.injected.append({"kind": f.kind, "rank": None, "step": step, "during": "", "time": now,
                              "target": "every etcd member", "resume_s": resume})  # fmt: skip
        self.agent.say(f"livemig: injected etcd-stop (SIGSTOP of every etcd member for {resume:g}s) after step {step}")
        return True

    def _claimed_spare(self, by_key: dict) -> Child | None:
        """The spare claimed by the recovery in flight, else a spare in standby. Never one a
        committed generation holds: it has a rank now (killing it would be a kill of that
        rank, and of the mirror a later recovery may need)."""
        m = Membership.from_kvs(by_key, self.agent.keys)
        claimed = {mem.incarnation for mem in in_flight_spares(self.agent.keys, by_key, m)}
        members = {mem.incarnation for mem in m.members.values()}
        live = [c for c in self.agent.children if c.role == Role.SPARE and c.proc.poll() is None]
        return next((c for c in live if c.incarnation in claimed), None) or next(
            (c for c in live if c.incarnation not in members), None)  # fmt: skip


def in_flight_spares(keys: JobKeys, by_key: dict, m: Membership) -> list[Any]:
    """The members the recovery (or planned migration) in flight claimed (its timeline's claim
    event): none once the generation committed, and never a spare an earlier recovery claimed
    (it holds a rank)."""
    if m.state not in (GenState.RECOVERING, GenState.BUILDING, GenState.MIGRATING):
        return []
    now: set[str] = set()
    for k, kv in by_key.items():
        if k.startswith(keys.timeline_prefix) and k.endswith("-claim"):
            ev = conform(kv.value, {"generation": (int,)}) or {}
            if ev.get("generation") == m.generation and isinstance(ev.get("spares"), list):
                now.update(x for x in ev["spares"] if isinstance(x, str))
    return [mem for mem in m.members.values() if mem.role == Role.SPARE and mem.spare_id in now]


def step_reached(keys: JobKeys, f: Fault, by_key: dict) -> int:
    """The step the fault's target rank (any rank if none) has committed; -1 if none yet."""
    steps = []
    for k, kv in by_key.items():
        rest = k[len(keys.progress_prefix) :]
        if k.startswith(keys.progress_prefix) and rest.isdigit() and (f.rank is None or int(rest) == f.rank):
            rec = conform(kv.value, {"step": (int,)})
            if rec is not None:
                steps.append(rec["step"])
    return max(steps, default=-1)


def _time_of(kv: Any) -> float:
    return (conform(kv.value, {"time": (int, float)}) or {}).get("time", 0.0)


def phase_reached(keys: JobKeys, f: Fault, by_key: dict, since: float) -> bool:
    """Has a recovery after `since` reached the fault's phase (see livemig/faults.py)?"""
    if f.phase == "migrated":
        return migration_settled(keys, by_key)
    want = {"stream": "claim", "build": "ready"}.get(f.phase, f.phase)
    rec = keys.recoveries_prefix
    for k, kv in by_key.items():
        if want == "snapshot" and k.startswith(rec) and k.endswith("/catchup"):
            if _time_of(kv) >= since:  # the spare's first catch-up record: its snapshot is loaded
                return True
        elif want == "ready" and k.startswith(rec) and "/ready/" in k:
            gen = k[len(rec) :].split("/")[0]
            if gen.isdigit() and int(gen) > 1 and _time_of(kv) >= since:
                return True
        elif k.startswith(keys.timeline_prefix) and k.endswith(f"-{want}") and _time_of(kv) >= since:
            return True
    return False


def migration_settled(keys: JobKeys, by_key: dict) -> bool:
    """The job's planned migration has its outcome and no other is queued or in flight: the
    coordinator writes the result in the transaction that ends one (commit, abort, a failure
    during it, a refusal), and a queued request or a MIGRATING table means one is not over."""
    if keys.migrate_request in by_key or keys.migrate_result not in by_key:
        return False
    raw = by_key.get(keys.membership)
    return Membership.from_bytes(raw.value if raw else None).state != GenState.MIGRATING


def record_fault(client: EtcdClient, keys: JobKeys, kind: str, rank: int | None, step: int,
                 at: float) -> None:  # fmt: skip
    """A timeline 'fault' event: the start of the downtime a report measures."""
    gen_kv = client.get(keys.generation)
    gen = int(gen_kv.value) if gen_kv else 0
    client.put(keys.timeline(gen, int(at * 1000) % 1_000_000, "fault"),
               encode({"phase": "fault", "generation": gen, "time": at, "kind": kind, "rank": rank,
                       "step": step}))  # fmt: skip
