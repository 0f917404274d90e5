"""The reference workload with ZeRO-1: AdamW's state sharded over the ranks.

Each rank keeps 1/N of the optimizer state (and a live mirror of its left
neighbour's 1/N, so a killed rank's shard is recovered exactly):

livemig run --nproc 2 --spares 1 --fault kill:rank=1:step=20 --verify examples/mlp_zero1.py --steps 40
python examples/mlp_zero1.py --steps 5        # plain single process, no livemig
"""

import argparse

import torch
from mlp import build_model  # the same model as examples/mlp.py (this script's folder)

import livemig


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int, width: int, layers: int, batch: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # the same initial model on every rank
    model = build_model(width, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.register(model=model, optimizer=opt, sharding="zero1")
    for step in ctx.steps(steps):
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        x = torch.randn(batch, width, generator=g)
        y = torch.randn(batch, width, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ctx.log(loss=loss.item())
        ctx.step()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    train(a.steps, a.width, a.layers, a.batch)
