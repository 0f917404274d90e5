"""The key schema of a job: the one place that builds etcd key strings.

docs/protocol.md has the same table; keep them in step.
"""

from __future__ import annotations

from dataclasses import dataclass

from livemig.config import validate_job_name

ROOT = "/livemig/"


@dataclass(frozen=True)
class JobKeys:
    job: str

    def __post_init__(self) -> None:
        validate_job_name(self.job)

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.job}/"

    # -- membership and fencing ------------------------------------------------
    @property
    def generation(self) -> str:
        """Decimal generation number: the fencing token, changed only by CAS."""
        return self.prefix + "generation"

    @property
    def membership(self) -> str:
        """The member table's head: generation, state, world size, the rows' count and digest
        (the members themselves are rows: `row`)."""
        return self.prefix + "membership"

    @property
    def roster_prefix(self) -> str:
        return self.prefix + "roster/"

    def row(self, rank: int) -> str:
        """The member table's row of `rank`, versioned by generation (rdzv/roster.py)."""
        return f"{self.roster_prefix}{rank}"

    @property
    def members_prefix(self) -> str:
        return self.prefix + "members/"

    def member(self, rank: int) -> str:
        """Live registration of the process holding `rank` (under its lease)."""
        return f"{self.members_prefix}{rank}"

    @property
    def fenced_prefix(self) -> str:
        return self.prefix + "fenced/"

    def fenced(self, incarnation: str) -> str:
        return self.fenced_prefix + incarnation

    # -- runs and nodes (docs/protocol.md, "Runs and nodes") ------------------------
    @property
    def run(self) -> str:
        """The current run of the job: run id, nnodes, nproc_per_node, script signature."""
        return self.prefix + "run"

    @property
    def nodes_prefix(self) -> str:
        return self.prefix + "nodes/"

    def node(self, node_rank: int) -> str:
        """The agent holding node rank k (under its lease): run id, host, pid."""
        return f"{self.nodes_prefix}{node_rank}"

    # -- spares ------------------------------------------------------------------
    @property
    def spares_prefix(self) -> str:
        return self.prefix + "spares/"

    def spare(self, spare_id: str) -> str:
        return self.spares_prefix + spare_id

    @property
    def assignments_prefix(self) -> str:
        return self.prefix + "assignments/"

    def assignment(self, spare_id: str) -> str:
        """Written by the claim transaction: generation and rank for a spare."""
        return self.assignments_prefix + spare_id

    # -- coordinator ---------------------------------------------------------------
    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    # -- recovery protocol -------------------------------------------------------------
    @property
    def suspects_prefix(self) -> str:
        return self.prefix + "suspects/"

    def suspect(self, incarnation: str) -> str:
        return self.suspects_prefix + incarnation

    def scratch(self, name: str) -> str:
        """A key of the job's prefix that nothing reads (benchmarks time writes and watches on it)."""
        return f"{self.prefix}scratch/{name}"

    def preloop(self, rank: int) -> str:
        """What `rank` received from its collectives before its loop (runtime/preloop.py): a
        process entering the function again as that rank is answered from it."""
        return f"{self.prefix}preloop/{rank}"

    @property
    def signatures_prefix(self) -> str:
        return self.prefix + "signatures/"

    def signature(self, rank: int) -> str:
        """A member's layout signature (the coordinator checks a spare against it)."""
        return f"{self.signatures_prefix}{rank}"

    @property
    def recoveries_prefix(self) -> str:
        return self.prefix + "recovery/"

    def recovery_prefix(self, generation: int) -> str:
        return f"{self.prefix}recovery/{generation}/"

    def report(self, generation: int, rank: int) -> str:
        """A member's last committed step, sent when it enters `generation`."""
        return f"{self.recovery_prefix(generation)}report/{rank}"

    def cold_request(self, generation: int) -> str:
        """The cold path asks the agents for fresh processes for the lost ranks of `generation`."""
        return f"{self.recovery_prefix(generation)}cold"

    def ready(self, generation: int, rank: int) -> str:
        """Phase 1 done: the member built the process group of `generation`."""
        return f"{self.recovery_prefix(generation)}ready/{rank}"

    # -- observability ----------------------------------------------------------------
    @property
    def timeline_prefix(self) -> str:
        return self.prefix + "timeline/"

    def timeline(self, generation: int, seq: int, name: str) -> str:
        return f"{self.timeline_prefix}{generation:08d}/{seq:06d}-{name}"

    @property
    def timeline_archive(self) -> str:
        """Events of generations before the committed one, folded into one bounded value."""
        return self.prefix + "timeline-archive"

    @property
    def extras_check_prefix(self) -> str:
        return self.prefix + "extras-check/"

    def extras_check(self, rank: int) -> str:
        """Digests of a rank's replicated extras at the first boundary (compared by the coordinator)."""
        return f"{self.extras_check_prefix}{rank}"

    @property
    def errors_prefix(self) -> str:
        return self.prefix + "errors/"

    def error(self, incarnation: str) -> str:
        """A member's bug (runtime/bugs.py): rank, step, error, traceback."""
        return self.errors_prefix + incarnation

    @property
    def progress_prefix(self) -> str:
        """Members' per-step records. '~' sorts after every other key of the job (all other
        names are lowercase words), so [prefix, control_end) is every key but these: the
        coordinator's watch of the job leaves out a write per rank and step, which at
        10,000 ranks put its decisions a burst of 10,000 events behind etcd."""
        return self.prefix + "~progress/"

    @property
    def control_end(self) -> str:
        """The end of the range of every job key except the progress records."""
        return self.prefix + "~"

    def progress(self, rank: int) -> str:
        return f"{self.progress_prefix}{rank}"

    @property
    def follow_prefix(self) -> str:
        """Follow spares' state (runtime/follow.py): outside the coordinator's watch, as progress is."""
        return self.prefix + "~follow/"

    def follow(self, spare_id: str) -> str:
        return f"{self.follow_prefix}{spare_id}"

    @property
    def final_prefix(self) -> str:
        return self.prefix + "final/"

    def final(self, rank: int) -> str:
        """A member's end-of-run record: steps, state digest, commit times."""
        return f"{self.final_prefix}{rank}"

    @property
    def inject_requests_prefix(self) -> str:
        return self.prefix + "inject/requests/"

    def inject_request(self, rid: str) -> str:
        """`livemig inject` for a process on another host: its agent carries it out, then deletes this."""
        return f"{self.inject_requests_prefix}{rid}"

    def inject_self(self, incarnation: str) -> str:
        """Fault injection (`livemig inject wedge|break|corrupt`): the process `incarnation` (never
        a later holder of its rank) takes the fault at its next step boundary (corrupt: when it
        next serves a recovery), then deletes this."""
        return f"{self.prefix}inject/self/{incarnation}"

    @property
    def drains_prefix(self) -> str:
        return self.prefix + "drains/"

    def drain_request(self, node: int) -> str:
        """`livemig drain --node K`: node K's agent drains as on SIGTERM (removed by the agent)."""
        return f"{self.prefix}drain-request/{node}"

    def drain(self, node: int | None) -> str:
        """A node's agent drains on SIGTERM (agent/drain.py): its ranks, host and when."""
        return f"{self.drains_prefix}{node}"

    @property
    def stop(self) -> str:
        """The whole job is told to stop (every node draining, or a drain nobody can cover):
        the members agree on a step, write one checkpoint of it and exit (runtime/stop.py)."""
        return self.prefix + "stop"

    @property
    def migrate_request(self) -> str:
        """A planned-migration request (`livemig migrate`, a fault plan, the straggler hook)."""
        return self.prefix + "migrate/request"

    @property
    def migrate_result(self) -> str:
        """The outcome of the last migration request: done, rejected or aborted, with a reason."""
        return self.prefix + "migrate/result"

    def catchup(self, generation: int) -> str:
        """A migrating spare's catch-up progress (snapshot loaded, last step replayed)."""
        return f"{self.recovery_prefix(generation)}catchup"

    @property
    def config(self) -> str:
        """Job settings written once at creation (world size, signature)."""
        return self.prefix + "config"

    @property
    def secret(self) -> str:
        """Per-job shared secret authenticating state-transfer requests."""
        return self.prefix + "secret"

    @property
    def result(self) -> str:
        """Final outcome written by the coordinator (done / failed + reason)."""
        return self.prefix + "result"


def row_rank(keys: JobKeys, key: str) -> int | None:
    """The rank a `JobKeys.row` key names (None: not a row key). Not a JobKeys method: every
    method of JobKeys builds a key."""
    tail = key[len(keys.roster_prefix) :] if key.startswith(keys.roster_prefix) else ""
    return int(tail) if tail.isdigit() else None
