"""The recovery's decisions, apart from their writes: `plan(view, policy) -> Plan`.

A RECOVERING generation is one question asked again each pass: given what the survivors
reported, which spares are warm and how long the recovery has waited, what now? Wait, fence
the survivors that stayed silent, fail with one line, take the cold path, ask the agents for
fresh processes, or claim spares (and let the survivors carry what no spare is left for: a
shrink). `plan` answers it from a `View` (data read from one snapshot) and a `Policy` (the
job's settings and the shrink policy) with no etcd, no clock and no filesystem, so every
outcome is unit-tested on views (tests/unit/test_recovery_plan.py); the coordinator builds the
view and applies the plan (coordinator/coordinator.py, `_recover` and `_apply`). The cold
path's own choice (spares or fresh processes for a restart from a checkpoint the coordinator
found on disk) is `plan_cold`; a shrunk job's grow, `plan_grow`. A `Plan` is also what the
checks (coordinator/checks.py) and a planned migration's failure (coordinator/migrations.py)
return: the coordinator's `_apply` is the one writer of every decision.

The layout's rules (a lost ZeRO-1 or FSDP2 shard, a lost rank-local state) are read from the
job's signature (coordinator/sharding.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from livemig.coordinator.sharding import (
    fsdp_mirrored,
    fsdp_shape,
    has_local_state,
    lost_fsdp_shards,
    lost_local_state,
    lost_shards,
    sharding_of,
)
from livemig.coordinator.shrink import ShrinkPolicy
from livemig.rdzv.membership import Member, Membership
from livemig.rdzv.writes import Op


@dataclass(frozen=True)
class Spare:
    """A warm spare nobody claimed or fenced, as its key reads (oldest first in a view);
    `mismatch`: how its registered state differs from the job's ("" when it matches)."""

    sid: str
    kv: Any  # rdzv.client.KV of its key: the claim compares its revision
    info: dict
    mismatch: str = ""


@dataclass(frozen=True)
class View:
    """What the planner reads of a RECOVERING generation: the membership, the survivors'
    reports (rank -> {"incarnation", "committed", "avg_step", "mirrors", "resumed"}), the
    job's signature, the buddy stride, the warm spares, whether any spare key exists at all
    (one may be warming up), the seconds since the generation began recovering, and whether
    the job has a checkpoint directory (fresh processes, the cold path)."""

    m: Membership
    reports: dict[str, dict]
    signature: list = field(default_factory=list)
    stride: int = 1
    spares: tuple[Spare, ...] = ()
    any_spare: bool = False
    waited: float = 0.0
    cold_dir: bool = False


@dataclass(frozen=True)
class Policy:
    """The job's settings the decisions depend on: how long a recovery may take
    (LIVEMIG_RECOVERY_TIMEOUT) and wait for a spare (LIVEMIG_SPARE_WAIT), the shrink policy
    (--min-nproc, --shrink-wait), whether live recovery is off (--recovery cold)."""

    recovery_s: float
    spare_wait_s: float
    shrink: ShrinkPolicy
    cold_forced: bool = False
    job: str = ""


@dataclass(frozen=True)
class Plan:
    """One decision: of a recovering generation (`plan`, `plan_cold`), of a shrunk job's grow
    (`plan_grow`), of a check (coordinator/checks.py) or of a planned migration's failure
    (coordinator/migrations.py). The coordinator writes it (`_apply`); nothing else decides.
    `action`:
    - "wait": nothing this pass;
    - "fence": `ranks` fenced into a RECOVERING generation of `kind` ("failure"; "grow", a
      spare takes back a carried rank; a rebuild of the same members when `ranks` is empty),
      from `table` (default the current one), with `carried` (default the current one);
    - "fail": the job fails with `reason`;
    - "cold": restart from a checkpoint because of `reason` (plan_cold decides how);
    - "fresh": the agents start a fresh process for each of `ranks` (`reason` says why);
    - "claim": spares `picks` take `vacant` at `resume` from `sources`; `carry` (a shrink):
      lost ranks the survivors carry; `restart`: the cold path's checkpoint;
    - "suspect": each (rank, why) of `suspects` is suspected, as if its agent had seen it
      die (a hang, a broken link): the next pass fences it;
    - "request": a planned migration is requested (`request`), if none is pending.
    `agreed`: the resume step stands (the timeline's agree event); `refuse`: spares refused
    (sid, why) because their model differs; `no_shrink`: why the job could not shrink;
    `events`: timeline events (phase, details) written with the decision (a fence's at the
    generation it starts); `extra`: more records written in the same transaction."""

    action: str
    reason: str = ""
    ranks: tuple[int, ...] = ()
    resume: int | None = None
    sources: tuple[int, ...] = ()
    vacant: tuple[int, ...] = ()
    picks: tuple[Spare, ...] = ()
    carry: tuple[int, ...] | None = None
    mode: str = ""
    restart: dict | None = None
    agreed: bool = False
    refuse: tuple[tuple[str, str], ...] = ()
    no_shrink: str = ""
    kind: str = "failure"
    table: Mapping[int, Member] | None = None
    carried: dict[int, int] | None = None
    suspects: tuple[tuple[int, str], ...] = ()
    request: dict | None = None
    events: tuple[tuple[str, dict], ...] = ()
    extra: tuple[Op, ...] = ()


def matching(spares: tuple[Spare, ...]) -> tuple[list[Spare], tuple[tuple[str, str], ...]]:
    """The spares whose model matches the job's, and the refusals (sid, why) of the others."""
    ok = [sp for sp in spares if not sp.mismatch]
    refuse = tuple((sp.sid, f"its model differs from the job's: {sp.mismatch}") for sp in spares if sp.mismatch)
    return ok, refuse


def plan(view: View, policy: Policy) -> Plan:
    """The next move of a RECOVERING generation (see the module doc)."""
    m, reports = view.m, view.reports
    waiting = [r for r, mem in m.members.items() if reports.get(str(r), {}).get("incarnation") != mem.incarnation]
    if waiting:  # silent survivors are treated as failed once the recovery timed out
        return Plan("fence", ranks=tuple(waiting)) if view.waited > policy.recovery_s else Plan("wait")
    holding = {r: reports[str(r)]["committed"] for r in m.members if reports[str(r)]["committed"] is not None}
    if not holding:
        return Plan("cold", reason="no surviving member holds the training state")
    if policy.cold_forced:
        return Plan("cold", reason="live recovery is off (--recovery cold)")
    resume = max(holding.values()) + 1
    behind = [r for r, c in holding.items() if c < resume - 2]
    if behind:
        return Plan("fail", reason=f"rank(s) {behind} are more than one step behind (invariant broken)")
    sources = sorted(r for r, c in holding.items() if c == resume - 1)
    sig = view.signature
    mode, mirrored = sharding_of(sig)
    # a rank a survivor carries (a shrunk job) is not vacant: the carrier runs it
    live_carried = {v: c for v, c in m.carried.items() if c in m.members}
    vacant = [r for r in range(m.world_size) if r not in m.members and r not in live_carried]
    local = has_local_state(sig)
    if local:
        orphans = [v for v in vacant if v in m.carried]
        if orphans:  # its local state lived only in its carrier's memory (no mirror while shrunk)
            return Plan("cold", reason=f"rank(s) {orphans}'s local state (buffers, local=) was carried by a lost "
                                       "survivor of the shrunk job and has no other copy")  # fmt: skip
    sharded = mode in ("zero1", "fsdp2")
    if sharded:  # every shard needs a live holder; a rank behind finishes from its own
        if mode == "zero1":
            lost = lost_shards(m.world_size, mirrored, set(holding), view.stride, m.carried)
        else:
            lost = lost_fsdp_shards(fsdp_shape(sig), vacant, set(holding), fsdp_mirrored(sig), view.stride)
        if lost:
            return Plan("cold", reason="; ".join(lost))
        short = [r for r, c in holding.items() if c == resume - 2 and reports[str(r)].get("avg_step") != resume - 1]
        if short:
            return Plan("fail", reason=f"rank(s) {short} lack the gradient slices of step {resume - 1}")
        if mode == "fsdp2":  # one step behind, it commits that step from its own shards in its catch-up,
            sources = sorted(holding)  # before it serves: the only mirror of a lost rank's shard may be there
    # the replay starts at boundary resume-2; after a load of boundary resume-1 there is none
    # (each rank's own state of it is its part of the checkpoint: runtime/pull.py); FSDP2
    # mirrors each boundary as it ends and a spare starts from resume-1 (runtime/strategies/fsdp2.py)
    resumed = any(reports[str(r)].get("resumed") == resume - 1 for r in sources)
    if local and m.world_size > 1 and resume >= 1 and not resumed:
        boundary = resume - 1 if mode == "fsdp2" else resume - 2
        lost = lost_local_state(m.world_size, vacant, reports, boundary, view.stride)
        if lost and m.carried:
            lost = [f"{x} (a shrunk job mirrors no local state)" for x in lost]
        if lost:
            return Plan("cold", reason="; ".join(lost))
    # a source must hold the average of step resume-1 for members one step behind
    if (
        not sharded
        and any(c == resume - 2 for c in holding.values())
        and not any(reports[str(r)].get("avg_step") == resume - 1 for r in sources)
    ):
        return Plan("fail", reason=f"no member holds the averaged gradient of step {resume - 1}")
    return _claim(view, policy, vacant, resume, sources, mode)


def _claim(view: View, policy: Policy, vacant: list[int], resume: int, sources: list[int], mode: str) -> Plan:
    """The agreed resume step stands: spares for the vacant ranks, or what to do without enough."""
    m = view.m
    ok, refuse = matching(view.spares)
    picks = ok[: len(vacant)]

    def agreed(action: str, **more: Any) -> Plan:
        return Plan(action, agreed=True, resume=resume, sources=tuple(sources), mode=mode, refuse=refuse, **more)

    if len(picks) >= len(vacant):
        return agreed("claim", vacant=tuple(vacant), picks=tuple(picks))
    missing = vacant[len(picks) :]
    # --min-nproc: the survivors carry the lost ranks no spare is left for (coordinator/shrink.py)
    d = policy.shrink.decide(m, vacant, len(picks), mode, view.waited)
    if d.action == "wait":
        return agreed("wait")
    if d.action == "shrink":  # the spares take the lowest ranks, the survivors carry the rest
        carry = d.carry if picks else vacant
        return agreed("claim", vacant=tuple(vacant[: len(picks)]), picks=tuple(picks), carry=tuple(carry))
    if view.cold_dir and (not view.any_spare or view.waited > policy.spare_wait_s):
        # No spare is coming: the agents start a fresh process for each lost rank, which joins
        # as a spare would (state streamed from the survivors, nothing redone).
        return agreed("fresh", ranks=tuple(missing), reason=f"no spare for rank(s) {missing}", no_shrink=d.why)
    if view.waited > policy.spare_wait_s:
        why = (f"no warm spare for rank(s) {missing} within {policy.spare_wait_s:.0f}s: start one with "
               f"`livemig-spare start --job {policy.job} SCRIPT` (LIVEMIG_SPARE_WAIT), or run with --checkpoint-dir "
               "to have the agents start fresh processes" + (f" (no shrink: {d.why})" if d.why else ""))  # fmt: skip
        return agreed("fail", reason=why, no_shrink=d.why)
    return agreed("wait", no_shrink=d.why)


def plan_cold(view: View, why: str, checkpoint: dict[str, Any] | str) -> Plan:
    """The cold path once the coordinator looked for a checkpoint (`checkpoint`: ColdPath.plan's
    {"path", "step", "redone"}, or the line saying why there is none to restart from): every
    lost rank is taken by a warm spare or, short of spares, by a fresh process from its node's
    agent; the survivors load the checkpoint in place."""
    if isinstance(checkpoint, str):
        return Plan("fail", reason=checkpoint)
    m = view.m
    vacant = [r for r in range(m.world_size) if r not in m.members]
    ok, refuse = matching(view.spares)
    picks = ok[: len(vacant)]
    if len(picks) < len(vacant):
        return Plan("fresh", ranks=tuple(vacant[len(picks) :]), reason=why, refuse=refuse)
    return Plan("claim", vacant=tuple(vacant), picks=tuple(picks), resume=checkpoint["step"] + 1,
                restart={**checkpoint, "reason": why}, refuse=refuse)  # fmt: skip


def plan_grow(m: Membership, spares: tuple[Spare, ...], shrink: ShrinkPolicy) -> Plan:
    """A shrunk job with a warm spare: hand the spare a carried rank back (the lowest), through
    a recovery of that rank: the survivors stop at their next collective, the spare takes the
    rank with its state streamed (its local state from the carrier, its buddy), and the job
    runs one process wider from the agreed step (runtime/virtual.py)."""
    ok, refuse = matching(spares)
    if not m.carried or not ok:
        return Plan("wait", refuse=refuse)
    v, carried = shrink.grow(m)
    return Plan("fence", kind="grow", carried=carried, refuse=refuse,
                reason=f"grow: a warm spare takes back rank {v} from rank {m.carried[v]}",
                events=(("grow", {"rank": v, "carrier": m.carried[v]}),))  # fmt: skip
