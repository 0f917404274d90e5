"""A model wrapped in `torch.compile` before the loop (issue 50): a spare compiles it in its
warm-up, and again when it is claimed and enters the function a second time in the same
process; a cold restart's survivors do the same. `--register-compiled` registers the compiled
module itself (its state_dict keys carry `_orig_mod.`), else the module it wraps."""

import argparse

import torch

import livemig


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = torch.compile(net, backend="aot_eager")  # no C++ toolchain needed; the same graph capture
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ctx.register(model=model if a.register_compiled else net, optimizer=opt)
    for step in ctx.steps(a.steps):
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ctx.step()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--register-compiled", action="store_true")
    train(p.parse_args())
