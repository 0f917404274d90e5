"""The reference workload: 8 x Linear(1024, 1024) with ReLU, AdamW, MSE.

livemig run --nproc 2 --spares 1 examples/mlp.py --steps 40
python examples/mlp.py --steps 5        # plain single process, no livemig
livemig run ... examples/mlp.py --device cuda   # on a GPU (the batches are drawn on the CPU, then moved)
"""

import argparse

import torch

import livemig


def build_model(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int, width: int, layers: int, batch: int, sharding: str | None = None,
          device: str = "cpu") -> None:  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # the same initial model on every rank
    model = build_model(width, layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.register(model=model, optimizer=opt, sharding=sharding)
    for step in ctx.steps(steps):
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        x = torch.randn(batch, width, generator=g).to(device)
        y = torch.randn(batch, width, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ctx.log(loss=loss.item())
        ctx.step()


def main(sharding: str | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    a = p.parse_args()
    train(a.steps, a.width, a.layers, a.batch, sharding, a.device)


if __name__ == "__main__":
    main()
