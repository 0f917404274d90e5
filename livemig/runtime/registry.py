"""What the user registered, as an object of its own: the bottom of runtime/.

The model, the optimizer (a template under ZeRO-1), and the extras
(anything with state_dict/load_state_dict). It knows the registered state's
signature (what a spare must match), its streamable form and its digest;
the step protocol, the recovery and the migration all read it from here.
"""

from __future__ import annotations

from typing import Any

import torch

from livemig.config import SHARDING_ENTRY
from livemig.state import digest, flatten, signature


class Registry:
    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.extra: dict[str, Any] = {}
        self.params: list[torch.nn.Parameter] = []
        self.zero: Any = None  # comm.zero1.Zero1 when registered with sharding="zero1"

    def set(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
            extra: dict[str, Any]) -> None:  # fmt: skip
        self.model, self.optimizer, self.extra = model, optimizer, extra
        self.params = [p for p in model.parameters() if p.requires_grad] if model is not None else []

    def signature(self) -> list:
        sig = signature(self.model.state_dict()) if self.model is not None else []
        if self.zero is not None:  # a spare must shard the same way as the job
            sig.append([SHARDING_ENTRY, "zero1", [int(self.zero.mirror is not None)]])
        return sig

    def state_obj(self) -> dict[str, Any]:
        """What every replica holds alike (with zero1 the optimizer lives in the shards)."""
        opt = self.optimizer.state_dict() if self.optimizer is not None and self.zero is None else {}
        return {
            "model": self.model.state_dict() if self.model is not None else {},
            "optimizer": opt,
            "extra": {k: v.state_dict() for k, v in self.extra.items()},
        }

    def state_digest(self) -> str:
        tensors: list[torch.Tensor] = []
        s = self.state_obj()
        flatten({"model": s["model"], "optimizer": s["optimizer"]}, tensors)
        return digest(tensors)

    def load_state(self, state: dict[str, Any]) -> None:
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and self.zero is None:
            self.optimizer.load_state_dict(state["optimizer"])
        for k, v in self.extra.items():
            v.load_state_dict(state["extra"][k])

    def hparams(self) -> list[dict]:
        """The optimizer's param-group hyperparameters (what a scheduler sets)."""
        if self.optimizer is None:
            return []
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def set_hparams(self, hparams: list[dict]) -> None:
        for grp, hp in zip(self.optimizer.param_groups if self.optimizer else [], hparams, strict=True):
            grp.update(hp)
