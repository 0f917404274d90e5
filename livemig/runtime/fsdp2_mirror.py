"""A live mirror of the left neighbour's FSDP2 shard: what recovers a rank of plain FSDP.

Plain FSDP (a 1-D mesh) keeps one copy of each shard, so a lost rank's parameters and
optimizer state exist nowhere else. Each rank therefore keeps a copy of its left neighbour's
shard (rank - stride, as the local-state and ZeRO-1 mirrors) and steps it with the same
optimizer class and hyperparameters, from the neighbour's reduced, clipped gradient shard
received in every step before the commit vote: after the vote the owner and its mirror apply
the same update to the same values, so the mirror is bit-identical to the shard (the report
checks it). On CPU both take torch's single-tensor optimizer path (a DTensor's local ops are
the plain tensor's), so the bits agree.

Cost: the shard's parameters, gradients and optimizer state once more on each rank, one ring
exchange of the gradient shard and a second optimizer step per step (`livemig bench overhead
--sharding fsdp2` measures it); `ctx.register(mirror=False)` (or LIVEMIG_FSDP2_MIRROR=0)
turns it off, and a lost rank of plain FSDP then fails the job with one line (or goes to the
checkpoint path).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from livemig.state import digest

log = logging.getLogger("livemig.runtime.fsdp2_mesh")


def grads_blob(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The local gradient shards, as one uint8 tensor (any dtypes), zeros where none."""
    parts = []
    for p in params:
        g = p.grad
        loc = g.to_local() if g is not None and hasattr(g, "to_local") else g
        if loc is None:
            loc = torch.zeros_like(p.to_local() if hasattr(p, "to_local") else p)
        parts.append(loc.detach().contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class ShardMirror:
    """Parameters and optimizer of the left neighbour's shard, as plain local tensors."""

    def __init__(self, of: int, state: dict[str, Any], template: torch.optim.Optimizer) -> None:
        self.of = of
        self.params = [torch.nn.Parameter(t.detach().clone()) for t in state["params"]]
        groups, i = [], 0
        for g in template.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": self.params[i : i + n]})
            i += n
        cls: Any = type(template)  # the template's class, whatever its constructor takes
        try:
            self.opt = cls(groups, **template.defaults)
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            self.opt = cls(groups)
        if state.get("optimizer"):
            self.opt.load_state_dict(state["optimizer"])
        self.grads: tuple[int, torch.Tensor] | None = None  # (step, the neighbour's gradient blob) held

    def hold(self, step: int, blob: torch.Tensor) -> None:
        self.grads = (step, blob)

    def step(self, step: int, hparams: list[dict]) -> None:
        """The neighbour's update of `step`, from its gradient held since the exchange."""
        if self.grads is None or self.grads[0] != step:
            raise RuntimeError(f"the mirror of rank {self.of} holds no gradient of step {step}")
        blob, off = self.grads[1], 0
        for p in self.params:
            n = p.numel() * p.element_size()
            p.grad = blob[off : off + n].view(p.dtype).reshape(p.shape).clone()
            off += n
        for grp, hp in zip(self.opt.param_groups, hparams, strict=True):
            grp.update(hp)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"params": [p.detach() for p in self.params], "optimizer": self.opt.state_dict()}

    def nbytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.params)
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return n

    def digest(self) -> str:
        return shard_digest(self.params, self.opt)


def shard_digest(params: Sequence[torch.Tensor], opt: torch.optim.Optimizer | None) -> str:
    """One digest over a shard's parameters and optimizer state (an owner's DTensors by their
    local shards, a mirror's plain tensors): equal when the mirror is exact."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    if opt is not None:
        for p in [q for g in opt.param_groups for q in g["params"]]:
            for k in sorted(opt.state.get(p, {})):
                v = opt.state[p][k]
                if isinstance(v, torch.Tensor):
                    tensors.append(v.to_local() if hasattr(v, "to_local") else v)
    return digest([t.detach() for t in tensors])
