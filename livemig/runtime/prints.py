"""Per-step fingerprints of a rank's state, for `livemig run --verify` to say where two runs parted.

A final digest says whether a faulted run ends where the fault-free one does, not where it
left it. With LIVEMIG_STEP_PRINTS=1 (set by --verify for both runs) each rank records at every
step boundary a 4-byte fingerprint of its parameters and buffers (a strided sample of at most
`SAMPLE` elements per tensor: a diverged gradient changes every parameter an optimizer step
touches, so a sample sees it, at a cost of microseconds). The records ride in the final record;
agent/report.py `divergence` finds the first step and rank where the runs differ. Bounded: past
`KEPT` boundaries only every 2nd (then 4th, ...) step is kept.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from livemig.config import ENV_STEP_PRINTS
from livemig.state import is_dtensor

SAMPLE = 64  # elements per tensor
KEPT = 2048  # fingerprints a rank keeps (then the stride doubles)


def fingerprint(tensors: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=4)
    for t in tensors:
        x = t.detach()
        if is_dtensor(x):
            x = x.to_local()  # type: ignore[attr-defined]
        flat = x.reshape(-1)
        n = flat.numel()
        if n == 0:
            continue
        step = max(1, n // SAMPLE)
        sample = flat[::step][:SAMPLE].to("cpu").contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepPrints:
    """One rank's fingerprints, [step, hex], kept across the function's entries."""

    def __init__(self, host: Any) -> None:
        self.h = host
        self.on = os.environ.get(ENV_STEP_PRINTS, "") == "1"
        self.stride = 1
        self.items: list[list[Any]] = []

    def at_boundary(self, step: int) -> None:
        """A boundary listener (runtime/boundary.py): every user line of `step` ran."""
        h = self.h
        if not self.on or step % self.stride or h.warming_up or h.model is None:
            return
        tensors = [p for p in h.model.parameters()] + [b for b in h.model.buffers()]
        self.items.append([int(step), fingerprint(tensors)])
        if len(self.items) > KEPT:
            self.stride *= 2
            self.items = [x for x in self.items if x[0] % self.stride == 0]
