"""Checkpoints and the cold path end to end: real launcher, etcd, workers, gloo, DCP files.

- ZeRO-1 over 3 ranks: rank 1 dies inside its checkpoint write of step 9 (so that checkpoint
  never completes) and no spare exists: its agent starts a fresh process, which joins with the
  live state; then ranks 1 and 2 die together at step 13 (a shard and its mirror): live
  recovery cannot serve it, the job restarts from step 4's checkpoint (the newest complete)
  and ends bit-identical to the fault-free run; with --max-restarts 0 it fails with its line.
- A DDP-style loop (per-rank seed, BatchNorm buffers, a scheduler, a prefetched batch under
  local=, clipping): resumed with --resume-from from a checkpoint in the middle, skipping a
  corrupt newer one with a line naming it, and a rank wedged in the first step after the
  load, it ends equal rank by rank to a run that never stopped; rank 0's part loads into a
  plain model with torch.distributed.checkpoint alone.
- Checkpoints set by the script (ctx.checkpoints, every 0.15 s, agreed every 4 steps) and
  live recovery off (--recovery cold): a kill in the last step, with no spare, restarts from
  the newest one (rank 0, already done, enters the function again; rank 1 in a fresh
  process), and the run ends equal rank by rank to the fault-free one.
- ZeRO-1 resumed from 3 ranks' checkpoint on 2: the shards re-split, the whole optimizer state
  equal to the checkpoint's tensor by tensor, the run completes with exact mirrors.
- A checkpoint directory below a regular file, and a write failing mid-checkpoint: the job
  completes and the report counts the failures.

CI budget: ~2 min.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from tests.e2e.conftest import MLP_ZERO1, STEPS, WORKLOAD, explain, livemig_run, rank_files, reference_of
from tests.e2e.test_real_scripts import PORT, assert_same_run, port_work
from tests.e2e.test_real_scripts import STEPS as PORT_STEPS


def _ckpt(d, every: int, keep: int = 2) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(d), "--checkpoint-every", str(every), "--checkpoint-keep", str(keep))


def _steps(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("step_"))


def test_zero1_shard_and_mirror_lost_restarts_from_the_last_complete_checkpoint(tmp_path, reference_digest):
    ref = reference_digest(3, MLP_ZERO1)
    d = tmp_path / "ck"
    faults = ("kill:rank=1:step=9:during=checkpoint", "kill:rank=1:step=13", "kill:rank=2:step=13")
    run = livemig_run(tmp_path, 3, faults=faults, script=MLP_ZERO1, extra=_ckpt(d, 5, keep=10))
    rep = run.report
    assert run.rc == 0 and rep["result"]["state"] == "done", explain(run)
    assert rep["steps_completed"] == STEPS and rep["replicas_identical"], explain(run)
    assert rep["state_digest"] == ref, "final state differs from the fault-free run\n" + explain(run)
    assert rep["zero1"]["mirrors_exact"], rep["zero1"]
    kinds = [(r["kind"], r.get("fresh_processes")) for r in rep["recoveries"]]
    assert kinds == [("failure", [1]), ("restart", [1, 2])], explain(run)
    cold = rep["recoveries"][1]
    # step 9's checkpoint lacks rank 1's part (killed before it was durable): never loaded
    assert cold["from_step"] == 4 and cold["steps_redone"] == 9, cold
    assert list(cold["phases"]) == ["detect", "stop", "start", "load", "resume"] and cold["phases"]["load"] > 0, cold
    assert (d / "latest").read_text() == "step_0000000019"  # 9 was written again after the restart
    # the boundaries every final member wrote (ranks 1 and 2 are processes started at the restart)
    assert rep["checkpoints"]["steps"] == [14, 19] and rep["checkpoints"]["failed"] == 0, rep["checkpoints"]

    run = livemig_run(tmp_path, 3, faults=faults[1:], script=MLP_ZERO1, job="z0",
                      extra=(*_ckpt(tmp_path / "ck0", 5), "--max-restarts", "0"))  # fmt: skip
    assert run.rc != 0 and run.report["result"]["state"] == "failed", explain(run)
    reason = run.report["result"]["reason"]
    assert "optimizer shard" in reason and "--max-restarts 0 allows are spent" in reason, reason


def _phase_of(run, phase: str) -> dict:
    return next(e for e in run.report["timeline"] if e["phase"] == phase)


def _port_module():
    spec = importlib.util.spec_from_file_location("ddp_port", PORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_resume_a_ddp_port_from_a_middle_checkpoint_skipping_a_corrupt_one(tmp_path, references):
    got = reference_of(references, 2, PORT, port_work((), 0, "{out}"))  # shared with test_real_scripts
    ref = (got.report, rank_files(got.out))
    d = tmp_path / "ck"
    full_out = tmp_path / "out-full"
    full_out.mkdir()
    full = livemig_run(tmp_path, 2, script=PORT, job="full", workload=port_work((), 0, str(full_out)),
                       extra=_ckpt(d, 10, keep=4))  # fmt: skip
    assert_same_run(full, rank_files(full_out), ref)  # checkpoints change nothing
    assert _steps(d) == [f"step_{s:010d}" for s in (9, 19, 29, 39)], explain(full)
    assert (d / "latest").read_text() == "step_0000000039"

    # Interoperability: rank 0's part is a plain DCP checkpoint of the model.
    import torch.distributed.checkpoint as dcp

    port = _port_module()
    net = port.Net()
    sd = net.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(d / "step_0000000039" / "rank_00000"))
    net.load_state_dict(sd)
    assert port.typed(net.state_dict()) == rank_files(full_out)[0]["model"]

    # The job "died" after step 39's checkpoint was lost and step 29's got damaged.
    shutil.rmtree(d / "step_0000000039")
    part = d / "step_0000000029" / "rank_00001"
    victim = next(p for p in part.iterdir() if p.suffix == ".distcp")
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    out = tmp_path / "out-resumed"
    out.mkdir()
    # Rank 1 wedged in the first step after the load (no rank commits it): the spare takes rank 1
    # at the boundary the job resumed at, from its own part of the checkpoint (runtime/pull.py).
    run = livemig_run(tmp_path, 2, spares=1, faults=("wedge:rank=1:step=20",), script=PORT,
                      job="resumed", workload=port_work((), 0, str(out)), extra=("--resume-from", str(d)))  # fmt: skip
    assert_same_run(run, rank_files(out), ref)
    assert "skipping checkpoint" in run.stdout + run.stderr and "step_0000000029" in run.stdout + run.stderr
    assert "resuming from" in run.stdout and "step_0000000019" in run.stdout, explain(run)
    assert run.report["checkpoints"]["resumed_from"] == 19
    assert [r["kind"] for r in run.report["recoveries"]] == ["failure"], explain(run)
    assert _phase_of(run, "agree")["resume_step"] == 20, explain(run)


def test_checkpoints_set_by_the_script_on_an_interval_and_a_cold_restart_with_no_spare(tmp_path, references):
    got = reference_of(references, 2, PORT, port_work((), 0, "{out}"))
    ref = (got.report, rank_files(got.out))
    d, out = tmp_path / "ck-script", tmp_path / "out-cold"
    out.mkdir()
    # ctx.checkpoints(DIR, interval=0.15) in the script, no --checkpoint-dir: the coordinator
    # learns the directory from rank 0's registration; --recovery cold: no live recovery
    # rank 1 killed in the last step: rank 0 has left the training function (its final record
    # written) and enters it again to redo the steps since the checkpoint
    work = [*port_work((), 20, str(out)), "--ckpt-dir", str(d), "--ckpt-interval", "0.15"]
    last = PORT_STEPS - 1
    run = livemig_run(tmp_path, 2, faults=(f"kill:rank=1:step={last}",), script=PORT, job="cold", workload=work,
                      extra=("--recovery", "cold"), env={"LIVEMIG_CHECKPOINT_PROBE_STEPS": "4"})  # fmt: skip
    assert_same_run(run, rank_files(out), ref)
    recs = run.report["recoveries"]
    assert [(r["kind"], r.get("fresh_processes")) for r in recs] == [("restart", [1])], explain(run)
    cold = recs[0]
    assert cold["from_step"] % 4 == 3 and cold["steps_redone"] == last - cold["from_step"], cold
    assert "--recovery cold" in cold["reason"], cold
    ck = run.report["checkpoints"]
    # agreed at every 4th boundary only, and no sooner than the interval after the last one (the
    # writes of every final member: rank 1's fresh process may have written none, when the last
    # step's checkpoint completed before the kill and the restart had nothing to redo)
    written = [st for st, _, _ in ck["writes"]]
    assert written and all(st % 4 == 3 for st in written), ck
    starts = [at for st, at, _ in ck["writes"] if st <= cold["from_step"]]  # before the restart (redone after)
    assert all(b - a >= 0.14 for a, b in zip(starts, starts[1:], strict=False)), ck["writes"]


def _whole_shards(step_dir, world: int) -> dict[str, list]:
    """A ZeRO-1 checkpoint's shards put back together, bucket by bucket (the buckets' sizes
    from the model's parameters in backward order, as comm/reducer.py lays them out; each
    shard's slice of ceil(n / world) elements, its optimizer state covering the real elements
    only): what every world size must agree on."""
    from livemig.comm.reducer import bucket_layout
    from livemig.runtime.checkpoint import read_part

    params = [torch.empty(1024), torch.empty(1024, 1024)] * 2  # examples/mlp.py's --layers 2, reversed
    sizes = [sum(params[i].numel() for i in idx) for idx in bucket_layout(params)]
    parts = [read_part(str(step_dir / f"rank_{r:05d}"), {}, ["shard"])[1]["shard"] for r in range(world)]
    out: dict[str, list] = {"values": [], "exp_avg": [], "exp_avg_sq": [], "step": []}
    for b, n in enumerate(sizes):
        out["values"].append(torch.cat([p["values"][b] for p in parts])[:n])  # without the padding
    for key in ("exp_avg", "exp_avg_sq", "step"):
        per_bucket: list[list] = [[] for _ in sizes]
        for k, p in enumerate(parts):
            state = p["optimizer"]["state"]
            live = [b for b, n in enumerate(sizes) if k * -(-n // world) < n]  # one piece per bucket it reaches
            for i, b in enumerate(live):
                per_bucket[b].append(state[i][key])
        out[key] = [torch.cat(x) if key != "step" else torch.stack(x).unique() for x in per_bucket]
    return out


def test_a_zero1_checkpoint_resumed_at_another_world_size_is_resharded_exactly(tmp_path):
    d3, d2 = tmp_path / "ck3", tmp_path / "ck2"
    run = livemig_run(tmp_path, 3, script=MLP_ZERO1, job="w3", extra=_ckpt(d3, 5),
                      workload=["--steps", "10", *WORKLOAD[2:]])  # fmt: skip
    assert run.rc == 0 and _steps(d3) == ["step_0000000004", "step_0000000009"], explain(run)
    # 3 ranks' shards re-split over 2; the resharded state is written at once into the new
    # directory (step 9 again, 2 parts), then the job trains on to the end
    run = livemig_run(tmp_path, 2, script=MLP_ZERO1, job="w2", extra=("--resume-from", str(d3), *_ckpt(d2, 5, keep=10)))
    rep = run.report
    assert run.rc == 0 and rep["steps_completed"] == STEPS and rep["replicas_identical"], explain(run)
    assert rep["zero1"]["mirrors_exact"] and rep["checkpoints"]["resumed_from"] == 9, explain(run)
    assert _steps(d2) == ["step_0000000009", "step_0000000014", "step_0000000019"], _steps(d2)
    old, new = _whole_shards(d3 / "step_0000000009", 3), _whole_shards(d2 / "step_0000000009", 2)
    for key, tensors in old.items():
        for b, (x, y) in enumerate(zip(tensors, new[key], strict=True)):
            assert torch.equal(x, y), f"{key} of bucket {b} differs after resharding"
    # another script (the same model without ZeRO-1) is refused with one line, nothing trained
    run = livemig_run(tmp_path, 2, job="other", extra=("--resume-from", str(d3)))
    assert run.rc != 0 and run.report["steps_completed"] == 0, explain(run)
    assert "registered state differs" in run.report["result"]["reason"], explain(run)


def test_checkpoint_failures_do_not_fail_the_job(tmp_path, reference_digest):
    ref = reference_digest(2)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = livemig_run(tmp_path, 2, extra=_ckpt(blocker / "ck", 8), job="nd")  # below a regular file
    assert run.rc == 0 and run.report["state_digest"] == ref, explain(run)
    assert run.report["checkpoints"]["failed"] == 2 * (STEPS // 8), run.report["checkpoints"]
    assert run.report["checkpoints"]["steps"] == []
    d = tmp_path / "ck"
    run = livemig_run(tmp_path, 2, extra=_ckpt(d, 8), job="hook", env={"LIVEMIG_CHECKPOINT_FAIL_WRITE": "1:15"})
    assert run.rc == 0 and run.report["state_digest"] == ref, explain(run)
    ck = run.report["checkpoints"]
    assert ck["failed"] == 1 and ck["steps"] == [7, 23], ck
    logs = "".join(open(p["log"]).read() for p in run.report["processes"] if p["name"] == "worker-1")
    assert logs.count("checkpoint of step 15 failed on rank 1") == 1, logs[-3000:]
    assert (d / "latest").read_text() == "step_0000000023"
