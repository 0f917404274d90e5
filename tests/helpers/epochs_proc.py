"""The DDP tutorial's epoch loop, ported with `ctx.epochs()` (issue 50): a `DistributedSampler`
built as under torchrun (or `--elastic`: livemig's ElasticSampler), `set_epoch` each epoch, a
loader iterated per epoch, and between epochs an evaluation all-reduced over the default group
and rank 0 saving a snapshot. Every sample a rank's step reads is logged as
`(epoch, rank, step, sample ids)` by the process that reads it (one file per process), so a
test can hold the samples each (epoch, rank) saw to the fault-free run's; each snapshot is
written as `snap<epoch>.json` (the model's digest and the evaluation), and each rank's final
state to `rank<r>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import livemig
from livemig.data import ElasticSampler
from livemig.state import digest

WIDTH = 8


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, WIDTH, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(torch.arange(n), x, y)


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ds = dataset(a.samples)
    if a.elastic:
        sampler = ElasticSampler(len(ds), a.batch, seed=3, shuffle=True)
        loader = DataLoader(ds, batch_sampler=sampler)
    else:
        sampler = DistributedSampler(ds, shuffle=True, seed=3)  # rank and world from the default group
        loader = DataLoader(ds, batch_size=a.batch, sampler=sampler)
    ctx.register(model=model, optimizer=opt)
    log = open(os.path.join(a.out, f"samples-{os.getpid()}.jsonl"), "a") if a.out else None
    for epoch in ctx.epochs(a.epochs, len(loader)):
        sampler.set_epoch(epoch)
        for step, (ids, x, y) in zip(ctx.steps(), ctx.batches(loader), strict=False):
            torch.nn.functional.mse_loss(model(x), y).backward()
            ctx.step()
            if log is not None and not ctx.warming_up:
                log.write(json.dumps([epoch, ctx.rank, step, ids.tolist()]) + "\n")
                log.flush()
            time.sleep(float(os.environ.get("EPOCHS_SLEEP", "0")))  # room for a migration; changes no state
        with torch.no_grad():  # an evaluation between epochs, averaged over the ranks
            ev = torch.tensor([float(sum(p.square().sum() for p in model.parameters()))])
            dist.all_reduce(ev)
        if ctx.rank == 0 and a.out and not ctx.warming_up:  # the tutorial's snapshot, once an epoch
            snap = {"epoch": epoch, "model": digest(list(model.state_dict().values()))[:16], "eval": ev.item()}
            with open(os.path.join(a.out, f"snap{epoch}.json"), "w") as f:
                json.dump(snap, f)
    if a.out:
        rec = {"rank": ctx.rank, "model": digest(list(model.state_dict().values()))[:16]}
        with open(os.path.join(a.out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(rec, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--out", default="")
    train(p.parse_args())
