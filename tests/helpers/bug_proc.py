"""A training function with a bug: ZeroDivisionError at step 5 on rank 1, or a bad registration."""

import sys

import torch

import livemig


@livemig.elastic()
def train(ctx, steps=12):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if "--bad-register" in sys.argv:
        ctx.register(model=m, optimizer=opt, thing=3)
    ctx.register(model=m, optimizer=opt)
    for step in ctx.steps(steps):
        m(torch.randn(2, 4)).sum().backward()
        if step == 5 and ctx.rank == 1 and not ctx.warming_up:
            print(1 / 0)
        ctx.step()


train()
