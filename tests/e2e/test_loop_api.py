"""The loop verbs users know from DDP and Accelerate, held to the exactness standard.

ctx.clip_grad_norm_ against DDP's semantics (average, then clip by the global
norm), the averaged-then-clipped step across a kill, examples/char_lm.py (a
DataLoader with 2 workers and ElasticSampler, bf16 autocast, clipping, a
scheduler) killed and compared rank by rank, fp32+bf16 parameters through both
reduction paths, a GradScaler across a kill, and the misuses that get one line.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from tests.e2e.conftest import REPO, explain, livemig_run, reference_of
from tests.e2e.test_exact_state import assert_rank_by_rank, run_script
from tests.e2e.test_exact_state import reference as reference  # noqa: F401 - the shared fixture
from tests.helpers import clip_proc

CLIP = os.path.join(REPO, "tests", "helpers", "clip_proc.py")
CHAR_LM = os.path.join(REPO, "examples", "char_lm.py")


def _clip_run(tmp_path, job, faults=(), extra=()):
    out = tmp_path / f"out-{job}"
    out.mkdir()
    run = livemig_run(tmp_path, 2, spares=1 if faults else 0, faults=faults, script=CLIP, job=job,
                      workload=["--steps", "12", "--out", str(out), *extra])  # fmt: skip
    return run, {int(os.path.basename(f)[4:-5]): json.load(open(f)) for f in glob.glob(str(out / "rank*.json"))}


def test_clip_grad_norm_is_ddp_semantics_and_exact_across_a_kill(tmp_path):
    run, got = _clip_run(tmp_path, "clip")
    assert run.rc == 0, explain(run)
    # DDP + clip_grad_norm_: the mean of both ranks' gradients, clipped by its global norm.
    model, opt = clip_proc.model_and_opt()
    norms = []
    for step in range(12):
        grads = []
        for r in range(2):
            model.zero_grad()
            x, y = clip_proc.batch(step, r, 2)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, a, b in zip(model.parameters(), *grads, strict=True):
            p.grad = (a + b) / 2
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
    # Tolerance: gloo sums in another order than (a + b) / 2 on one host only for > 2 ranks; stated 1e-6.
    assert got[0]["norms"] == got[1]["norms"]
    assert max(abs(a - b) / b for a, b in zip(got[0]["norms"], norms, strict=True)) < 1e-6
    assert max(n > 1.0 for n in norms), "the clip never bit: the test would not see a wrong norm"
    for k, v in model.state_dict().items():
        assert torch.allclose(torch.tensor(got[0]["state"][k]), v, rtol=1e-5, atol=1e-6), k
    # Across a kill landing in the average: bit-identical, norms included.
    killed, got2 = _clip_run(tmp_path, "clipk", faults=("kill:rank=1:step=6:during=allreduce",))
    assert killed.rc == 0 and killed.report["recoveries"], explain(killed)
    # the kill the worker fires itself inside the average is reported as the agent's own are
    fired = [(f["kind"], f["rank"], f["step"], f["during"]) for f in killed.report["faults_injected"]]
    assert fired == [("kill", 1, 6, "allreduce")], killed.report["faults_injected"]
    assert "injected kill of worker-1 (rank 1) in step 6 during allreduce (in-process)" in killed.stdout
    assert [got2[r]["state"] for r in (0, 1)] == [got[r]["state"] for r in (0, 1)]
    assert got2[0]["norms"] == got[0]["norms"]  # the survivor saw every step's norm
    n = len(got2[1]["norms"])  # the spare's list (not registered) starts at the step it replayed
    assert 0 < n < 12 and got2[1]["norms"] == got[1]["norms"][-n:]


def test_accumulation_misuse_gets_one_line(tmp_path):
    run, _ = _clip_run(tmp_path, "acc", extra=("--misuse",))
    text = run.stdout + run.stderr + json.dumps(run.report)
    assert run.rc != 0 and "wrap all but the last micro-batch's backward in" in text, explain(run)
    assert "Received data size" not in text


CHAR_STEPS = ["--steps", "24", "--batch", "8"]


def test_char_lm_killed_rank_by_rank_with_loader_workers(tmp_path, references):
    ref = reference_of(references, 2, CHAR_LM, CHAR_STEPS)
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=11",), script=CHAR_LM, job="c",
                      workload=CHAR_STEPS)  # fmt: skip
    assert run.rc == 0 and run.report["recoveries"], explain(run)
    assert run.report["steps_completed"] == 24
    # model, optimizer, scheduler and the per-rank record of the sample ids read, rank by rank
    assert run.report["rank_digests"] == ref.report["rank_digests"], explain(run)
    spare_log = [p["log"] for p in run.report["processes"] if p["name"].startswith("spare")]
    assert spare_log and "using the loader warmed up in standby" in open(spare_log[0]).read()


def test_a_rank_lost_inside_the_first_step_with_local_state_recovers_exactly(tmp_path, references):
    """A rank lost inside step 0 (wedged before its collective: replaced as hung), before any
    boundary, in a job with rank-local state (loader workers, the per-rank record of the sample
    ids read): the spare resumes at step 0 with no step to replay. Its local state of boundary
    -1 is the start, which its own entry built (a spare claimed at step 0 once failed: "no
    local-state snapshot of boundary -1"), and its step 0 draws the same random numbers as the
    worker's although its loader, warmed in standby, drew no seed for a new iterator."""
    ref = reference_of(references, 2, CHAR_LM, CHAR_STEPS)
    run = livemig_run(tmp_path, 2, spares=1, faults=("wedge:rank=1:step=0",), script=CHAR_LM,
                      job="c0", workload=CHAR_STEPS)  # fmt: skip
    assert run.rc == 0 and [r["rank"] for r in run.report["recoveries"]] == [1], explain(run)
    assert run.report["steps_completed"] == 24
    assert run.report["rank_digests"] == ref.report["rank_digests"], explain(run)
    assert [e["resume_step"] for e in run.report["timeline"] if e["phase"] == "agree"] == [0], explain(run)


@pytest.mark.parametrize(
    "nproc,fault,args",
    [
        (2, "kill:rank=1:step=5:during=allreduce", ("--mixed",)),  # the retry path vs the overlapped one
        (2, "kill:rank=0:step=6", ("--amp", "fp16", "--model", "transformer")),  # GradScaler state
    ],
    ids=["fp32+bf16", "gradscaler"],
)
def test_mixed_precision_exact_across_a_kill(tmp_path, reference, nproc, fault, args):  # noqa: F811
    run, ranks = run_script(tmp_path, nproc, spares=1, faults=(fault,), args=args)
    assert_rank_by_rank(run, ranks, reference(nproc, args))
