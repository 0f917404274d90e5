"""A collective called with a wrong shape inside the step (a caller's bug, not a node failure):
at step 3 rank 1 all-reduces a tensor of another length than rank 0's (`--op`: allreduce,
broadcast or all_gather). The job must end at once with the traceback, no recovery."""

import argparse

import torch
import torch.distributed as dist

import livemig


@livemig.elastic()
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ctx.register(model=m, optimizer=opt)
    for step in ctx.steps(10):
        m(torch.randn(2, 4)).sum().backward()
        if step == 3 and not ctx.warming_up:
            t = torch.ones(4 if ctx.rank == 0 else 6)
            if a.op == "allreduce":
                dist.all_reduce(t)
            elif a.op == "broadcast":
                dist.broadcast(t, src=0)
            else:
                dist.all_gather([torch.empty(4) for _ in range(ctx.world_size)], t)
        ctx.step()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="allreduce")
    train(p.parse_args())
