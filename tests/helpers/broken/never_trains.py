"""A script whose training function never reaches ctx.steps()."""

import torch

import livemig


@livemig.elastic()
def train(ctx: livemig.Context) -> None:
    m = torch.nn.Linear(2, 1)
    ctx.register(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


train()
