"""A script whose training function never reaches ctx.steps().

With NEVER_TRAINS_MARK set, each rank appends the wall time at which its function returned
(the moment the misuse happens) to that file: the test measures the run's end from there,
not from a start that includes importing torch on a busy machine."""

import os
import time

import torch

import livemig


@livemig.elastic()
def train(ctx: livemig.Context) -> None:
    m = torch.nn.Linear(2, 1)
    ctx.register(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    mark = os.environ.get("NEVER_TRAINS_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write(f"{time.time()}\n")


train()
