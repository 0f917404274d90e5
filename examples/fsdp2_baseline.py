"""examples/fsdp2_lm.py's model, mesh and data in plain torch FSDP2, launched by torchrun: the
baseline `livemig bench overhead --sharding fsdp2` and `bench downtime --sharding fsdp2` compare
livemig with.

Checkpoint-restart as FSDP2 users practise it: with --ckpt-every K every rank writes its shards
with torch.distributed.checkpoint (DCP) every K steps, rank 0 then names it the latest, and on
start every rank loads the latest; torchrun --max-restarts restarts the whole group when a
worker dies.

    torchrun --nproc-per-node 4 --max-restarts 3 examples/fsdp2_baseline.py --steps 40 \
        --ckpt-dir /tmp/ck --ckpt-every 10 --out-dir /tmp/out
"""

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp2_lm import corpus, lr_at, sharded  # the livemig example's model and data (this folder)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from livemig.data import ElasticSampler
from livemig.state import digest, flatten, to_local


def _save(root: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    where = os.path.join(root, f"step-{step}")
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=where)
    dist.barrier()  # every rank's shards are written before the checkpoint is named the latest
    if dist.get_rank() == 0:
        tmp = os.path.join(root, "latest.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, "path": where}, f)
        os.replace(tmp, os.path.join(root, "latest.json"))


def _load(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    latest = os.path.join(root, "latest.json")
    if not root or not os.path.exists(latest):
        return 0
    with open(latest) as f:
        info = json.load(f)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=info["path"])
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return int(info["step"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--replicate", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mp", choices=("", "bf16"), default="")
    p.add_argument("--no-reshard", action="store_true")
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--out-dir", default="", help="progress, commit times and final digests go here")
    a = p.parse_args()
    torch.set_num_threads(1)
    # torchrun's agent store outlives a restart: this attempt's keys are its own (examples/ddp_baseline.py)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (a.replicate, world // a.replicate), mesh_dim_names=("replicate", "shard"))
    model = sharded(mesh, a.width, a.layers, a.mp, not a.no_reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0, a.steps), weight_decay=0.1)
    start = _load(a.ckpt_dir, model, opt)
    ds = corpus(8 * a.steps * world)
    sampler = ElasticSampler(len(ds), 8, seed=7)
    sampler.place(start, rank, world)
    batches = iter(DataLoader(ds, batch_sampler=sampler))
    prog = open(os.path.join(a.out_dir, f"progress-{rank}"), "a") if a.out_dir else None
    for step in range(start, a.steps):
        x, y = next(batches)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if prog:
            prog.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
            prog.flush()
        if a.ckpt_dir and a.ckpt_every and (step + 1) % a.ckpt_every == 0:
            _save(a.ckpt_dir, step + 1, model, opt)
    if a.out_dir:  # each rank's local shards; the bench combines them (bench/downtime_bench.py)
        tensors: list[torch.Tensor] = []
        flatten(to_local({"model": model.state_dict(), "optimizer": opt.state_dict()}), tensors)
        with open(os.path.join(a.out_dir, f"final-{rank}.json"), "w") as f:
            json.dump({"digest": digest(tensors), "steps": a.steps}, f)
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
