"""The reference workload in plain DDP, launched by torchrun: the baseline
livemig is compared with (`livemig bench downtime` / `overhead`).

Checkpoint-restart as users practise it today: with --ckpt-every K, rank 0
saves model + optimizer + step every K steps (atomically), and on start
every rank resumes from the latest checkpoint; torchrun --max-restarts
restarts the whole group when a worker dies.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/ddp_baseline.py --steps 40 --ckpt-dir /tmp/ck --ckpt-every 10
"""

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from mlp import build_model  # the same model as the livemig example (this script's folder)
from torch.nn.parallel import DistributedDataParallel as DDP

import livemig
from livemig.data import step_seed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--out-dir", default="", help="progress, commit times and final digest go here")
    p.add_argument("--zero1", action="store_true", help="shard AdamW's state (torch ZeroRedundancyOptimizer)")
    a = p.parse_args()
    torch.set_num_threads(1)
    # A bounded wait: a restarted group that cannot connect fails (and torchrun
    # restarts it again) instead of sitting out gloo's 30-minute default.
    # torchrun's agent store outlives a restart: namespace this attempt's keys so a
    # restarted group never reads the dead group's addresses.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = DDP(build_model(a.width, a.layers))
    if a.zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    ckpt = os.path.join(a.ckpt_dir, "latest.pt") if a.ckpt_dir else ""
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    out = a.out_dir
    prog = open(os.path.join(out, f"progress-{rank}"), "a") if out else None
    for step in range(start, a.steps):
        torch.manual_seed(step_seed(0, step, rank))
        g = livemig.batch_generator(step, rank, world)
        x = torch.randn(a.batch, a.width, generator=g)
        y = torch.randn(a.batch, a.width, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if prog:
            prog.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
            prog.flush()
        if ckpt and (step + 1) % a.ckpt_every == 0 and a.zero1:
            opt.consolidate_state_dict(to=0)  # collective: every rank sends its shard to rank 0
        if ckpt and rank == 0 and (step + 1) % a.ckpt_every == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    if out and a.zero1:
        opt.consolidate_state_dict(to=0)
    if out and rank == 0:
        from livemig.state import digest, flatten

        tensors: list[torch.Tensor] = []
        flatten({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, tensors)
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"digest": digest(tensors), "steps": a.steps}, f)
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
