"""Rank 0 pauses inside ctx.busy() for longer than the hang timeout (a checkpoint)."""

from __future__ import annotations

import time

import torch

import livemig


@livemig.elastic()
def train(ctx: livemig.Context, steps: int = 12) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ctx.register(model=m, optimizer=opt)
    for step in ctx.steps(steps):
        m(torch.randn(4, 8)).sum().backward()
        ctx.step()
        if step == 5 and ctx.rank == 0 and not ctx.warming_up:
            with ctx.busy():  # rank 1 waits for us in step 6's collective meanwhile
                time.sleep(4.0)


if __name__ == "__main__":
    train()
