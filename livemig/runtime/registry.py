"""What the user registered, as an object of its own: the bottom of runtime/.

The model, the optimizer (a template under ZeRO-1), the replicated extras
(schedulers: anything with state_dict/load_state_dict that every rank holds
alike) and the rank-local state (`local=`: data positions, per-rank RNGs,
metric accumulators) with the model's buffers, which are per rank too
(BatchNorm statistics; DDP's broadcast_buffers=False). It knows the
registered state's signature (what a spare must match), its streamable
forms, and their digests; the step protocol, the recovery and the migration
all read it from here (docs/architecture.md, "Exact state, rank by rank").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from livemig.config import ENV_LOCAL_MAX_MB, LOCAL_STATE_ENTRY, env_mib
from livemig.errors import ConfigError
from livemig.state import digest, flatten, pack, signature, to_local

PARAMS_CHECK, OPTIMIZER_CHECK = "<parameters>", "<optimizer>"  # replica_digests' entries besides the extras


def local_limit_bytes() -> int:
    return env_mib(ENV_LOCAL_MAX_MB, "64")


def _streamable(name: str, obj: Any) -> None:
    """Refuse at register() what could not be streamed during a recovery."""
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise ConfigError(f"ctx.register({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict")
    try:
        flatten(obj.state_dict(), [], name)
    except ConfigError as exc:
        raise ConfigError(f"ctx.register: {exc}") from None


def load_extra(obj: Any, state: Any) -> None:
    """A registered extra set to a boundary's state. A GradScaler's state_dict() leaves out
    the "unscaled" mark that scaler.unscale_(opt) sets until its update(): a body that
    unscaled to clip and whose step did not end in this update (a spare's replayed body, a
    shrunk job's earlier bodies of a step) left it set, and the next unscale_() raised
    "unscale_() has already been called". At a boundary no step is in progress: cleared."""
    obj.load_state_dict(state)
    if isinstance(obj, torch.amp.GradScaler):
        obj._per_optimizer_states.clear()  # torch's defaultdict: refreshed on the next access


@dataclass(frozen=True)
class Layout:
    """How a kind of parallelism lays the registered state out over the ranks, as facts the
    registry's streamable forms and digests depend on (each strategy declares its own:
    runtime/strategies/). Plain data parallel is the default: everything replicated."""

    params_sharded: bool = False  # each rank holds local shards of the parameters (DTensors: FSDP2)
    optimizer_sharded: bool = False  # the optimizer's state differs from rank to rank (ZeRO-1, FSDP2)
    optimizer_in_shards: bool = False  # ... and lives outside the optimizer, in shards served apart (ZeRO-1)


class Registry:
    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.extra: dict[str, Any] = {}
        self.local: dict[str, Any] = {}
        self.params: list[torch.nn.Parameter] = []
        self.buffer_names: list[str] = []  # the model's persistent buffers: per-rank state
        self._model_sig: list | None = None  # the model's entries of the signature (its structure is fixed)
        self.sync_start = True  # make the replicas rank 0's when the job forms (runtime/start_sync.py)
        self.layout = Layout()  # set by the strategy ctx.register() picks

    def set(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
            extra: dict[str, Any], local: dict[str, Any] | None = None) -> None:  # fmt: skip
        local = dict(local or {})
        for name, obj in [*extra.items(), *local.items()]:
            _streamable(name, obj)
        both = set(extra) & set(local)
        if both:
            raise ConfigError(f"ctx.register: {sorted(both)[0]!r} is registered both as an extra and under local=")
        if optimizer is not None:
            _streamable("optimizer", optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        if model is not None and not self.params:
            raise ConfigError(
                f"ctx.register(model=...): the {type(model).__name__} has no trainable parameters "
                "(all have requires_grad=False): there is nothing to average; register a model that trains"
            )
        self.model, self.optimizer, self.extra, self.local = model, optimizer, extra, local
        pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)} if model is not None else set()
        self.buffer_names = [k for k in model.state_dict() if k not in pnames] if model is not None else []

    @property
    def has_local(self) -> bool:
        return bool(self.buffer_names or self.local)

    def signature(self) -> list:
        if self._model_sig is None:  # once: FSDP2's state_dict hooks, run between steps, break its next step
            self._model_sig = signature(self.model.state_dict()) if self.model is not None else []
        sig = [list(e) for e in self._model_sig]
        if self.optimizer is not None:  # a spare must step the same way: class and group sizes
            sizes = [sum(p.numel() for p in g["params"]) for g in self.optimizer.param_groups]
            sig.append(["<optimizer>", type(self.optimizer).__name__, sizes])
        sig += [["<extra>", k, []] for k in sorted(self.extra)]
        sig += [["<local>", k, []] for k in sorted(self.local)]
        if self.has_local:  # the coordinator checks each lost rank's local state has a live mirror
            sig.append([LOCAL_STATE_ENTRY, "mirrored", []])
        return sig  # the strategy adds how the state is laid out (api.Engine.signature)

    def _model_sd(self, skip: Collection[str] | None = None) -> dict[str, Any]:
        """The model's state_dict; under FSDP2 this rank's local shards of it."""
        if self.model is None:
            return {}
        sd = self.model.state_dict()
        if self.layout.params_sharded:
            sd = to_local(sd)
        return {k: v for k, v in sd.items() if not skip or k not in skip}

    def _opt_sd(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        if self.layout.params_sharded:  # the optimizer's state is DTensors too
            return to_local(self.optimizer.state_dict())
        return self.optimizer.state_dict()

    def state_obj(self) -> dict[str, Any]:
        """What every replica holds alike (with zero1 the optimizer lives in the shards)."""
        opt = self._opt_sd() if not self.layout.optimizer_in_shards else {}
        return {
            "model": self._model_sd(),
            "optimizer": opt,
            "extra": {k: v.state_dict() for k, v in self.extra.items()},
        }

    def state_digest(self) -> str:
        """Parameters and optimizer only: what the report has always compared."""
        tensors: list[torch.Tensor] = []
        s = self.state_obj()
        flatten({"model": s["model"], "optimizer": s["optimizer"]}, tensors)
        return digest(tensors)

    def digests(self) -> dict[str, str]:
        """One digest per kind of state, over everything registered: `replicated` must
        be equal on every rank, `local` is this rank's own (buffers, local=)."""
        return {"replicated": _digest_of(self.replicated()), "local": _digest_of(self.local_state())}

    def replicated(self) -> dict[str, Any]:
        """What every rank holds alike: parameters, optimizer (values and param-group
        hyperparameters), extras."""
        model = self._model_sd(set(self.buffer_names))
        opt = self._opt_sd()
        return {"model": model, "optimizer": opt, "extra": {k: v.state_dict() for k, v in self.extra.items()}}

    def replica_digests(self) -> dict[str, str]:
        """Digests of what must be equal on every rank: the parameters (`<parameters>`), the
        optimizer's state and hyperparameters (`<optimizer>`, unless sharded), each extra."""
        rep = self.replicated()
        out = {PARAMS_CHECK: _digest_of(rep["model"])} if not self.layout.params_sharded else {}
        if not self.layout.optimizer_sharded and self.optimizer is not None:
            out[OPTIMIZER_CHECK] = _digest_of(rep["optimizer"])
        return {**out, **{k: _digest_of(v) for k, v in rep["extra"].items()}}

    # -- state of a step boundary (docs/architecture.md, "The boundary rule") -------------------
    def local_state(self) -> dict[str, Any]:
        sd = self.model.state_dict() if self.model is not None else {}
        return {"buffers": {k: sd[k] for k in self.buffer_names},
                "local": {k: v.state_dict() for k, v in self.local.items()}}  # fmt: skip

    def pack_local(self) -> torch.Tensor:
        blob = pack(self.local_state())
        limit = local_limit_bytes()
        if blob.numel() > limit:
            raise ConfigError(
                f"rank-local state (model buffers and local=) is {blob.numel() / 2**20:.1f} MiB, over "
                f"{ENV_LOCAL_MAX_MB}={limit / 2**20:g}: it is mirrored on a buddy rank every step; "
                "keep it small or raise the limit"
            )
        return blob

    def load_local(self, state: dict[str, Any]) -> None:
        if self.model is not None and state["buffers"]:
            bufs = dict(self.model.state_dict(keep_vars=True))
            with torch.no_grad():
                for k, v in state["buffers"].items():
                    bufs[k].copy_(v)
        for k, v in self.local.items():
            v.load_state_dict(state["local"][k])

    def pack_boundary(self) -> torch.Tensor:
        """The replicated state user code changes outside the optimizer step: the
        extras and the param-group hyperparameters (a scheduler's learning rate)."""
        return pack({"extra": {k: v.state_dict() for k, v in self.extra.items()}, "hparams": self.hparams()})

    def load_boundary(self, state: dict[str, Any]) -> None:
        for k, v in self.extra.items():
            load_extra(v, state["extra"][k])
        self.set_hparams(state["hparams"])

    def load_state(self, state: dict[str, Any]) -> None:
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and not self.layout.optimizer_in_shards:
            self.optimizer.load_state_dict(state["optimizer"])
        for k, v in self.extra.items():
            load_extra(v, state["extra"][k])

    def ensure_grads(self) -> None:
        """A parameter backward did not reach still takes part in the reduction, as zeros."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def opt_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer else []

    def step_optimizer(self, scaler: Any = None, applied: list | None = None) -> None:
        """optimizer.step() (or a GradScaler's step and update: it skips the step on
        inf/nan, the same on every rank, since every rank holds the same average), then
        zero_grad(). The one optimizer step of the plain path and of the sandbox.

        applied: a list that receives what the step really applied, for a spare catching
        up in a planned migration (apply_step): the gradients as the optimizer saw them
        (after clipping, after the scaler unscaled them), captured by a step pre-hook so
        a step the scaler skips captures nothing, and the scaler's state after update()."""
        if self.optimizer is None:
            return
        hook = None
        if applied is not None:

            def grab(*_: Any) -> None:
                applied.append([None if p.grad is None else p.grad.detach().clone() for p in self.opt_params()])

            hook = self.optimizer.register_step_pre_hook(grab)
        try:
            if scaler is not None:
                scaler.step(self.optimizer)
                scaler.update()
            else:
                self.optimizer.step()
        finally:
            if hook is not None:
                hook.remove()
        self.optimizer.zero_grad()
        if applied is not None:
            grads = applied[0] if applied else None
            applied[:] = [{"grads": grads, "stepped": grads is not None, "scaler": self.extra_state_of(scaler)}]

    def extra_name_of(self, obj: Any) -> str:
        """The name a GradScaler passed to ctx.step() is registered under: a spare follows it by that name."""
        name = next((k for k, v in self.extra.items() if v is obj), None)
        if name is None:
            raise ConfigError("ctx.step(scaler=...): register the GradScaler as an extra (ctx.register(scaler=s))")
        return name

    def extra_state_of(self, obj: Any) -> list | None:
        """[name, state_dict()] of a registered extra (the GradScaler of a step), None if no obj."""
        return None if obj is None else [self.extra_name_of(obj), obj.state_dict()]

    def apply_step(self, applied: dict) -> None:
        """A catching-up spare repeats a step exactly as the leaving worker applied it
        (step_optimizer's `applied`): the same gradients into the same optimizer state,
        no step where the scaler skipped one, and the scaler's state after its update."""
        if self.optimizer is None:
            return
        if applied["stepped"]:
            for p, g in zip(self.opt_params(), applied["grads"], strict=True):
                p.grad = g
            self.optimizer.step()
        self.optimizer.zero_grad()
        self.load_extra_state(applied.get("scaler"))

    def load_extra_state(self, named: list | None) -> None:
        """An extra's state as extra_state_of gave it (None: nothing)."""
        if named is not None:
            name, sd = named
            load_extra(self.extra[name], sd)

    def hparams(self) -> list[dict]:
        """The optimizer's param-group hyperparameters (what a scheduler sets)."""
        if self.optimizer is None:
            return []
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def set_hparams(self, hparams: list[dict]) -> None:
        for grp, hp in zip(self.optimizer.param_groups if self.optimizer else [], hparams, strict=True):
            for k, v in hp.items():  # tuples (betas) come back tuples (state.flatten)
                grp[k] = v


def _digest_of(obj: Any) -> str:
    import hashlib

    import msgpack

    tensors: list[torch.Tensor] = []
    skel = flatten(obj, tensors)
    h = hashlib.sha256(msgpack.packb(skel, use_bin_type=True, default=str))
    return hashlib.sha256((h.hexdigest() + digest(tensors)).encode()).hexdigest()
