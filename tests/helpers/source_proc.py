"""A state-transfer source in its own process, serving a deterministic state."""

from __future__ import annotations

import argparse
import os
import time

import torch

from livemig.transfer.server import StateServer


def make_state(mb: float = 20.0, seed: int = 0) -> dict:
    """Mixed dtypes, odd sizes, an empty and a 0-d tensor, like a real model plus extras."""
    g = torch.Generator().manual_seed(seed)
    n = int(mb * 2**20 / 4)
    return {
        "big": torch.randn(n // 2 + 13, generator=g),
        "bf16": torch.randn(n // 4 + 7, generator=g).to(torch.bfloat16),
        "mat": torch.randn(333, 517, generator=g),
        "ids": torch.randint(0, 2**40, (n // 16 + 3,), generator=g, dtype=torch.int64),
        "mask": torch.rand(1001, generator=g) > 0.5,
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.25),
        "meta": {"lr": 0.001, "betas": [0.9, 0.999], "name": "adamw"},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=20.0)
    p.add_argument("--gen", type=int, default=1)
    p.add_argument("--secret", default="s3cret")
    p.add_argument("--die-after", type=int)
    a = p.parse_args()
    state = make_state(a.mb)
    srv = StateServer("job", a.secret.encode())
    if a.die_after is not None:  # a source dying mid-transfer, after serving --die-after chunks

        def die(served: int, limit: int = a.die_after) -> None:
            if served > limit:
                os._exit(9)

        srv.hooks.after_chunk = die
    srv.publish(a.gen, "state", lambda: (7, state))
    print(srv.addr, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
