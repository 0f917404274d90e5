"""Shrink: no spare, the survivors carry the lost rank (`--min-nproc`, runtime/virtual.py).

The script (tests/helpers/shrink_proc.py) is a DDP port: per-rank seeds, a DataLoader over
an ElasticSampler, BatchNorm buffers, a `local=` meter, a weight decay set by hand,
clipping, a scheduler after ctx.step(). Every forward records (step, rank, sample ids,
the meter's count): a shrunk run must read exactly the fault-free run's samples per
(step, virtual rank), with each carried rank's own local state, and end bit for bit in the
fault-free run's state, rank by rank, carried ranks included: a shrunk step reduces every
rank's gradient in the full-width group, a carrier holding one gloo endpoint per rank it
runs (runtime/virtual.py reduce_exact).

CI budget: ~4 min (four reference runs, seven short jobs of 3 workers and two of 4).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.conftest import REPO, explain, livemig_run

SCRIPT = os.path.join(REPO, "tests", "helpers", "shrink_proc.py")
STEPS = 30
SHRINK = ("--min-nproc", "2", "--shrink-wait", "0.5")


def _run(tmp_path, job, faults=(), extra=(), steps=STEPS, nproc=3, args=(), spares=0):
    dump = tmp_path / f"dump-{job}"
    dump.mkdir()
    run = livemig_run(tmp_path, nproc, spares=spares, faults=faults, extra=extra, script=SCRIPT, job=job,
                      workload=["--steps", str(steps), "--dump", str(dump), *args])  # fmt: skip
    return run, dump


def samples_of(dump) -> dict[tuple[int, int], tuple]:
    """(step, rank) -> (sample ids, meter count) of the last forward of it (a replay
    reads the same ones again)."""
    out = {}
    for f in dump.glob("samples*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[(r["step"], r["rank"])] = (r["ids"], r["meter"])
    return out


def finals_of(dump) -> dict[int, dict]:
    return {int(f.stem[5:]): json.loads(f.read_text()) for f in dump.glob("final*.json")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shrink-ref")
    run, dump = _run(tmp, "ref")
    assert run.rc == 0, explain(run)
    return samples_of(dump), finals_of(dump), run.report


@pytest.mark.parametrize("fault,carrier", [("kill:rank=2:step=10", 0), ("kill:rank=0:step=10:during=allreduce", 1)],
                         ids=["rank2-between-steps", "rank0-in-the-average"])  # fmt: skip
def test_a_lost_rank_is_carried_with_the_same_samples_and_global_batch(tmp_path, reference, fault, carrier):
    ref_samples, ref_finals, ref_report = reference
    run, dump = _run(tmp_path, "sh", faults=(fault,), extra=SHRINK)
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == STEPS, explain(run)
    (rec,) = run.report["recoveries"]
    lost = int(fault.split("rank=")[1].split(":")[0])
    assert rec["kind"] == "shrink" and rec["carried"] == {str(lost): carrier}, rec
    sh = run.report["shrunk"]
    assert (sh["physical_world_size"], sh["virtual_world_size"]) == (2, 3), sh
    assert sh["degraded_steps"] >= STEPS - 12, sh
    samples = samples_of(dump)
    assert samples.keys() == ref_samples.keys()  # every (step, rank) ran, the lost rank's included
    differ = sorted(k for k in ref_samples if samples[k] != ref_samples[k])
    assert not differ, f"(step, rank) whose samples or local meter differ from the fault-free run's: {differ[:8]}"
    finals = finals_of(dump)
    assert set(finals) == {0, 1, 2} - {lost}
    _exact(finals, ref_finals)
    _same_digests(run.report, ref_report)
    assert run.report["replicas_identical"], explain(run)


def _same_digests(report, ref_report):
    """Every rank's whole state (parameters, optimizer values and hyperparameters, extras,
    buffers, local=, a ZeRO-1 shard and its mirror) bit for bit the fault-free run's: the
    carried ranks' from the records their carriers wrote (runtime/standby.py). A ZeRO-1 job
    that ends shrunk mirrors other shards than at full width (config.zero1_layout): there the
    job's sharded state (the model, every shard by its index) and every mirror's equality to
    its shard are compared."""
    if report.get("shrunk", {}).get("carried") and "zero1" in report:
        assert report["zero1"]["state_digest"] == ref_report["zero1"]["state_digest"], "optimizer shards differ"
        assert report["zero1"]["mirrors_exact"], report["zero1"]
        return
    got, want = report["rank_digests"], ref_report["rank_digests"]
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    differ = sorted(r for r in want if got[r] != want[r])
    assert not differ, f"ranks whose final state differs from the fault-free run's: {differ}"


def _exact(finals, ref_finals):
    """Every process's final parameters and buffers bit for bit the fault-free run's (a shrunk
    step reduces in the full-width group: runtime/virtual.py reduce_exact), its meter and lr too."""
    for r, f in finals.items():
        want = ref_finals[r]["state"]
        differ = sorted(k for k, vals in want.items() if f["state"][k] != vals)
        assert not differ, f"rank {r}: {differ} differ from the fault-free run's"
        assert f["meter"]["n"] == ref_finals[r]["meter"]["n"] and f["lr"] == ref_finals[r]["lr"]


def test_a_second_loss_of_a_shrunk_stateless_job_shrinks_it_again(tmp_path):
    """4 ranks, --min-nproc 2: rank 3 lost at step 8 (carried by 0), rank 1 at step 16 (carried by
    2, the stateless job's next survivor): 2 processes finish the 4 ranks' 30 steps."""
    ref, ref_dump = _run(tmp_path, "ref4", nproc=4, args=("--stateless",))
    assert ref.rc == 0, explain(ref)
    run, dump = _run(tmp_path, "sh2", nproc=4, args=("--stateless",), extra=SHRINK,
                     faults=("kill:rank=3:step=8", "kill:rank=1:step=16"))  # fmt: skip
    assert run.rc == 0, explain(run)
    assert [r["kind"] for r in run.report["recoveries"]] == ["shrink", "shrink"], explain(run)
    assert run.report["shrunk"]["carried"] == {"1": 2, "3": 0} and run.report["steps_completed"] == STEPS
    assert samples_of(dump) == samples_of(ref_dump)
    finals = finals_of(dump)
    assert set(finals) == {0, 2}
    _exact(finals, finals_of(ref_dump))
    _same_digests(run.report, ref.report)


def test_two_lost_ranks_and_one_spare_the_spare_takes_one_the_survivors_carry_the_other(tmp_path):
    """4 ranks with local state, one warm spare, ranks 1 and 3 killed at step 8: one recovery in
    which the spare takes rank 1 (its local state from its buddy, rank 2) and rank 0 carries
    rank 3 (it mirrors rank 3's local state): same samples, every process within the bound."""
    ref, ref_dump = _run(tmp_path, "ref4s", nproc=4)
    assert ref.rc == 0, explain(ref)
    run, dump = _run(tmp_path, "two", nproc=4, spares=1, extra=SHRINK,
                     faults=("kill:rank=1:step=8", "kill:rank=3:step=8"))  # fmt: skip
    assert run.rc == 0, explain(run)
    (rec,) = run.report["recoveries"]
    assert rec["kind"] == "shrink" and rec["carried"] == {"3": 0} and len(rec["spares"]) == 1, rec
    assert run.report["shrunk"]["physical_world_size"] == 3 and run.report["steps_completed"] == STEPS
    assert samples_of(dump) == samples_of(ref_dump)
    finals = finals_of(dump)
    assert set(finals) == {0, 1, 2}
    _exact(finals, finals_of(ref_dump))
    _same_digests(run.report, ref.report)


def test_a_second_loss_of_a_shrunk_job_with_local_state_fails_with_its_line(tmp_path):
    """While shrunk, rank-local state is not mirrored: a further loss needs a checkpoint."""
    run, _ = _run(tmp_path, "shl", nproc=4, extra=SHRINK, steps=20,
                  faults=("kill:rank=3:step=6", "kill:rank=1:step=12"))  # fmt: skip
    assert run.rc != 0
    reason = (run.report.get("result") or {}).get("reason", "")
    assert "rank 1's local state" in reason and "a shrunk job mirrors no local state" in reason, explain(run)


def test_without_shrink_a_lost_rank_with_no_spare_fails_the_job_with_its_line(tmp_path):
    """--min-nproc 3 is the world: no shrink, the job fails after the spare wait, as without it."""
    run, _ = _run(tmp_path, "nos", faults=("kill:rank=1:step=4",), extra=("--min-nproc", "3", "--spare-wait", "2"),
                  steps=12)  # fmt: skip
    assert run.rc != 0
    reason = (run.report.get("result") or {}).get("reason", "")
    assert "no warm spare for rank(s) [1] within 2s" in reason, explain(run)


@pytest.fixture(scope="module")
def zero1_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shrink-zero1-ref")
    ref, ref_dump = _run(tmp, "zref", args=("--zero1",))
    assert ref.rc == 0, explain(ref)
    # per-rank seeds: the shards are cut again from the parameters the start-up sync made rank 0's
    assert ref.report["zero1"]["mirrors_exact"] and ref.report["replicas_identical"], explain(ref)
    (ref_dump / "report.json").write_text(json.dumps(ref.report))
    return ref_dump


def test_zero1_shrink_inside_the_reduction_adopts_the_shard(tmp_path, zero1_reference):
    """ZeRO-1, rank 2 killed with step 10's gradients in flight: nobody passed the barrier, so
    the carrier (rank 0, which mirrored shard 2) defers its step to rank 2's body and owns shard
    2 from then on; rank 1 takes the mirrors the layout moves to it (config.zero1_layout).
    Same samples; every rank bit for bit; the replicas identical. CI ~15 s."""
    ref_dump = zero1_reference
    ref_report = json.loads((ref_dump / "report.json").read_text())
    _shrunk_in_step_10_exactly(tmp_path, "zsh", ("--zero1",), ref_report, ref_dump)


def _shrunk_in_step_10_exactly(tmp_path, job, args, ref_report, ref_dump):
    """Rank 2 of 3 killed inside step 10's reduction with no spare: carried by rank 0 to the end,
    every (step, rank) on the fault-free samples and every rank's state bit for bit."""
    run, dump = _run(tmp_path, job, faults=("kill:rank=2:step=10:during=allreduce",), extra=SHRINK, args=args)
    assert run.rc == 0, explain(run)
    (rec,) = run.report["recoveries"]
    assert rec["kind"] == "shrink" and rec["carried"] == {"2": 0}, rec
    assert run.report["steps_completed"] == STEPS
    assert samples_of(dump) == samples_of(ref_dump)
    _exact(finals_of(dump), finals_of(ref_dump))
    _same_digests(run.report, ref_report)
    assert run.report["replicas_identical"] and run.report["zero1"]["mirrors_exact"], explain(run)


def test_zero1_with_clipping_shrunk_inside_a_step_takes_the_new_layouts_slices(tmp_path):
    """ZeRO-1 whose every step takes the whole average (ctx.clip_grad_norm_: WholeAverage), rank 2
    killed inside step 10: the survivors' barrier fails after their average completed, the job
    shrinks, and the retried step cuts the slices of the shards the shrunk layout gives each
    survivor (the carrier owns shard 2 now) from the same clipped gradient (before, the slices of
    the full-width layout were kept and the carrier failed: "no gradient slice for optimizer shard
    2"). A survivor that lacks the average takes it from one that completed it (its bits: the
    full group's), so the run is bit for bit the fault-free one; the later shrunk steps reduce
    through the full-width group. Same samples, replicas identical. CI ~35 s."""
    args = ("--zero1", "--zero1-clip")
    ref, ref_dump = _run(tmp_path, "zcref", args=args)
    assert ref.rc == 0, explain(ref)
    _shrunk_in_step_10_exactly(tmp_path, "zcsh", args, ref.report, ref_dump)


def test_a_checkpoint_written_while_shrunk_holds_the_carried_rank(tmp_path, zero1_reference):
    """The carrier writes the part of each rank it carries (its local state, its ZeRO-1 shard),
    so checkpoints stay complete while shrunk: resumed at full width from one written after
    the shrink, the job ends within the bound of the fault-free run, every rank's meter and
    samples its own. CI ~20 s."""
    import shutil

    ckpt = tmp_path / "ckpt"
    run, _ = _run(tmp_path, "zck", faults=("kill:rank=2:step=8",), args=("--zero1",),
                  extra=(*SHRINK, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"))  # fmt: skip
    assert run.rc == 0, explain(run)
    assert run.report["recoveries"][0]["kind"] == "shrink", explain(run)
    assert run.report["checkpoints"]["steps"][-2:] == [24, 29], run.report["checkpoints"]
    one = tmp_path / "resume"  # the boundary of step 24, written shrunk: rank 2's part by rank 0
    one.mkdir()
    shutil.copytree(ckpt / "step_0000000024", one / "step_0000000024")
    assert sorted(p.name for p in (one / "step_0000000024").glob("rank_*.done")) == [
        "rank_00000.done", "rank_00001.done", "rank_00002.done"]  # fmt: skip
    (one / "latest").write_text("step_0000000024")
    back, dump = _run(tmp_path, "zrs", args=("--zero1",), extra=("--resume-from", str(one)))
    assert back.rc == 0 and back.report["steps_completed"] == STEPS, explain(back)
    assert back.report["zero1"]["mirrors_exact"] and back.report["replicas_identical"], explain(back)
    ref = samples_of(zero1_reference)
    got = samples_of(dump)
    assert sorted({s for s, _ in got}) == list(range(25, STEPS)) and all(got[k] == ref[k] for k in got)
    finals = finals_of(dump)
    assert set(finals) == {0, 1, 2}
    _exact(finals, finals_of(zero1_reference))


@pytest.mark.parametrize("args", [(), ("--zero1",)], ids=["plain", "zero1"])
def test_a_spare_started_later_takes_the_carried_rank_back(tmp_path, etcd, procs, args):
    """80 steps on 3 ranks, rank 2 lost at step 10 with no spare: shrunk, then a spare started by
    `livemig-spare start` once the job runs shrunk takes rank 2 back (its local state from its
    carrier, rank 0; with ZeRO-1 its optimizer shard too) and the job ends at full width; every
    (step, rank) read the fault-free run's samples, and every rank, the grown-back one included,
    ends within the bound; ZeRO-1: every shard present and equal to its mirror. CI ~40 s each."""
    import time
    from datetime import timedelta

    from livemig.rdzv.client import EtcdClient
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import Membership

    steps = 80  # the spare starts only once the job runs shrunk: its warm-up (2-5 s on a loaded host) is degraded time
    work = ["--steps", str(steps), "--sleep", "0.1", *args]
    ref, ref_dump = _run(tmp_path, "gref", steps=steps, args=("--sleep", "0.1", *args))
    assert ref.rc == 0, explain(ref)
    dump = tmp_path / "dump-grow"
    dump.mkdir()
    env = {"LIVEMIG_STATE_DIR": str(tmp_path), "LIVEMIG_LOG_LEVEL": "INFO", "SHRINK_DUMP": str(dump)}
    report = tmp_path / "report-grow.json"
    job = procs.python("-m", "livemig.cli", "run", "--etcd", etcd.endpoints, "--nproc", "3", *SHRINK, "--job", "grow",
                       "--report", str(report), "--lease-ttl", "2", "--fault", "kill:rank=2:step=10", SCRIPT, *work,
                       env=env, cwd=REPO)  # fmt: skip
    client = EtcdClient(etcd.endpoints, timedelta(seconds=5))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # shrunk: the survivors carry rank 2
        kv = client.get(JobKeys("grow").membership)
        if kv is not None and Membership.from_bytes(kv.value).carried:
            break
        assert job.poll() is None, job.communicate()[1][-3000:]
        time.sleep(0.2)
    else:
        raise AssertionError("the job never shrank")
    procs.python("-m", "livemig.spare_pool.cli", "start", "--etcd", etcd.endpoints, "--job", "grow", SCRIPT, *work,
                 env=env, cwd=REPO)  # fmt: skip
    out, err = job.communicate(timeout=180)
    rep = json.loads(report.read_text())
    assert job.returncode == 0, out[-2000:] + err[-3000:]
    assert [r["kind"] for r in rep["recoveries"]] == ["shrink", "grow"], rep["recoveries"]
    assert rep["recoveries"][1]["rank"] == 2 and rep["recoveries"][1]["spares"], rep["recoveries"]
    sh = rep["shrunk"]
    assert sh["grew_back"] and sh["physical_world_size"] == 3 and sh["carried"] == {}, sh
    assert 0 < sh["degraded_steps"] <= steps - 10, sh  # grown back with >= 10 steps at full width
    assert rep["steps_completed"] == steps
    assert samples_of(dump) == samples_of(ref_dump)
    finals = finals_of(dump)
    assert set(finals) == {0, 1, 2}
    _exact(finals, finals_of(ref_dump))
    _same_digests(rep, ref.report)
    if args:  # every shard held by its owner again, each mirror equal to it bit for bit
        z = rep["zero1"]
        assert z["mirrored"] and z["mirrors_exact"], z
        assert sorted(rep["rank_digests"]) == ["0", "1", "2"], rep["rank_digests"]
