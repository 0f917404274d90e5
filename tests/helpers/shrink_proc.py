"""A DDP script ported the way users port theirs, for the shrink tests (--min-nproc).

Per-rank seeds (the start-up sync makes replicas equal), a DataLoader over an
ElasticSampler, BatchNorm buffers (rank-local), a per-rank meter under `local=`, a
weight decay set by hand, clipping, a scheduler stepped after ctx.step(). Every
forward appends (step, rank, sample ids, the meter's count) to samples<rank>.jsonl, so
a test can check a carried rank read exactly what it would have; each process writes
its final parameters, buffers and meter at the end (final<rank>.json). --stateless: no
rank-local state (a job that can shrink again after a second loss). --zero1: the
optimizer state sharded (sharding="zero1"), unclipped unless --zero1-clip (then every step
takes the whole average: ZeRO-1's WholeAverage path).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import livemig
from livemig.data import ElasticSampler


class Meter:
    def __init__(self) -> None:
        self.n, self.total = 0, 0.0

    def state_dict(self) -> dict:
        return {"n": self.n, "total": self.total}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.total = sd["n"], sd["total"]


@livemig.elastic(seed=0)
def main(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.manual_seed(1000 + ctx.rank)  # per-rank seeds, as many DDP scripts have
    norm = torch.nn.Identity() if a.stateless else torch.nn.BatchNorm1d(32)  # buffers: rank-local state
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), norm, torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    meter = Meter()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4096, 8, generator=g), torch.randn(8, 1, generator=g)
    ds = torch.utils.data.TensorDataset(x, x @ w + 0.1 * torch.randn(4096, 1, generator=g), torch.arange(4096))
    loader = torch.utils.data.DataLoader(ds, batch_sampler=ElasticSampler(len(ds), a.batch, seed=3))
    ctx.register(model=model, optimizer=opt, sched=sched, local=None if a.stateless else {"meter": meter},
                 sharding="zero1" if a.zero1 else None)  # fmt: skip
    batches = ctx.batches(loader)
    for step in ctx.steps(a.steps):
        for group in opt.param_groups:
            group["weight_decay"] = 1e-4 * (1 + step % 3)  # set by hand every step
        xb, yb, ids = next(batches)
        if a.dump and not ctx.warming_up:  # a spare's warm-up is not the job's
            with open(os.path.join(a.dump, f"samples{ctx.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "rank": ctx.rank, "ids": ids.tolist(), "meter": meter.n}) + "\n")
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        if not a.zero1 or a.zero1_clip:
            ctx.clip_grad_norm_(a.clip)
        ctx.step()
        sched.step()
        if not a.stateless:  # unregistered, it would count every body this process ran
            meter.n += len(ids)
            meter.total += float(loss)
        if a.sleep:
            time.sleep(a.sleep)
    if a.dump:
        sd = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
        out = {"state": sd, "meter": meter.state_dict(), "lr": opt.param_groups[0]["lr"]}
        with open(os.path.join(a.dump, f"final{ctx.rank}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--zero1-clip", action="store_true")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--stateless", action="store_true", help="no rank-local state (no BatchNorm, no local=)")
    p.add_argument("--zero1", action="store_true", help="shard the optimizer state (ZeRO-1)")
    p.add_argument("--dump", default=os.environ.get("SHRINK_DUMP", ""))
    main(p.parse_args())
