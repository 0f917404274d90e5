"""Fault plans, shared by `livemig run --fault PLAN`, `livemig inject` and
`livemig bench faults`.

    KIND[:rank=R][:step=S][:during=WHEN][:resume=SECONDS][:factor=N][:member=I][:after=SECONDS][:ahead=K]

| kind | target | what happens |
|---|---|---|
| kill | rank R | SIGKILL the process holding R |
| hang | rank R | SIGSTOP it (resume=S: SIGCONT after S seconds) |
| slow | rank R | its steps made `factor` times slower (SIGSTOP/SIGCONT duty cycle) |
| drop_avg | rank R | in-process: discard its completed average of step S, join recovery |
| partition | rank R | cut its network (own netns, veth down; heal=S: restore after S seconds); needs root |
| link | rank R | cut its links to the job's other processes, etcd still reachable (own netns; heal=S) |
| corrupt | rank R | its state server alters one byte of the next chunk it serves (asked through etcd) |
| etcd-kill | member I | SIGKILL one member of the embedded etcd cluster (`--etcd-members 3`) |
| etcd-stop | - | SIGSTOP every embedded etcd member (an outage; resume=S: SIGCONT after S seconds, default 10) |
| coordinator-kill | - | SIGKILL the leader coordinator (run `--coordinators 2` for a standby) |
| spare-kill | - | SIGKILL the spare claimed in the current recovery (else any spare) |
| spare-hang | - | SIGSTOP that spare instead (resume=S: SIGCONT after S s); during=snapshot: see below |
| migrate | rank R | not a fault: a planned migration of R onto a spare (as `livemig migrate`) |
| stop | - | not a fault: the whole job stops at a checkpoint of its next step (as `livemig stop`) |
| wedge | rank R | R's training thread blocks forever, lease and progress threads alive (a deadlock) |
| break | rank R | in-process: R's collective of step S fails as on a broken socket, every peer reachable |

A wedge lands `during=compute` (default: at the start of step S, before its
collective) or `during=before_commit` (inside the collective, the others done).

Trigger: once rank R (or, without a rank, any rank) has committed step S: the
process holding R then waits at that boundary, before S+1, while its agent
carries the fault out (livemig/fault_gate.py), so the fault lands on its step
however fast the steps are. `after=SECONDS` lands it that much later instead
(no wait at the boundary; the agent carries it out even while etcd is stopped,
so `kill:rank=1:step=10:after=2` with `etcd-stop:step=10` kills rank 1 during
the outage).
`during` delays it further:
- allreduce / before_commit / gather / after_step (kill only): the worker kills
  itself inside ctx.step() of step S, with its gradients in flight / after the
  collective completed but before its optimizer step / (ZeRO-1) with its
  shard updated and the parameter all-gather in flight / as ctx.step() returns,
  before the user's code after it (a scheduler step) runs;
- fsdp_allgather / fsdp_reduce_scatter / replicate_allreduce / clip_norm (kill
  only, FSDP2 and HSDP): the worker kills itself with the first such collective
  of step S in flight: a forward all-gather of parameters, a backward
  reduce-scatter of gradients, HSDP's all-reduce over the replicate dimension,
  the gradient norm's all-reduce inside ctx.clip_grad_norm_;
- checkpoint (kill only): the worker kills itself in its checkpoint writer, once
  its part of boundary S (a checkpointed step) is staged and written, before
  it is durable: that checkpoint never completes;
- fence / agree / claim / stream / build / commit: the first recovery after
  step S reaches that phase (stream = right after the claim, when the spare
  starts pulling; build = when the first member reports its group built;
  snapshot = a migrating spare loaded its snapshot and replays the group's steps
  (`spare-hang:during=snapshot:resume=S` stalls the spare S s, default 10, in-process at
  that point, so the group runs ahead of what it can replay; `ahead=K` instead stalls it
  until the group has committed K steps past the snapshot, at most resume= seconds: a
  catch-up of K steps however slow the host's steps are; a snapshot the group has left
  behind already is not stalled on: the newer one the spare loads next is);
  catchup = a migrating spare loaded its snapshot and caught up with the group);
- migrated: once the job's planned migration has its outcome (done, aborted or
  rejected) and none is queued or in flight, whenever that was: a plan of
  `migrate:rank=2:step=12` and `kill:rank=0:step=13:during=migrated` kills rank 0
  after the migration, however many steps its catch-up takes on a loaded host
  (a fixed later step would land inside a slow one instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from livemig.errors import ConfigError

RANKED = ("kill", "hang", "slow", "drop_avg", "corrupt", "partition", "link", "migrate", "wedge", "break")
UNRANKED = ("etcd-kill", "etcd-stop", "coordinator-kill", "spare-kill", "spare-hang", "stop")
KINDS = RANKED + UNRANKED
FSDP_DURING = (
    "fsdp_allgather",
    "fsdp_reduce_scatter",
    "replicate_allreduce",
    "clip_norm",
)  # runtime/strategies/fsdp2.py
IN_PROCESS_DURING = ("allreduce", "before_commit", "gather", "after_step", "checkpoint", *FSDP_DURING)
WEDGE_DURING = ("compute", "before_commit")
PHASE_DURING = ("fence", "agree", "claim", "stream", "build", "commit", "snapshot", "catchup", "migrated")
USAGE = "KIND[:rank=R][:step=S][:during=WHEN][:resume=SECONDS][:factor=N][:member=I][:after=SECONDS][:ahead=K]"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None
    step: int
    during: str = ""
    resume_after: float | None = None  # hang: SIGCONT / partition: heal, after this many seconds
    factor: float = 4.0  # slow: steps this many times slower
    member: int = 0  # etcd-kill: which etcd member
    after: float = 0.0  # seconds between the trigger and the fault (lands during an etcd outage, say)
    ahead: int = 0  # spare-hang during=snapshot: stall until the group is this many steps past the snapshot

    def __str__(self) -> str:
        """The plan as the user wrote it (the fields that differ from the defaults)."""
        parts = [self.kind]
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        parts.append(f"step={self.step}")
        if self.during:
            parts.append(f"during={self.during}")
        if self.resume_after is not None:
            parts.append(f"resume={self.resume_after:g}")
        if self.kind == "slow":
            parts.append(f"factor={self.factor:g}")
        if self.kind == "etcd-kill":
            parts.append(f"member={self.member}")
        if self.after:
            parts.append(f"after={self.after:g}")
        if self.ahead:
            parts.append(f"ahead={self.ahead}")
        return ":".join(parts)

    @property
    def in_process(self) -> bool:
        return (self.kind in ("drop_avg", "wedge", "break") or self.during in IN_PROCESS_DURING
                or (self.kind == "spare-hang" and self.during == "snapshot"))  # fmt: skip

    @property
    def phase(self) -> str:
        return self.during if self.during in PHASE_DURING else ""

    def self_spec(self) -> str:
        """What the worker reads from LIVEMIG_SELF_FAULT."""
        kind = {"kill": "selfkill", "wedge": "selfwedge", "break": "selfbreak", "spare-hang": "selfstall"}.get(
            self.kind, self.kind)  # fmt: skip
        default = "compute" if self.kind == "wedge" else "allreduce"
        spec = f"{kind}:step={self.step}:at={self.during or default}"
        spec += f":resume={self.resume_after}" if self.resume_after is not None else ""
        return spec + (f":ahead={self.ahead}" if self.ahead else "")


def parse_fault(spec: str) -> Fault:
    kind, *parts = spec.split(":")
    fields: dict[str, str] = {}
    for p in parts:
        k, sep, v = p.partition("=")
        if not sep:
            raise ConfigError(f"bad fault {spec!r}: expected {USAGE}")
        fields[k] = v
    if kind not in KINDS:
        raise ConfigError(f"bad fault {spec!r}: kind must be one of {', '.join(KINDS)}")

    def num(name: str, cast: type, default: object = None) -> object:
        if name not in fields:
            return default
        try:
            return cast(fields.pop(name))
        except ValueError:
            raise ConfigError(f"bad fault {spec!r}: {name} must be a number") from None

    rank = num("rank", int)
    step = num("step", int, 0)
    if kind in RANKED and rank is None:
        raise ConfigError(f"bad fault {spec!r}: {kind} needs rank=R")
    if kind in UNRANKED and rank is not None:
        raise ConfigError(f"bad fault {spec!r}: {kind} takes no rank")
    during = fields.pop("during", "")
    if kind == "wedge":
        if during not in ("", *WEDGE_DURING):
            raise ConfigError(f"bad fault {spec!r}: a wedge lands during={' or '.join(WEDGE_DURING)}")
    elif kind == "break" and during:
        raise ConfigError(f"bad fault {spec!r}: a break lands in step S's collective (no during)")
    elif during and during not in IN_PROCESS_DURING + PHASE_DURING:
        raise ConfigError(f"bad fault {spec!r}: during must be one of {', '.join(IN_PROCESS_DURING + PHASE_DURING)}")
    if during in IN_PROCESS_DURING and kind not in ("kill", "wedge"):
        raise ConfigError(f"bad fault {spec!r}: during={during} applies to kill (and wedge) only")
    resume = num("resume", float)
    heal = num("heal", float)
    if heal is not None:
        if kind not in ("partition", "link"):
            raise ConfigError(f"bad fault {spec!r}: heal=SECONDS applies to partition and link only")
        resume = heal
    if resume is not None and kind not in ("hang", "spare-hang", "partition", "link", "etcd-stop"):
        raise ConfigError(f"bad fault {spec!r}: resume=SECONDS applies to hang, spare-hang and etcd-stop only")
    factor = num("factor", float, 4.0)
    member = num("member", int, 0)
    after = num("after", float, 0.0)
    if after < 0:  # type: ignore[operator]
        raise ConfigError(f"bad fault {spec!r}: after=SECONDS must be >= 0")
    if after and (during in IN_PROCESS_DURING or kind in ("drop_avg", "wedge", "break")):
        raise ConfigError(f"bad fault {spec!r}: after=SECONDS applies to faults the agent carries out")
    ahead = num("ahead", int, 0)
    if ahead and (kind != "spare-hang" or during != "snapshot" or ahead < 0):  # type: ignore[operator]
        raise ConfigError(f"bad fault {spec!r}: ahead=K (K >= 1) applies to spare-hang:during=snapshot only")
    if fields:
        raise ConfigError(f"bad fault {spec!r}: unknown field(s) {', '.join(fields)}")
    if (rank is not None and rank < 0) or step < 0 or factor < 1:  # type: ignore[operator]
        raise ConfigError(f"bad fault {spec!r}: rank and step must be >= 0, factor >= 1")
    if (resume is not None and resume < 0) or member < 0:  # type: ignore[operator]
        raise ConfigError(f"bad fault {spec!r}: resume= and heal= seconds and member= must be >= 0")
    return Fault(kind, rank, step, during, resume, factor, member, after, ahead)  # type: ignore[arg-type]


def parse_plan(specs: list[str]) -> list[Fault]:
    """Every --fault, and the one rule across them: a worker process carries one in-process
    fault (LIVEMIG_SELF_FAULT), so two for one rank would silently keep the last."""
    faults = [parse_fault(s) for s in specs]
    seen: dict[int, str] = {}
    for s, f in zip(specs, faults, strict=True):
        if f.in_process and f.rank is not None:
            if f.rank in seen:
                raise ConfigError(f"--fault {s!r}: rank {f.rank} already has the in-process fault {seen[f.rank]!r} "
                                  "(one per rank: plan the other on another rank, or as an agent's fault)")  # fmt: skip
            seen[f.rank] = s
    return faults


@dataclass(frozen=True)
class SelfFault:
    """A fault a worker carries out on itself (LIVEMIG_SELF_FAULT, or `livemig inject
    wedge|break` taken at a boundary): kind is selfkill, selfwedge, selfbreak, selfstall
    or drop_avg; it lands in step `step` at the point `at` (runtime/self_faults.py)."""

    kind: str
    step: int
    at: str = "allreduce"
    seconds: float = 10.0  # selfstall: how long the spare stalls (at most, with `ahead`)
    ahead: int = 0  # selfstall: until the group is this many steps past the snapshot


def parse_self_fault(spec: str) -> SelfFault:
    """LIVEMIG_SELF_FAULT (what Fault.self_spec writes) -> SelfFault."""
    kind, *rest = spec.split(":")
    fields = dict(p.partition("=")[::2] for p in rest)
    return SelfFault(kind, int(fields["step"]), fields.get("at", "allreduce"), float(fields.get("resume") or 10.0),
                     int(fields.get("ahead") or 0))  # fmt: skip
