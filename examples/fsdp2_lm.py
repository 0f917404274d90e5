"""A small GPT-style language model under HSDP (FSDP2 on a (replicate, shard) mesh), on livemig.

Written as an FSDP2 script is: a DeviceMesh, `fully_shard` per block and on the root, AdamW over
`model.parameters()`, a DataLoader, a warm-up + cosine learning rate, gradient clipping. What
livemig changes: the mesh comes from `ctx.init_device_mesh` (the same signature as torch's),
the model is registered, the loop runs over `ctx.steps()` and ends each step with `ctx.step()`.

livemig run --nproc 4 --spares 1 --fault kill:rank=3:step=12 --verify examples/fsdp2_lm.py
livemig run --nproc 4 --spares 1 --fault kill:rank=1:step=8:during=fsdp_reduce_scatter --verify \
    examples/fsdp2_lm.py --steps 16

Under HSDP each shard is held by every replica, so a lost rank's shard streams from its
replica peer and training goes on without a checkpoint (docs/architecture.md, "FSDP2 and HSDP").
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import livemig
from livemig.data import ElasticSampler

VOCAB, CTX, HEADS = 64, 32, 4


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, HEADS, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Parameter(torch.zeros(CTX, width))
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def corpus(n: int) -> TensorDataset:
    """A deterministic synthetic corpus: sequences a small model can learn (a noisy counter)."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    seq = (start + torch.arange(CTX + 1)) % VOCAB
    noise = torch.rand(n, CTX + 1, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, (n, CTX + 1), generator=g), seq)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def sharded(mesh: object, width: int, layers: int, mp: str = "", reshard: bool = True) -> TinyGPT:
    """The model as FSDP2 scripts wrap it: each block, then the root. mp="bf16": parameters
    gathered and computed in bf16, gradients reduced in fp32 (MixedPrecisionPolicy)."""
    kw: dict = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)  # every rank builds the same model; fully_shard keeps its slice
    model = TinyGPT(width, layers)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def lr_at(step: int, total: int, base: float = 3e-3, warmup: int = 5) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@livemig.elastic()
def train(ctx: livemig.Context, steps: int, replicate: int, width: int = 64, layers: int = 2, mp: str = "",
          reshard: bool = True, device: str = "cpu") -> None:  # fmt: skip
    shard = max(1, ctx.world_size // replicate)
    mesh = ctx.init_device_mesh(device, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    model = sharded(mesh, width, layers, mp, reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0, steps), weight_decay=0.1)
    ctx.register(model=model, optimizer=opt)
    # each rank reads its own batches of the step (placed by ctx.batches at the step the loop runs)
    ds = corpus(8 * steps * max(ctx.world_size, 1))
    batches = ctx.batches(DataLoader(ds, batch_sampler=ElasticSampler(len(ds), 8, seed=7)))
    for step in ctx.steps(steps):
        x, y = (t.to(device) for t in next(batches))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        ctx.clip_grad_norm_(1.0)
        ctx.step()
        ctx.log(loss=loss.item())
        if ctx.rank == 0 and not ctx.warming_up and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--replicate", type=int, default=2, help="the mesh's replicate size (1: plain FSDP)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mp", choices=("", "bf16"), default="", help="bf16: MixedPrecisionPolicy(bf16, fp32 reduce)")
    p.add_argument("--no-reshard", action="store_true", help="fully_shard(reshard_after_forward=False)")
    p.add_argument("--device", default="cpu", help="the mesh's device type: cpu (default) or cuda")
    a = p.parse_args()
    torch.set_num_threads(1)
    train(a.steps, a.replicate, a.width, a.layers, a.mp, not a.no_reshard, a.device)


if __name__ == "__main__":
    main()
