"""The recovery planner on views, without etcd (livemig/coordinator/recovery.py): each outcome
of a RECOVERING generation, double failures, no spare, shrink, a shrunk job's grow, the cold
path, a failure during a recovery. The coordinator's writes of these plans are exercised end to end in tests/e2e."""

from __future__ import annotations

import pytest

from livemig.config import LOCAL_STATE_ENTRY, SHARDING_ENTRY
from livemig.coordinator.recovery import Plan, Policy, Spare, View, plan, plan_cold, plan_grow
from livemig.coordinator.shrink import ShrinkPolicy
from livemig.rdzv.membership import GenState, Member, Membership

MODEL = [["0.weight", "float32", [4, 4]]]
ZERO1 = [*MODEL, [SHARDING_ENTRY, "zero1", [1]]]
FSDP_PLAIN = [*MODEL, [SHARDING_ENTRY, "fsdp2", [4]], ["<fsdp2-mirror>", "mirrored", []]]
FSDP_UNMIRRORED = [*MODEL, [SHARDING_ENTRY, "fsdp2", [4]], ["<fsdp2-mirror>", "unmirrored", []]]
LOCAL = [*MODEL, [LOCAL_STATE_ENTRY, "mirrored", []]]


def policy(min_nproc: int = 0, shrink_wait: float = 5.0, cold: bool = False, world: int = 4) -> Policy:
    sp = ShrinkPolicy(world)
    sp.min_nproc, sp.wait_s = (min_nproc or world), shrink_wait
    return Policy(recovery_s=60.0, spare_wait_s=30.0, shrink=sp, cold_forced=cold, job="j")


def membership(world: int, lost: list[int], carried: dict[int, int] | None = None) -> Membership:
    members = {r: Member(r, f"w{r}") for r in range(world) if r not in lost and r not in (carried or {})}
    return Membership(generation=3, state=GenState.RECOVERING, world_size=world, members=members,
                      carried=dict(carried or {}))  # fmt: skip


def reports(m: Membership, committed: dict[int, int | None], **extra: dict) -> dict[str, dict]:
    out = {}
    for r, mem in m.members.items():
        out[str(r)] = {"incarnation": mem.incarnation, "committed": committed.get(r, 9), "avg_step": 9,
                       "mirrors": [7, 8, 9], "resumed": None, **extra.get(str(r), {})}  # fmt: skip
    return out


def spares(*sids: str, mismatch: str = "") -> tuple[Spare, ...]:
    return tuple(Spare(s, object(), {"incarnation": f"s-{s}"}, mismatch) for s in sids)


def view(m: Membership, rep: dict, sig: list = MODEL, sp: tuple = (), waited: float = 1.0,
         cold_dir: bool = False, any_spare: bool | None = None) -> View:  # fmt: skip
    return View(m, rep, sig, 1, sp, bool(sp) if any_spare is None else any_spare, waited, cold_dir)


def test_a_survivor_that_has_not_reported_is_waited_for():
    m = membership(4, [3])
    rep = reports(m, {})
    del rep["1"]
    assert plan(view(m, rep), policy()).action == "wait"


def test_survivors_silent_past_the_recovery_timeout_are_fenced():
    m = membership(4, [3])
    rep = reports(m, {})
    rep["2"]["incarnation"] = "an older incarnation"  # a report from a fenced process does not count
    p = plan(view(m, rep, waited=61.0), policy())
    assert (p.action, p.ranks) == ("fence", (2,))


def test_one_lost_rank_claims_the_oldest_warm_spare_at_the_next_step():
    m = membership(4, [3])
    p = plan(view(m, reports(m, {}), sp=spares("a", "b")), policy())
    assert p.action == "claim" and p.agreed and p.vacant == (3,) and [s.sid for s in p.picks] == ["a"]
    assert p.resume == 10 and p.sources == (0, 1, 2) and p.carry is None


def test_a_step_some_survivors_committed_is_finished_by_the_others():
    m = membership(4, [3])
    p = plan(view(m, reports(m, {0: 9, 1: 8, 2: 8}), sp=spares("a")), policy())
    assert p.action == "claim" and p.resume == 10 and p.sources == (0,)


def test_a_step_behind_with_nobody_holding_its_average_fails_with_one_line():
    m = membership(4, [3])
    rep = reports(m, {0: 9, 1: 8, 2: 8}, **{"0": {"avg_step": 8}})
    p = plan(view(m, rep, sp=spares("a")), policy())
    assert p.action == "fail" and "averaged gradient of step 9" in p.reason


def test_a_survivor_two_steps_behind_breaks_the_invariant():
    m = membership(4, [3])
    p = plan(view(m, reports(m, {0: 9, 1: 7, 2: 9}), sp=spares("a")), policy())
    assert p.action == "fail" and "more than one step behind" in p.reason


def test_two_lost_ranks_claim_two_spares_in_one_generation():
    m = membership(4, [1, 3])
    p = plan(view(m, reports(m, {}), sp=spares("a", "b", "c")), policy())
    assert p.action == "claim" and p.vacant == (1, 3) and [s.sid for s in p.picks] == ["a", "b"]


def test_a_spare_whose_model_differs_is_refused_and_the_next_one_claimed():
    m = membership(4, [3])
    sp = (*spares("odd", mismatch="entry 0: ..."), *spares("good"))
    p = plan(view(m, reports(m, {}), sp=sp), policy())
    assert p.action == "claim" and [s.sid for s in p.picks] == ["good"]
    assert p.refuse == (("odd", "its model differs from the job's: entry 0: ..."),)


def test_no_spare_waits_then_fails_naming_the_rank_and_the_fix():
    m = membership(4, [3])
    assert plan(view(m, reports(m, {}), waited=10.0), policy()).action == "wait"
    p = plan(view(m, reports(m, {}), waited=31.0), policy())
    assert p.action == "fail" and "no warm spare for rank(s) [3] within 30s" in p.reason
    assert "livemig-spare start --job j" in p.reason


def test_no_spare_with_a_checkpoint_directory_asks_for_fresh_processes():
    m = membership(4, [3])
    p = plan(view(m, reports(m, {}), cold_dir=True, any_spare=False), policy())
    assert (p.action, p.ranks) == ("fresh", (3,)) and p.agreed


def test_no_spare_within_the_shrink_wait_shrinks_onto_the_survivors():
    m = membership(4, [3])
    pol = policy(min_nproc=2, shrink_wait=5.0)
    assert plan(view(m, reports(m, {}), waited=2.0), pol).action == "wait"
    p = plan(view(m, reports(m, {}), waited=6.0), pol)
    assert p.action == "claim" and p.vacant == () and p.picks == () and p.carry == (3,)


def test_fewer_spares_than_lost_ranks_shrinks_only_the_rest():
    m = membership(4, [1, 3])
    p = plan(view(m, reports(m, {}), sp=spares("a"), waited=6.0), policy(min_nproc=2))
    assert p.action == "claim" and p.vacant == (1,) and [s.sid for s in p.picks] == ["a"] and p.carry == (3,)


def test_a_shrink_below_min_nproc_is_refused_and_says_why():
    m = membership(4, [1, 2, 3])
    p = plan(view(m, reports(m, {}), waited=6.0), policy(min_nproc=2))
    assert p.action == "wait" and "fewer than --min-nproc 2" in p.no_shrink


def test_fsdp2_never_shrinks():
    m = membership(4, [3])
    p = plan(view(m, reports(m, {}), sig=FSDP_PLAIN, waited=6.0), policy(min_nproc=2))
    assert p.action == "wait" and "fsdp2" in p.no_shrink


def test_an_fsdp2_rank_a_step_behind_is_a_source():
    """It commits that step from its own shards in its catch-up, before serving: the lost rank's
    shard mirror may live only there."""
    m = membership(4, [2])
    p = plan(view(m, reports(m, {0: 9, 1: 9, 3: 8}), sig=FSDP_PLAIN, sp=spares("a")), policy())
    assert p.action == "claim" and p.resume == 10 and p.sources == (0, 1, 3)


def test_a_rank_carried_by_a_live_survivor_is_not_vacant():
    m = membership(4, [1], carried={3: 2})
    p = plan(view(m, reports(m, {}), sp=spares("a")), policy())
    assert p.action == "claim" and p.vacant == (1,)


def test_a_zero1_shard_and_its_mirror_lost_together_takes_the_cold_path():
    m = membership(4, [1, 2])  # shard 1 lives on rank 1 and its mirror on rank 2
    p = plan(view(m, reports(m, {}), sig=ZERO1, sp=spares("a", "b")), policy())
    assert p.action == "cold" and "optimizer shard 1" in p.reason


def test_zero1_two_non_adjacent_losses_are_live():
    m = membership(4, [0, 2])
    p = plan(view(m, reports(m, {}), sig=ZERO1, sp=spares("a", "b")), policy())
    assert p.action == "claim" and p.vacant == (0, 2)


def test_an_unmirrored_fsdp_shard_lost_takes_the_cold_path():
    m = membership(4, [2])
    p = plan(view(m, reports(m, {}), sig=FSDP_UNMIRRORED, sp=spares("a")), policy())
    assert p.action == "cold" and "FSDP2 shard 2" in p.reason


def test_local_state_whose_mirror_was_lost_too_takes_the_cold_path():
    m = membership(4, [2, 3])  # rank 2's local state is mirrored on rank 3
    p = plan(view(m, reports(m, {}), sig=LOCAL, sp=spares("a", "b")), policy())
    assert p.action == "cold" and "rank 2's local state" in p.reason


def test_local_state_mirrored_on_a_survivor_is_live():
    m = membership(4, [2])
    p = plan(view(m, reports(m, {}), sig=LOCAL, sp=spares("a")), policy())
    assert p.action == "claim"


def test_no_survivor_holding_state_and_forced_cold_take_the_cold_path():
    m = membership(4, [3])
    rep = reports(m, {0: None, 1: None, 2: None})  # only spares that never loaded a state are left
    assert plan(view(m, rep), policy()) == Plan("cold", reason="no surviving member holds the training state")
    assert plan(view(m, reports(m, {})), policy(cold=True)).reason == "live recovery is off (--recovery cold)"


def test_a_failure_during_a_recovery_plans_over_the_newer_generation():
    """A spare claimed in generation 3 died before the commit: generation 4 fences it, and the
    plan claims another spare for the same rank with the same agreed step."""
    m = membership(4, [3])
    m = Membership(generation=4, state=GenState.RECOVERING, world_size=4, members=m.members)
    p = plan(view(m, reports(m, {}), sp=spares("second")), policy())
    assert p.action == "claim" and p.vacant == (3,) and p.resume == 10


@pytest.mark.parametrize("spare_count,action", [(2, "claim"), (1, "fresh")])
def test_the_cold_path_takes_spares_or_fresh_processes(spare_count, action):
    m = membership(4, [2, 3])
    ck = {"path": "/ck/step_0000000007", "step": 7, "redone": 2}
    p = plan_cold(view(m, reports(m, {}), sp=spares(*"ab"[:spare_count])), "both lost", ck)
    assert p.action == action
    if action == "claim":
        assert p.resume == 8 and p.restart == {**ck, "reason": "both lost"} and p.vacant == (2, 3)
    else:
        assert p.ranks == (3,) and p.reason == "both lost"


def test_the_cold_path_without_a_checkpoint_fails_with_its_line():
    m = membership(4, [3])
    p = plan_cold(view(m, reports(m, {})), "why", "why; no complete checkpoint in /ck to restart from")
    assert p == Plan("fail", reason="why; no complete checkpoint in /ck to restart from")


def test_a_shrunk_job_with_a_warm_spare_grows_back_its_lowest_carried_rank():
    m = membership(4, [], carried={1: 2, 3: 0})
    m.state = GenState.COMMITTED
    p = plan_grow(m, spares("a"), policy(min_nproc=2).shrink)
    assert (p.action, p.kind, p.ranks) == ("fence", "grow", ())  # a recovery of the same members
    assert p.carried == {3: 0} and p.events == (("grow", {"rank": 1, "carrier": 2}),)
    assert "takes back rank 1 from rank 2" in p.reason


def test_a_shrunk_job_does_not_grow_onto_a_spare_whose_model_differs():
    m = membership(4, [], carried={1: 2})
    m.state = GenState.COMMITTED
    p = plan_grow(m, spares("odd", mismatch="0.weight: shape [4, 4] != [8, 8]"), policy(min_nproc=2).shrink)
    assert p.action == "wait" and p.refuse and p.refuse[0][0] == "odd"
    assert plan_grow(m, (), policy(min_nproc=2).shrink).action == "wait"  # no spare: trains on shrunk
    whole = membership(4, [])
    assert plan_grow(whole, spares("a"), policy().shrink).action == "wait"  # nothing carried: no grow
