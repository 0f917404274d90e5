"""A tiny loop for the loop-API tests: ctx.clip_grad_norm_ on the averaged gradient,
norms written per rank; or the gradient-accumulation misuse."""

from __future__ import annotations

import argparse
import json
import os

import torch

import livemig

WIDTH, BATCH = 16, 8


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = livemig.batch_generator(step, rank, world)
    return torch.randn(BATCH, WIDTH, generator=g) * 5, torch.randn(BATCH, 1, generator=g)


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int, out: str, misuse: bool, sharding: str | None) -> None:
    torch.set_num_threads(1)
    model, opt = model_and_opt()
    norms = []
    ctx.register(model=model, optimizer=opt, sharding=sharding)
    for step in ctx.steps(steps):
        x, y = batch(step, ctx.rank, ctx.world_size)
        if misuse:  # two micro-batches, the first one outside ctx.no_sync()
            torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
            torch.nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(ctx.clip_grad_norm_(1.0)))
        ctx.step()
    if out and not ctx.warming_up:
        state = {k: v.tolist() for k, v in model.state_dict().items()}
        with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump({"norms": norms, "state": state}, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="")
    p.add_argument("--misuse", action="store_true")
    p.add_argument("--sharding", default=None)
    a = p.parse_args()
    train(a.steps, a.out, a.misuse, a.sharding)
