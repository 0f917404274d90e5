"""A DDP training loop ported to livemig, written the way DDP scripts are written.

What it keeps from its DDP original (README, "Porting a DDP script"):
- a per-rank seed before the model is built (DDP makes the replicas rank 0's when
  it wraps the model; livemig does the same when the job forms);
- gradient accumulation over micro-batches, all but the last under `no_sync()`;
- gradient clipping by the global norm (with a GradScaler: unscale first);
- the learning rate set by hand in `param_groups` every iteration (or, with
  --scheduler, from a torch scheduler stepped after ctx.step());
- the next step's batch fetched at the end of this one: a variable carried from one
  iteration to the next is rank-local state, registered under `local=`;
- rank 0 writing a checkpoint every few steps.

livemig run --nproc 2 --spares 1 --fault kill:rank=1:step=10 --verify examples/ddp_port.py --steps 30
livemig run --nproc 2 --spares 1 --fault migrate:rank=0:step=8 --verify examples/ddp_port.py --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import time
from typing import Any

import torch

import livemig

WIDTH, MICRO = 32, 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.BatchNorm1d(WIDTH)  # running statistics: per-rank buffers
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


class Carry:
    """Values one iteration leaves for the next (here the prefetched batch). Without
    `local=` a spare taking this rank would start from another batch."""

    def __init__(self) -> None:
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.batch = sd["batch"]


def lr_at(step: int, total: int, base: float, warmup: int = 4) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def typed(obj: Any) -> Any:
    """A JSON form that keeps types (tuple vs list, int vs float) and hashes tensors:
    two dumps are equal only if the states are equal value by value and type by type."""
    if isinstance(obj, torch.Tensor):
        raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ["tensor", str(obj.dtype), list(obj.shape), hashlib.sha256(raw).hexdigest()[:16]]
    if isinstance(obj, dict):
        return ["dict", [[typed(k), typed(v)] for k, v in obj.items()]]
    if isinstance(obj, list | tuple):
        return [type(obj).__name__, [typed(v) for v in obj]]
    return [type(obj).__name__, repr(obj)]


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1337 + ctx.rank)  # as DDP scripts do: the replicas are made rank 0's at start
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1) if a.amp else None
    carry, norms = Carry(), []
    extras: dict[str, Any] = {"scaler": scaler} if scaler is not None else {}
    if a.scheduler:  # a torch scheduler stepped after ctx.step(), instead of the lr set by hand
        extras["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, a.steps, 1.0))
    # --sharding zero1: the port of a script that wraps its optimizer in ZeroRedundancyOptimizer
    ctx.register(model=model, optimizer=opt, local={"carry": carry}, sharding=a.sharding, **extras)
    if a.ckpt_dir:  # livemig's background checkpoints, set from the script (--checkpoint-dir wins)
        ctx.checkpoints(a.ckpt_dir, every=a.ckpt_every or None, interval=a.ckpt_interval or None)

    def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        return torch.randn(a.accum, MICRO, WIDTH, generator=g) * 3, torch.randn(a.accum, MICRO, 1, generator=g)

    for step in ctx.steps(a.steps):
        t0 = time.monotonic()
        if carry.batch is None:
            carry.batch = get_batch(step)
        x, y = carry.batch
        if not a.scheduler:
            for group in opt.param_groups:  # the learning rate set by hand, every iteration
                group["lr"] = lr_at(step, a.steps, a.lr)
        for k in range(a.accum):
            with ctx.no_sync() if k < a.accum - 1 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(x[k]), y[k]) / a.accum
                if a.inf_every and step % a.inf_every == a.inf_every - 1 and ctx.rank == 0 and not ctx.warming_up:
                    loss = loss * float("inf")  # an overflow: the GradScaler skips this step everywhere
                (scaler.scale(loss) if scaler is not None else loss).backward()
        carry.batch = get_batch(step + 1)  # prefetched for the next iteration
        if scaler is not None:
            ctx.sync_gradients()  # the average, then unscale and clip it
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        else:
            norm = ctx.clip_grad_norm_(a.clip)
        norms.append([step, repr(float(norm))])
        ctx.step(scaler=scaler)
        if a.scheduler:
            extras["scheduler"].step()
        ctx.log(loss=float(loss) * a.accum)
        if a.save_every and step % a.save_every == 0 and ctx.rank == 0 and not ctx.warming_up and a.out:
            with ctx.busy():
                torch.save(model.state_dict(), os.path.join(a.out, "checkpoint.pt"))
        if a.step_ms:  # tests: a step of at least this long
            time.sleep(max(0.0, a.step_ms / 1000 - (time.monotonic() - t0)))
    if a.out and not ctx.warming_up:
        rec = {"model": typed(model.state_dict()), "optimizer": typed(opt.state_dict()),
               "scaler": typed(scaler.state_dict()) if scaler is not None else None,
               "scheduler": typed(extras["scheduler"].state_dict()) if a.scheduler else None,
               "carry": typed(carry.state_dict()), "norms": norms}  # fmt: skip
        with open(os.path.join(a.out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(rec, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--clip", type=float, default=0.5, help="max gradient norm")
    p.add_argument("--scheduler", action="store_true", help="a torch LR scheduler instead of the lr set by hand")
    p.add_argument("--amp", action="store_true", help="a GradScaler (loss scaling), unscale before the clip")
    p.add_argument("--inf-every", type=int, default=0, help="rank 0's loss overflows every N steps (with --amp)")
    p.add_argument("--save-every", type=int, default=0, help="rank 0 writes a checkpoint every N steps")
    p.add_argument("--ckpt-dir", default="", help="ctx.checkpoints(DIR, ...): background checkpoints")
    p.add_argument("--ckpt-every", type=int, default=0, help="... every N steps")
    p.add_argument("--ckpt-interval", type=float, default=0.0, help="... or every SECONDS")
    p.add_argument("--step-ms", type=float, default=0.0, help="pad each step to this many ms")
    p.add_argument("--sharding", default=None, choices=["zero1"], help="shard the optimizer state (ZeRO-1)")
    p.add_argument("--out", default=os.environ.get("DDP_PORT_OUT", ""), help="dump each rank's final state here")
    train(p.parse_args())


if __name__ == "__main__":
    main()
