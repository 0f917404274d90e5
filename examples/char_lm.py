"""A small GPT-style character language model: the example to copy.

What a real script does, through livemig's loop verbs:
- a DataLoader with 2 worker processes over a map-style dataset, its batches from
  `livemig.data.ElasticSampler` through `ctx.batches(loader)` (a spare taking rank r
  at step s reads exactly rank r's batches from there on);
- AdamW with a linear warm-up then cosine decay (the scheduler is a replicated extra);
- bf16 autocast, `ctx.clip_grad_norm_` on the averaged gradient;
- a per-rank record of the samples read, under `local=`;
- rank 0 prints the loss and saves a checkpoint at the end (not while a spare warms up).

livemig run --nproc 2 --spares 1 --fault kill:rank=1:step=20 --verify examples/char_lm.py --steps 40
python examples/char_lm.py --steps 5      # one local process, no livemig
"""

from __future__ import annotations

import argparse
import math
import os

import torch

import livemig
from livemig.data import ElasticSampler

HERE = os.path.dirname(os.path.abspath(__file__))


class CharDataset(torch.utils.data.Dataset):
    """Every window of `block + 1` characters of a text; item i starts at character i."""

    def __init__(self, path: str, block: int) -> None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        self.block = block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        chunk = self.data[i : i + self.block + 1]
        return chunk[:-1], chunk[1:], i


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width), torch.nn.Dropout(dropout))  # fmt: skip
        self.drop, self.heads, self.p = torch.nn.Dropout(dropout), heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             dropout_p=self.p if self.training else 0.0)  # fmt: skip
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln2(x))


class CharGPT(torch.nn.Module):
    def __init__(self, vocab: int, block: int, width: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1) -> None:  # fmt: skip
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(block, width)
        self.blocks = torch.nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.drop, self.ln = torch.nn.Dropout(dropout), torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embeddings
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        torch.nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        return self.head(self.ln(self.blocks(x)))


class SeenSamples:
    """This rank's record of the samples it read: a count and a running hash of the ids."""

    def __init__(self) -> None:
        self.n, self.h = 0, 0

    def add(self, ids: list[int]) -> None:
        for i in ids:
            self.h = (self.h * 1_000_003 + i + 1) % (1 << 61)
        self.n += len(ids)

    def state_dict(self) -> dict:
        return {"n": self.n, "h": self.h}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.h = sd["n"], sd["h"]


def warmup_cosine(warmup: int, total: int):  # noqa: ANN201
    def f(s: int) -> float:
        return (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))

    return f


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int, batch: int, block: int, workers: int, out: str) -> None:
    torch.set_num_threads(1)
    ds = CharDataset(os.path.join(HERE, "data", "tales.txt"), block)
    loader = torch.utils.data.DataLoader(
        ds, batch_sampler=ElasticSampler(len(ds), batch, seed=0), num_workers=workers,
        persistent_workers=workers > 0,
    )  # fmt: skip
    torch.manual_seed(1234)  # the same initial model on every rank
    model = CharGPT(len(ds.chars), block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, steps // 10), steps))
    seen = SeenSamples()
    ctx.register(model=model, optimizer=opt, scheduler=sched, local={"seen": seen})
    batches = ctx.batches(loader)
    for step in ctx.steps(steps):
        x, y, ids = next(batches)
        seen.add(ids.tolist())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        ctx.clip_grad_norm_(1.0)  # the averaged gradient's global norm, the same on every rank
        ctx.step()
        sched.step()
        ctx.log(loss=loss.item())
        if not ctx.warming_up and ctx.rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
    if out and not ctx.warming_up and ctx.rank == 0:
        torch.save({"model": model.state_dict(), "chars": ds.chars}, out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--out", default="", help="rank 0 saves a checkpoint here at the end")
    a = p.parse_args()
    train(a.steps, a.batch, a.block, a.workers, a.out)


if __name__ == "__main__":
    main()
