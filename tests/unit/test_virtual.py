"""Shrink's pure pieces: the shrunk membership's group, its settings, the report's section."""

from __future__ import annotations

import pytest

from livemig.agent.report import shrunk
from livemig.config import ENV_MIN_NPROC, ENV_SHRINK_WAIT, shrink_settings
from livemig.errors import ConfigError
from livemig.rdzv.membership import Member, Membership
from livemig.rdzv.roster import encode_versions, pack_row


def _table(ranks, carried=None, world=3):
    return Membership(world_size=world, members={r: Member(r, f"i{r}", "h", 1, "") for r in ranks},
                      carried=carried or {})  # fmt: skip


def test_a_shrunk_group_is_its_survivors_in_rank_order_and_survives_the_wire():
    m = _table([0, 2], {1: 2})
    assert (m.group_size, m.group_rank(0), m.group_rank(2)) == (2, 0, 1)
    rows = [(r, encode_versions([[0, pack_row(mem)]])) for r, mem in m.members.items()]
    back = Membership.assemble(m.to_bytes(), rows, check=False)
    assert back.carried == {1: 2} and back.group_rank(2) == 1
    full = _table([0, 1, 2])
    assert (full.group_size, full.group_rank(2)) == (3, 2)  # not shrunk: the rank is the group rank


def test_shrink_settings_default_to_no_shrink_and_refuse_a_bad_count(monkeypatch):
    monkeypatch.delenv(ENV_MIN_NPROC, raising=False)
    monkeypatch.delenv(ENV_SHRINK_WAIT, raising=False)
    assert shrink_settings(4) == (4, 5.0)
    monkeypatch.setenv(ENV_MIN_NPROC, "2")
    monkeypatch.setenv(ENV_SHRINK_WAIT, "0.5")
    assert shrink_settings(4) == (2, 0.5)
    monkeypatch.setenv(ENV_MIN_NPROC, "9")
    with pytest.raises(ConfigError, match="--min-nproc 9: expected 1..4"):
        shrink_settings(4)


def test_the_report_counts_degraded_steps_and_their_step_time():
    commits = [(s, 0.1 * s) for s in range(10)] + [(s, 1.0 + 0.2 * (s - 10)) for s in range(10, 20)]
    events = [{"phase": "shrink", "resume_step": 10, "time": 1.0}]
    sh = shrunk(_table([0, 1], {2: 0}), events, commits)
    assert sh["degraded_steps"] == 10 and sh["degraded_from_step"] == 10
    assert sh["carried"] == {2: 0} and sh["physical_world_size"] == 2
    assert sh["degraded_step_cost"] == pytest.approx(2.0, rel=1e-3)


def test_shrink_policy_waits_then_shrinks_and_says_why_it_cannot():
    """coordinator/shrink.py: the decision of a recovery short of spares (pure logic; the e2e
    tests in tests/e2e/test_shrink.py run it for real)."""
    import os

    from livemig.config import ENV_MIN_NPROC, ENV_SHRINK_WAIT
    from livemig.coordinator.shrink import ShrinkPolicy
    from livemig.rdzv.membership import Member, Membership

    def members(*ranks: int) -> dict:
        return {r: Member(r, f"inc-{r}", "h", 1, "") for r in ranks}

    old = {k: os.environ.get(k) for k in (ENV_MIN_NPROC, ENV_SHRINK_WAIT)}
    try:
        os.environ.pop(ENV_MIN_NPROC, None)
        assert ShrinkPolicy(4).decide(Membership(world_size=4, members=members(0, 1, 2)), [3], 0, "", 9).action == "no"
        os.environ[ENV_MIN_NPROC], os.environ[ENV_SHRINK_WAIT] = "2", "1"
        p = ShrinkPolicy(4)
        m = Membership(world_size=4, members=members(0, 2))
        assert p.decide(m, [1, 3], 0, "", 0.5).action == "wait"
        assert p.decide(m, [1, 3], 1, "", 1.5) == p.decide(m, [1, 3], 1, "zero1", 1.5)
        assert p.decide(m, [1, 3], 1, "", 1.5).carry == [3]  # the spare takes rank 1
        assert "sharding=fsdp2" in p.decide(m, [1, 3], 0, "fsdp2", 9).why
        assert "fewer than --min-nproc 2" in p.decide(Membership(world_size=4, members=members(2)), [0, 1, 3], 0,
                                                      "", 9).why  # fmt: skip
        assert p.carriers(m, [1, 3], 1, "") == {1: 2, 3: 0}
        m2 = Membership(world_size=4, members=members(0, 2), carried={3: 1})  # 1 carried 3 and died
        assert p.carriers(m2, [1, 3], 1, "zero1") == {1: 2, 3: 0}  # 3's shard mirror: rank 0
        assert p.grow(Membership(world_size=4, members=members(0, 2), carried={3: 0, 1: 2})) == (1, {3: 0})
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_gpu_paths_shrunk_bound_compares_every_rank_and_says_when_values_are_missing(tmp_path, monkeypatch):
    """cli/run.py shrunk_bound: what --verify holds a shrunk run to where no full-width group
    exists (NCCL: docs/architecture.md, Shrink); on gloo a shrunk run is bit for bit and never
    gets here (tests/e2e/test_verify.py)."""
    import torch

    from livemig.cli.run import shrunk_bound

    monkeypatch.setenv("LIVEMIG_VERIFY_SHRUNK_BOUND", "1e-6")
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    base = torch.linspace(-2.0, 2.0, 101, dtype=torch.float64)
    for r in range(2):
        torch.save(base, ref / f"final-{r}.pt")
        torch.save(base.clone(), run / f"final-{r}.pt")
    assert shrunk_bound(str(ref), str(run), 2) == {"within": True, "max_rel": 0.0, "bound": 1e-6, "ranks": 2}
    off = base.clone()
    off[7] += 2e-5  # 1e-5 of max|param| 2.0
    torch.save(off, run / "final-1.pt")
    b = shrunk_bound(str(ref), str(run), 2)
    assert b is not None and not b["within"] and abs(b["max_rel"] - 1e-5) < 1e-9, b
    assert shrunk_bound(str(ref), str(run), 3) is None  # rank 2's values missing: not compared


def test_a_zero1_job_that_ended_shrunk_is_exact_by_its_shards_not_its_rank_digests():
    """cli/run.py zero1_shrunk_exact: --verify (and the matrix) call a ZeRO-1 job that ended
    shrunk exact when every shard by index, each mirror and every rank's values are the
    fault-free run's; the rank digests differ by construction (other mirrors on other ranks)."""
    from livemig.cli.run import zero1_shrunk_exact

    ref = {"zero1": {"state_digest": "abc", "mirrors_exact": True}}
    rep = {"shrunk": {"carried": {"2": 0}}, "zero1": {"state_digest": "abc", "mirrors_exact": True}}
    equal = {"within": True, "max_rel": 0.0, "bound": 1e-6, "ranks": 3}
    assert zero1_shrunk_exact(rep, ref, equal)
    assert not zero1_shrunk_exact(rep, ref, {**equal, "max_rel": 1e-9})  # a rank's values moved
    assert not zero1_shrunk_exact(rep, ref, None)  # values missing: not compared
    assert not zero1_shrunk_exact({**rep, "zero1": {"state_digest": "abd", "mirrors_exact": True}}, ref, equal)
    assert not zero1_shrunk_exact({**rep, "zero1": {"state_digest": "abc", "mirrors_exact": False}}, ref, equal)
    assert not zero1_shrunk_exact({**rep, "shrunk": {"carried": {}}}, ref, equal)  # grown back: digests say
    assert not zero1_shrunk_exact({"shrunk": rep["shrunk"]}, ref, equal)  # not a ZeRO-1 job
