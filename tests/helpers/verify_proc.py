"""A small loop with the three mistakes `livemig run --verify` must explain (issue 50):

--unseeded     the model is initialised from the clock: the reference differs from step 0;
--cached-rng   a per-rank generator built before the loop draws the data and is not registered:
               a spare taking the rank starts it afresh, so the run parts after the recovery;
--own FILE     the model loads FILE at start when it exists and saves it at the end (a script
               resuming from its own snapshot): the faulted run starts from the reference's file.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import livemig


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(time.time_ns() % 2**31 if a.unseeded else 11)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if a.own and os.path.exists(a.own):
        model.load_state_dict(torch.load(a.own, weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + ctx.rank)  # --cached-rng: drawn from, never registered
    ctx.register(model=model, optimizer=opt)
    for step in ctx.steps(a.steps):
        g = data if a.cached_rng else livemig.batch_generator(step, ctx.rank, ctx.world_size)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ctx.step()
        time.sleep(0.02)
    if a.own and ctx.rank == 0 and not ctx.warming_up:
        torch.save(model.state_dict(), a.own)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--unseeded", action="store_true")
    p.add_argument("--cached-rng", action="store_true")
    p.add_argument("--own", default="")
    train(p.parse_args())
