"""A kind of parallelism of the user's own, defined here and nowhere in livemig/: plain data
parallel whose gradient average is summed in float64 (`Float64Mean`). Registered through the
public path (`ctx.register(..., strategy=Float64Mean)`), a kill and a planned migration of a
job using it end bit-identical rank by rank to its fault-free run: the strategy protocol
(livemig/runtime/strategies/base.py) is all a new kind needs.

This file is also the training script the test runs (`python tests/e2e/test_strategies.py`),
written as a DDP port is: a per-rank seed before the model (the start-up sync makes the
replicas equal), clipping, a learning rate set by hand, a batch prefetched for the next step,
rank 0 saving.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import livemig
from livemig.comm.group import allreduce_sum


class Float64Mean(livemig.Replicated):
    """Plain data parallel, the average summed in float64 and rounded once: no overlap with
    backward (the buckets are reduced at the step), the rest of the protocol inherited."""

    name = "float64-mean"
    reductions = 0  # this process's float64 reductions: the script reports them

    def begin_step(self) -> None:
        if self.h.reducer is not None:
            self.h.reducer.disarm()

    def reduce(self, ctl: torch.Tensor, first: bool) -> list[torch.Tensor]:
        h = self.h
        h.virtual.add_stashed()
        flats = h.reducer.flatten()
        wide = [f.double() for f in flats]
        allreduce_sum(h.runtime.pg, [*wide, ctl], h.timeouts.collective, h.runtime.moved_on)
        for f, w in zip(flats, wide, strict=True):
            f.copy_(w / h.virtual.divisor())
        ctl.div_(h.virtual.divisor())
        type(self).reductions += 1
        return flats


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int, out: str, step_ms: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(100 + ctx.rank)  # per-rank seed, as DDP scripts do
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx.register(model=model, optimizer=opt, strategy=Float64Mean)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)

    nxt = None
    for step in ctx.steps(steps):
        x, y = batch(step) if nxt is None or nxt[0] != step else nxt[1]
        nxt = (step + 1, batch(step + 1))  # prefetched for the next step
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (1 - step / (2 * steps))  # by hand
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ctx.clip_grad_norm_(1.0)
        ctx.step()
        if step_ms:
            time.sleep(step_ms / 1000)
    if out and not ctx.warming_up:
        if ctx.rank == 0:
            torch.save(model.state_dict(), os.path.join(out, "model.pt"))  # rank 0 saving
        with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump({"model": {k: v.tolist() for k, v in model.state_dict().items()},
                       "reductions": Float64Mean.reductions}, f)  # fmt: skip


def test_a_strategy_defined_outside_livemig_recovers_a_kill_and_a_migration_exactly(tmp_path, references):
    from tests.e2e.conftest import explain, livemig_run, rank_files, reference_of

    work = ["--steps", "40", "--step-ms", "60"]
    ref = reference_of(references, 3, __file__, [*work, "--out", "{out}"])
    out = tmp_path / "out"
    out.mkdir()
    run = livemig_run(tmp_path, 3, spares=2, faults=("kill:rank=1:step=6", "migrate:rank=2:step=14"),
                      script=__file__, workload=[*work, "--out", str(out)])  # fmt: skip
    assert run.rc == 0 and run.report["steps_completed"] == 40, explain(run)
    assert len(run.report["recoveries"]) == 1, explain(run)
    assert [m["outcome"] for m in run.report.get("migrations") or []] == ["done"], explain(run)
    ranks, want = rank_files(out), rank_files(ref.out)
    assert sorted(ranks) == [0, 1, 2] and all(r["reductions"] > 0 for r in ranks.values()), ranks.keys()
    for r in want:
        assert ranks[r]["model"] == want[r]["model"], f"rank {r}'s model differs from the fault-free run's"
    assert run.report["rank_digests"] == ref.report["rank_digests"], explain(run)
    assert run.report["replicas_identical"], explain(run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="")
    p.add_argument("--step-ms", type=int, default=0)
    a = p.parse_args()
    train(a.steps, a.out, a.step_ms)


if __name__ == "__main__":
    main()
