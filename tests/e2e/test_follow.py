"""Follow spares (runtime/follow.py): a spare that keeps the group's state step by step takes
a lost rank with nothing streamed but what is not replicated, and the run stays the
fault-free run bit for bit. examples/ddp_port.py with a GradScaler whose loss overflows every
3rd step, unscale + clip, accumulation, the lr set by hand, a prefetched batch (local=) and
rank 0 saving: the loop a DDP user ports."""

from __future__ import annotations

from livemig.runtime.follow import feeder_rank
from tests.e2e.conftest import explain, livemig_run, rank_files
from tests.e2e.test_real_scripts import AMP, PORT, assert_same_run, port_work, reference  # noqa: F401 - the fixture

FOLLOWER = "spare-0"  # `--spares 2 --follow 1`: the first spare follows, the second stays warm


def _run(tmp_path, nproc, spares, job, faults=(), step_ms=5):
    """step_ms: a kill lands with the follower's path only once it follows (it attaches at a
    boundary of its feeder after its warm-up), so the faulted runs put the kill seconds in."""
    out = tmp_path / f"out-{job}"
    out.mkdir()
    run = livemig_run(tmp_path, nproc, spares=spares, faults=faults, script=PORT, job=job, extra=("--follow", "1"),
                      workload=port_work(tuple(AMP), step_ms, str(out)))  # fmt: skip
    return run, rank_files(out)


def test_a_follower_takes_a_killed_rank_and_a_warm_spare_the_next_exact(tmp_path, reference):  # noqa: F811
    ref = reference(3, tuple(AMP))
    feeder = feeder_rank(FOLLOWER, [0, 1, 2])
    first = next(r for r in (2, 1) if r != feeder)  # not the follower's feeder: it holds every step
    run, ranks = _run(tmp_path, 3, 2, "fw", (f"kill:rank={first}:step=24", f"kill:rank={feeder}:step=34"), 150)
    assert_same_run(run, ranks, ref)
    recs = run.report["recoveries"]
    assert [(r["rank"], r["spares"], r.get("path")) for r in recs] == [
        (first, [FOLLOWER], "follower"), (feeder, ["spare-1"], "stream")], explain(run)  # fmt: skip
    # the follower pulled what is not replicated only (the boundary's extras, the lost rank's
    # own state from its mirror, the clipped step's average); the warm spare all of it too
    assert 0 < recs[0]["bytes_streamed"] < recs[1]["bytes_streamed"], recs
    took = run.report["members"][str(first)]
    assert took["joined_at_step"] == 25, took
    assert (took.get("follow") or {}).get("took_over") is True, took
    assert "follower" in run.stdout, run.stdout


def test_a_run_with_a_follower_and_no_fault_equals_the_fault_free_run(tmp_path, reference):  # noqa: F811
    run, ranks = _run(tmp_path, 3, 1, "fn")
    assert_same_run(run, ranks, reference(3, tuple(AMP)))
    assert run.report["recoveries"] == [], explain(run)


def test_a_follower_stopped_for_3_s_drops_to_warm_without_slowing_training_and_a_kill_stays_exact(
        tmp_path, reference):  # noqa: F811  # fmt: skip
    """SIGSTOP the follower for 2 s once it follows (~20 steps, more than --follow-lag 2 behind;
    with the default lag of 4 a loaded CI host, ~0.5 s steps, trained only 4 steps meanwhile and
    the follower never dropped): training goes on at its pace (the feed is pulled, never pushed),
    the follower drops to warm standby, and the kill after it is recovered by streaming, exactly."""
    ref = reference(3, tuple(AMP))
    feeder = feeder_rank(FOLLOWER, [0, 1, 2])
    victim = next(r for r in (2, 1) if r != feeder)
    out = tmp_path / "out-fs"
    out.mkdir()
    # --lease-ttl 6: the stopped spare outlives its stop (the suite's 2 s would fence it)
    opts = ("--follow", "1", "--follow-lag", "2", "--lease-ttl", "6")
    run = livemig_run(tmp_path, 3, spares=1, script=PORT, job="fs", extra=opts,
                      faults=("spare-hang:step=6:resume=2", f"kill:rank={victim}:step=38"),
                      workload=port_work(tuple(AMP), 100, str(out)))  # fmt: skip
    assert_same_run(run, rank_files(out), ref)
    (rec,) = run.report["recoveries"]
    assert rec["path"] == "stream" and rec["spares"] == [FOLLOWER], explain(run)
    follow = run.report["members"][str(victim)].get("follow") or {}
    assert follow.get("drops", 0) >= 1 and not follow.get("took_over"), (follow, explain(run))
    # no step waited for the stopped follower: the commits went on at the median pace meanwhile
    times = [t for _, t in sorted(run.report["commit_times"])]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    median = sorted(gaps)[len(gaps) // 2]
    stalled = [g for (s, _), g in zip(sorted(run.report["commit_times"])[1:], gaps, strict=False) if 8 <= s <= 36]
    assert max(stalled) <= max(4 * median, median + 0.25), (median, stalled)


def test_a_planned_migration_onto_a_current_follower_streams_no_snapshot_and_stays_exact(tmp_path, reference):  # noqa: F811
    """The follower holds the state: the leaving worker serves its updates only (no snapshot);
    its rank-local state (the prefetched batch) and boundary come with the switch as always."""
    ref = reference(3, tuple(AMP))
    run, ranks = _run(tmp_path, 3, 1, "fm", ("migrate:rank=1:step=24",), 150)
    assert_same_run(run, ranks, ref)
    (mig,) = run.report["migrations"]
    assert (mig["outcome"], mig.get("path"), mig["bytes_streamed"]) == ("done", "follower", 0), explain(run)
    assert (run.report["members"]["1"].get("follow") or {}).get("took_over") is True, explain(run)
