"""FSDP2 and HSDP (issue 32): one lost rank of a sharded job replaced exactly, every other rank
keeping its process and its shard. The workload is a port-style loop (tests/helpers/fsdp_port.py:
per-rank seed, accumulation under no_sync, clipping, the lr set by hand, a prefetched batch under
local=, BatchNorm buffers, rank 0 saving) on a (replicate 2, shard 2) mesh of 4 workers.

Each faulted run is compared with the fault-free run, rank by rank: local shards of the
parameters and the optimizer state, buffers, the carried batch, and the report's rank digests.
CI budget: ~6 min (three references, eight faulted HSDP runs (a wedge among them), plain FSDP with and without its
mirror, a planned migration then a kill on each mesh, three refusals, two or three cold restarts from checkpoints).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.e2e.conftest import REPO, explain, livemig_run, rank_files, reference_of

PORT = os.path.join(REPO, "tests", "helpers", "fsdp_port.py")
STEPS = 14


def _work(out: str, *extra: str) -> list[str]:
    return ["--steps", str(STEPS), *extra, "--out", out]


def _reference(references, *extra: str):
    ref = reference_of(references, 4, PORT, _work("{out}", *extra))
    ranks = rank_files(ref.out)
    assert len(ranks) == 4
    return ref.report, ranks


@pytest.fixture(scope="session")
def hsdp_reference(references):
    return _reference(references)


@pytest.fixture(scope="session")
def stateless_reference(references):
    return _reference(references, "--stateless")


def _run(tmp_path, faults, spares=1, job="f", nproc=4, extra=(), env=None, cli=()):
    out = tmp_path / f"out-{job}"
    out.mkdir()
    run = livemig_run(tmp_path, nproc, spares=spares, faults=faults, script=PORT, job=job, extra=tuple(cli),
                      workload=_work(str(out), *extra), timeout=300, env=env)  # fmt: skip
    return run, rank_files(out)


def _assert_exact(run, ranks, ref, recoveries: int) -> None:
    ref_report, ref_ranks = ref
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == STEPS, explain(run)
    assert run.report["replicas_identical"], explain(run)
    assert len(run.report["recoveries"]) == recoveries, explain(run)
    assert not run.report.get("faults_not_fired"), explain(run)
    for r, want in ref_ranks.items():
        for part in ("model", "optimizer", "carry"):
            assert ranks[r][part] == want[part], f"rank {r}'s {part} differs from the fault-free run's"
        assert ranks[r]["sums"] == want["sums"], f"rank {r}: a mesh dimension's all-reduce differs after recovery"
    assert run.report["rank_digests"] == ref_report["rank_digests"], explain(run)


def test_two_kills_between_steps_and_in_a_reduce_scatter_are_exact_and_keep_the_mesh(tmp_path, hsdp_reference):
    """Rank 3 killed at a boundary, then rank 1 inside a backward reduce-scatter: two spares take
    them; the survivors redo the failed step in place and keep their mesh object throughout."""
    run, ranks = _run(tmp_path, ("kill:rank=3:step=4", "kill:rank=1:step=9:during=fsdp_reduce_scatter"), spares=2)
    _assert_exact(run, ranks, hsdp_reference, recoveries=2)
    for r in (0, 2):  # survivors of both recoveries: the function was entered 3 times, one mesh object
        full = [e for e in ranks[r]["entries"] if e[3] == 4]
        assert len(full) == 3, ranks[r]["entries"]
        assert {e[2] for e in full} == {ranks[r]["mesh_id"]}, ranks[r]["entries"]
    # (replicate 2, shard 2): rank = 2 * replicate + shard; the sums over each dimension
    for r in range(4):
        rep, sh = divmod(r, 2)
        assert ranks[r]["sums"] == {"replicate": float(2 * sh + 4), "shard": float(4 * rep + 3)}, ranks[r]


@pytest.mark.parametrize("during", ["fsdp_allgather", "replicate_allreduce", "clip_norm"])
def test_a_kill_inside_each_collective_of_the_step_is_exact(tmp_path, hsdp_reference, during):
    """The forward's all-gather, HSDP's replicate all-reduce, the clip's norm all-reduce."""
    run, ranks = _run(tmp_path, (f"kill:rank=2:step=6:during={during}",), job=during.replace("_", ""))
    _assert_exact(run, ranks, hsdp_reference, recoveries=1)
    assert run.report["recoveries"][0]["rank"] == 2, explain(run)


def test_a_kill_after_the_commit_vote_is_finished_by_the_survivors_and_exact(tmp_path, stateless_reference):
    """Rank 2 dies right after its commit vote completed: the survivors commit the step (or
    finish it from their shards in the recovery) and the spare starts after it. Rank 0, the only
    replica of rank 2's shard, loses the vote's result: it finishes the step from its own shards
    in its catch-up and serves the spare that shard (a source, though a step behind)."""
    faults = ("kill:rank=2:step=6:during=before_commit", "drop_avg:rank=0:step=6")
    run, ranks = _run(tmp_path, faults, job="vote", extra=("--stateless",))
    _assert_exact(run, ranks, stateless_reference, recoveries=1)


def test_local_state_lost_between_commit_and_boundary_fails_with_its_line(tmp_path):
    """The window FSDP2 cannot cover live (docs/architecture.md): rank 2 dies after the step's
    commit, before its boundary's local state reached its mirror; with no checkpoint the job
    fails with the line naming the state, instead of going on with a guess."""
    run, _ = _run(tmp_path, ("kill:rank=2:step=6:during=before_commit",), job="window")
    assert run.rc != 0, explain(run)
    reason = (run.report.get("result") or {}).get("reason", "")
    assert "rank 2's local state (buffers, local=) of step 6 is lost" in reason, explain(run)


def test_plain_fsdp_recovers_from_the_shard_mirror_and_fails_with_one_line_without_it(tmp_path, references):
    """A 1-D mesh keeps one copy of each shard: the mirror on the right neighbour (on by default
    for plain FSDP) recovers a rank killed in a reduce-scatter exactly, each mirror equal to the
    shard it mirrors at the end; with the mirror off the job fails with the line naming the shard."""
    plain = ("--replicate", "1", "--stateless")
    ref = reference_of(references, 3, PORT, _work("{out}", *plain))
    ref_ranks = rank_files(ref.out)
    run, ranks = _run(tmp_path, ("kill:rank=1:step=5:during=fsdp_reduce_scatter",), nproc=3, job="plain",
                      extra=plain)  # fmt: skip
    _assert_exact(run, ranks, (ref.report, ref_ranks), recoveries=1)
    assert run.report["fsdp2"]["mirrored"] and run.report["fsdp2"]["mirrors_exact"], explain(run)
    off, _ = _run(tmp_path, ("kill:rank=1:step=3",), nproc=3, job="nomirror", extra=plain,
                  env={"LIVEMIG_FSDP2_MIRROR": "0"})  # fmt: skip
    assert off.rc != 0, explain(off)
    reason = (off.report.get("result") or {}).get("reason", "")
    assert "FSDP2 shard 1 of rank 1 is lost" in reason and "mirror is off" in reason, explain(off)


def test_every_holder_of_a_shard_lost_restarts_from_the_checkpoint_exactly(tmp_path, hsdp_reference, references):
    """What live recovery cannot cover goes to the cold path: both replicas of shard 1 (ranks 1
    and 3) killed in one step; every rank's own shards were written at each checkpointed
    boundary, so the job restarts from step 7's checkpoint (the survivors in place, two fresh
    processes) and ends as the fault-free run, rank by rank. Plain FSDP with its mirror: a
    shard and its mirror lost together (ranks 1 and 2), each mirror rebuilt from its owner's
    part, exact at the end."""
    ck = ("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4")
    run, ranks = _run(tmp_path, ("kill:rank=1:step=9", "kill:rank=3:step=9"), job="cold", cli=ck)
    _assert_exact(run, ranks, hsdp_reference, recoveries=1)
    cold = run.report["recoveries"][0]
    assert cold["kind"] == "restart" and cold["from_step"] == 7 and cold["steps_redone"] == 2, explain(run)
    plain = ("--replicate", "1", "--stateless")
    ref = reference_of(references, 3, PORT, _work("{out}", *plain))
    ck = ("--checkpoint-dir", str(tmp_path / "ck-plain"), "--checkpoint-every", "4")
    run, ranks = _run(tmp_path, ("kill:rank=1:step=9", "kill:rank=2:step=9"), spares=0, nproc=3, job="coldplain",
                      extra=plain, cli=ck)  # fmt: skip
    _assert_exact(run, ranks, (ref.report, rank_files(ref.out)), recoveries=1)
    assert run.report["recoveries"][0]["kind"] == "restart", explain(run)
    assert run.report["fsdp2"]["mirrored"] and run.report["fsdp2"]["mirrors_exact"], explain(run)


def test_a_spare_wrapped_differently_is_refused_naming_the_difference(tmp_path):
    """The spare wraps only the root: refused at claim time with the difference named, and the
    job (no other spare) fails after the spare wait."""
    run, _ = _run(tmp_path, ("kill:rank=0:step=3",), job="wrap", extra=("--spare-root-only",),
                  env={"LIVEMIG_SPARE_WAIT": "4"})  # fmt: skip
    assert run.rc != 0, explain(run)
    text = explain(run)
    assert "its model differs from the job's" in text and "fully_shard('', 'inp', 'mid')" in text, text


def _migration(run) -> dict:
    migs = run.report.get("migrations") or []
    assert [m["outcome"] for m in migs] == ["done"], explain(run)
    return migs[0]


@pytest.mark.parametrize("mesh", ["hsdp", "plain"])
def test_a_planned_migration_then_a_kill_of_the_rank_it_mirrors_is_exact(tmp_path, references, mesh):
    """Rank 1 migrates to a spare (its shard replayed from the gradient shards it stepped with,
    after the clip), then rank 0 is killed: rank 0's local state (HSDP) or its whole shard
    (plain FSDP) comes from the mirror on rank 1, i.e. from what the migrated spare took over.
    Both end bit-identical to the fault-free run, with one migration and one recovery."""
    extra = () if mesh == "hsdp" else ("--replicate", "1", "--stateless")
    nproc = 4 if mesh == "hsdp" else 3
    ref = reference_of(references, nproc, PORT, _work("{out}", *extra))
    faults = ("migrate:rank=1:step=3", "kill:rank=0:step=11:during=migrated")
    run, ranks = _run(tmp_path, faults, spares=2, nproc=nproc, job=mesh, extra=(*extra, "--step-ms", "150"))
    _assert_exact(run, ranks, (ref.report, rank_files(ref.out)), recoveries=1)
    mig = _migration(run)
    assert mig["outcome"] == "done" and mig["switch_step"] >= 4 and mig["resyncs"] == 0, mig
    if mesh == "plain":
        assert run.report["fsdp2"]["mirrors_exact"], explain(run)


def test_a_rank_lost_after_its_commit_vote_is_exact_and_its_checkpoint_resumes_on_its_mesh(tmp_path, hsdp_reference):
    """Rank 2 dies right after step 9's commit vote passed on it: the peers that commit step 9
    never receive its local state of boundary 9 (sent to the mirror after the commit), so the
    recovery is live when no peer committed and a restart from step 7's checkpoint when one
    did; either way exact. That checkpoint (BatchNorm buffers and a carried batch: rank-local
    state) then refuses a run of another world size with one line."""
    ck = tmp_path / "ck"
    cli = ("--checkpoint-dir", str(ck), "--checkpoint-every", "4")
    run, ranks = _run(tmp_path, ("kill:rank=2:step=9:during=before_commit",), job="postvote", cli=cli)
    _assert_exact(run, ranks, hsdp_reference, recoveries=1)
    rec = run.report["recoveries"][0]
    assert rec["kind"] != "restart" or rec["from_step"] == 7, explain(run)
    two, _ = _run(tmp_path, (), spares=0, nproc=2, job="reshard", cli=("--resume-from", str(ck)))
    assert two.rc != 0, explain(two)
    reason = (two.report.get("result") or {}).get("reason", "") or explain(two)
    assert "rank-local state has no rule to map it to another layout: resume it with --nproc 4" in reason, reason


def test_a_checkpoint_resumes_on_another_mesh_with_its_shards_recut_exactly(tmp_path):
    """Issue 52 item 4: an HSDP job's checkpoint (2 x 2: two shards of 16 rows) resumes on plain
    FSDP 1 x 3 (shards of 11, 11 and 10 rows, and an empty one for a one-row weight). After the
    load every parameter and optimizer tensor, joined over the shards, equals the checkpoint's
    (the re-cut state is written at once into the new --checkpoint-dir), the mirrors hold their
    neighbours' new shards, and the steps after it equal those of a run resumed at the same
    world size from that written state. (1 x 4 on 1 x 2 and the other cuts: the unit test of
    fsdp2_shards.recut, and `bench faults --grid matrix`'s resume column.)"""
    from livemig.runtime.strategies.fsdp2_shards import whole_of_checkpoint

    flat = ("--stateless", "--replicate", "1")

    def ck(d) -> tuple[str, ...]:
        return "--checkpoint-dir", str(tmp_path / d), "--checkpoint-every", "5"

    def resumed(run, d_old, w_old, d_new, w_new) -> None:
        assert run.rc == 0 and run.report["steps_completed"] == STEPS, explain(run)
        assert run.report["checkpoints"]["resumed_from"] == 9 and run.report["fsdp2"]["mirrors_exact"], explain(run)
        old = whole_of_checkpoint(str(tmp_path / d_old / "step_0000000009"))
        new = whole_of_checkpoint(str(tmp_path / d_new / "step_0000000009"))
        for d, w in ((d_old, w_old), (d_new, w_new)):
            assert json.loads((tmp_path / d / "step_0000000009" / "manifest.json").read_text())["world"] == w
        for i, (x, y) in enumerate(zip(old[0], new[0], strict=True)):
            assert torch.equal(x, y), f"parameter {i} differs after the re-cut"
        assert old[1].keys() == new[1].keys()
        for key, x in old[1].items():
            assert torch.equal(x, new[1][key]), f"optimizer state {key} differs after the re-cut"

    hsdp, _ = _run(tmp_path, (), spares=0, nproc=4, job="h4", extra=("--stateless",), cli=ck("ckh"))
    assert hsdp.rc == 0, explain(hsdp)
    three, three_ranks = _run(tmp_path, (), spares=0, nproc=3, job="h3", extra=flat,
                              cli=("--resume-from", str(tmp_path / "ckh"), *ck("ck3")))  # fmt: skip
    resumed(three, "ckh", 4, "ck3", 3)
    again, again_ranks = _run(tmp_path, (), spares=0, nproc=3, job="h3b", extra=flat,
                              cli=("--resume-from", str(tmp_path / "ck3")))  # fmt: skip
    assert again.rc == 0 and again.report["checkpoints"]["resumed_from"] == 9, explain(again)
    for r in range(3):
        for part in ("model", "optimizer"):
            assert three_ranks[r][part] == again_ranks[r][part], f"rank {r}'s {part}: the re-cut run trained otherwise"


def test_a_wedged_training_thread_is_found_by_its_peers_waits_and_replaced_exactly(tmp_path, hsdp_reference):
    """Rank 1's training thread blocks at the start of step 6 (its lease lives on): the other
    ranks wait in FSDP2's forward all-gather, their waits reach the coordinator's hang
    detection as the plain path's do, rank 1 is fenced and replaced, and the run is exact."""
    run, ranks = _run(tmp_path, ("wedge:rank=1:step=6",), job="wedge", env={"LIVEMIG_HANG_TIMEOUT": "4"})
    _assert_exact(run, ranks, hsdp_reference, recoveries=1)
    (hang,) = [e for e in run.report["timeline"] if e["phase"] == "hang"]
    assert hang["ranks"] == [1] and 4 <= hang["waited_s"] < 6, hang  # the hang timeout, not the collective's


FULL = os.path.join(REPO, "tests", "helpers", "fsdp_full_proc.py")


@pytest.mark.parametrize("mesh", ["hsdp", "fsdp"])
def test_full_state_dicts_before_and_inside_the_loop_survive_a_kill_a_migration_and_a_cold_restart(
    tmp_path, references, mesh
):
    """Issue 50: HSDP 2 x 2 (and plain FSDP 1 x 3, its shards mirrored) unsharding its model
    before the loop (`full_tensor()`, recorded and answered on re-entry: runtime/preloop.py) and
    gathering `get_model_state_dict(full_state_dict=True, cpu_offload=True)` every 5 steps after
    ctx.step(), rank 0 writing its digest: the saver killed and another rank migrated, then a
    cold restart; the state and the saved full state dicts equal the fault-free run's (the cold
    path redoes steps after its checkpoint, so a redone step's save is made again, with the same
    bits)."""
    nproc, shape = (4, []) if mesh == "hsdp" else (3, ["--replicate", "1"])
    work = ["--steps", "20", "--out", "{out}", *shape]
    ref = reference_of(references, nproc, FULL, work)
    want = (ref.out / "saves.jsonl").read_text().splitlines()
    assert [int(x.split('"step": ')[1].split(",")[0]) for x in want] == [4, 9, 14, 19], want

    def run(job: str, faults: tuple[str, ...], spares: int, extra: tuple[str, ...] = ()) -> list[str]:
        out = tmp_path / job
        out.mkdir()
        r = livemig_run(tmp_path, nproc, spares=spares, faults=faults, script=FULL, job=job, extra=extra,
                        workload=["--steps", "20", "--out", str(out), *shape])  # fmt: skip
        assert r.rc == 0 and r.report["steps_completed"] == 20, explain(r)
        assert r.report["state_digest"] == ref.digest, "final state differs from the fault-free run\n" + explain(r)
        return (out / "saves.jsonl").read_text().splitlines()

    assert run("live", ("kill:rank=0:step=6", "migrate:rank=2:step=12"), spares=2) == want
    ck = ("--recovery", "cold", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4")
    cold = run("cold", ("kill:rank=1:step=9",), spares=0, extra=ck)
    assert sorted(set(cold)) == sorted(want) and len(cold) >= len(want), cold
