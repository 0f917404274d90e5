"""A training script with the state real scripts carry, rank by rank.

- a model with per-rank buffers (BatchNorm CNN) or a small transformer of our own
  (token + position embeddings, LayerNorm, dropout, tied input/output embeddings);
- a learning-rate schedule (linear warm-up, then cosine) and a weight-decay schedule,
  both stepped after ctx.step() and registered as replicated extras;
- a per-rank data sampler and a per-rank metric accumulator, registered under
  `local=`: each rank has its own, and a spare taking rank r continues rank r's.

livemig run --nproc 2 --spares 1 --fault kill:rank=1:step=9 --verify examples/stateful.py --steps 24
livemig run --nproc 3 --spares 1 --fault kill:rank=2:step=5 --verify examples/stateful.py \
    --model transformer --sharding zero1
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import livemig

VOCAB, SEQ = 64, 16


class RankSampler:
    """This rank's own shuffled order of the data set; remembers every id it served."""

    def __init__(self, n: int, rank: int, batch: int) -> None:
        self.n, self.rank, self.batch = n, rank, batch
        self.pos, self.epoch, self.seen = 0, 0, []

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.epoch + self.rank)
        return torch.randperm(self.n, generator=g)

    def next_ids(self) -> list[int]:
        order = self._order()
        if self.pos + self.batch > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            order = self._order()
        ids = order[self.pos : self.pos + self.batch].tolist()
        self.pos += self.batch
        self.seen.extend(ids)
        return ids

    def state_dict(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch, "seen": list(self.seen)}

    def load_state_dict(self, sd: dict) -> None:
        self.pos, self.epoch, self.seen = sd["pos"], sd["epoch"], list(sd["seen"])


class Meter:
    """A per-rank metric accumulator, updated after ctx.step()."""

    def __init__(self) -> None:
        self.steps, self.loss_sum = 0, 0.0

    def state_dict(self) -> dict:
        return {"steps": self.steps, "loss_sum": self.loss_sum}

    def load_state_dict(self, sd: dict) -> None:
        self.steps, self.loss_sum = sd["steps"], sd["loss_sum"]


class WeightDecaySchedule:
    """Sets each param group's weight decay every step (the optimizer's other hyperparameter)."""

    def __init__(self, opt: torch.optim.Optimizer, base: float) -> None:
        self.opt, self.base, self.last = opt, base, 0
        self._apply()

    def _apply(self) -> None:
        for g in self.opt.param_groups:
            g["weight_decay"] = self.base * (1.0 + 0.5 * math.sin(self.last))

    def step(self) -> None:
        self.last += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last": self.last}

    def load_state_dict(self, sd: dict) -> None:
        self.last = sd["last"]


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )  # fmt: skip


class TinyGPT(torch.nn.Module):
    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Embedding(SEQ, width)
        self.ln1, self.ln2, self.ln_f = (torch.nn.LayerNorm(width) for _ in range(3))
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))  # fmt: skip
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.heads = heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))
        x = x + self.drop(self.mlp(self.ln2(x)))
        return self.head(self.ln_f(x))


def warmup_cosine(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return f


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, steps: int, model_kind: str, sharding: str | None, batch: int,
          mixed: bool = False, amp: str = "") -> None:  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # the same initial model on every rank
    model = cnn() if model_kind == "cnn" else TinyGPT()
    if mixed:  # fp32 and bf16 parameters in one model: one bucket per dtype
        model[-1].to(torch.bfloat16) if model_kind == "cnn" else model.mlp.to(torch.bfloat16)
    torch.manual_seed(99)
    n = 512
    data = torch.randn(n, 3, 8, 8) if model_kind == "cnn" else torch.randint(0, VOCAB, (n, SEQ + 1))
    labels = torch.randint(0, 10, (n,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, steps))
    wd = WeightDecaySchedule(opt, 0.01)
    sampler, meter = RankSampler(n, ctx.rank, batch), Meter()
    pause = float(os.environ.get("STATEFUL_STEP_SLEEP", "0"))
    hold = os.environ.get("STATEFUL_HOLD")  # tests: from step 12 on, wait while this file exists
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) if amp == "fp16" else None
    extras = {"scaler": scaler} if scaler is not None else {}
    locals_ = {"sampler": sampler, "meter": meter}
    if os.environ.get("STATEFUL_METER_AS_EXTRA"):  # tests: per-rank state registered as replicated
        extras["meter"] = locals_.pop("meter")
    ctx.register(model=model, optimizer=opt, sharding=sharding, scheduler=sched, wd=wd,
                 local=locals_, **extras)  # fmt: skip
    for _step in ctx.steps(steps):
        if hold and _step >= 12 and not ctx.warming_up:  # e.g. until a loaded machine's spares are warm
            until = time.monotonic() + 300
            while os.path.exists(hold) and time.monotonic() < until:
                time.sleep(0.05)
        ids = torch.tensor(sampler.next_ids())
        with torch.autocast(
            "cpu", dtype=torch.float16 if amp == "fp16" else torch.bfloat16, enabled=bool(amp or mixed)
        ):
            if model_kind == "cnn":
                loss = torch.nn.functional.cross_entropy(model(data[ids]).float(), labels[ids])
            else:
                seq = data[ids]
                logits = model(seq[:, :-1]).float()
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        ctx.log(loss=loss.item())
        ctx.step(scaler=scaler)
        sched.step()  # user code after the commit point: exactly once per step on every rank
        wd.step()
        meter.steps += 1
        meter.loss_sum += loss.item()
        time.sleep(pause)  # tests: steps long enough for an agent's kill to land mid-run
    if os.environ.get("STATEFUL_PLANT") and ctx.role == "spare":  # tests: a recovered rank that differs
        meter.steps += 1000
    out = os.environ.get("STATEFUL_DUMP")  # tests: each rank's final state, for a readable diff
    if out and not ctx.warming_up:
        import hashlib
        import json

        def h(sd: dict) -> str:
            raw = (v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for v in sd.values())
            return hashlib.sha256(b"".join(raw)).hexdigest()

        params = {k: v for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
        buffers = {k: v for k, v in model.state_dict().items() if k not in params}
        rec = {"sampler": sampler.state_dict(), "meter": meter.state_dict(), "scheduler": sched.state_dict(),
               "scaler": scaler.state_dict() if scaler is not None else None,
               "wd": wd.state_dict(), "lr": [g["lr"] for g in opt.param_groups],
               "weight_decay": [g["weight_decay"] for g in opt.param_groups],
               "params": h(params), "buffers": h(buffers)}  # fmt: skip
        rec["scheduler"].pop("lr_lambdas", None)
        with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(rec, f, sort_keys=True, default=str)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--model", choices=["cnn", "transformer"], default="cnn")
    p.add_argument("--sharding", choices=["zero1"], default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mixed", action="store_true", help="some parameters in bf16 (autocast on)")
    p.add_argument("--amp", choices=["", "fp16"], default="", help="fp16 autocast with a GradScaler")
    a = p.parse_args()
    train(a.steps, a.model, a.sharding, a.batch, a.mixed, a.amp)


if __name__ == "__main__":
    main()
