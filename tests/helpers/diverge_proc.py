"""A loop that breaks the replicas after the start-up sync: rank 1 changes a parameter
inside step 0, before ctx.step(). The step-0 replica check must fail the job."""

from __future__ import annotations

import argparse

import torch

import livemig


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int) -> None:
    torch.manual_seed(7 + ctx.rank)  # per rank: the start-up sync makes them rank 0's
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.register(model=model, optimizer=opt)
    for step in ctx.steps(steps):
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 1, generator=g)).backward()
        if step == 0 and ctx.rank == 1 and not ctx.warming_up:
            with torch.no_grad():
                model.bias.add_(1.0)  # a per-rank change the average cannot undo
        ctx.step()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    train(p.parse_args().steps)
