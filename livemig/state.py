"""The registered state as data: flatten to (skeleton, tensors) and back.

A state dict (model, optimizer, any `state_dict()` object) is split into a
msgpack-able skeleton, where each tensor is replaced by `{"__t__": i}` and each
tuple by `{"__tuple__": [...]}` (so it comes back a tuple, not a list), and
a flat list of tensors. The skeleton travels in a transfer header; the
tensors travel as raw bytes. Nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import blake3
import torch

from livemig.errors import ConfigError

_T = "__t__"
_TUPLE = "__tuple__"


def flatten(obj: Any, tensors: list[torch.Tensor], path: str = "") -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_T: len(tensors) - 1}
    if isinstance(obj, Mapping):
        return {k: flatten(v, tensors, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, tuple):  # msgpack has one array type: a tuple (AdamW's betas) is tagged to come back one
        return {_TUPLE: [flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    raise ConfigError(
        f"registered state at {path or '<root>'} holds a {type(obj).__name__}, which livemig "
        "cannot stream without pickle: keep state_dict() values to tensors, numbers, strings, "
        "lists and dicts"
    )


def unflatten(skel: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skel, dict):
        if set(skel) == {_T}:
            return tensors[skel[_T]]
        if set(skel) == {_TUPLE}:
            return tuple(unflatten(v, tensors) for v in skel[_TUPLE])
        return {k: unflatten(v, tensors) for k, v in skel.items()}
    if isinstance(skel, list):
        return [unflatten(v, tensors) for v in skel]
    return skel


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": t.nbytes}


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in transfer header")
    return dt


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view sharing memory with `t` (contiguous CPU tensors only)."""
    if not t.is_contiguous():
        raise ValueError("state tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def digest(tensors: list[torch.Tensor]) -> str:
    """BLAKE3 over dtype, shape and bytes of each tensor, in order. BLAKE3, not sha256:
    the final records hash the whole state twice at the end of every job, and at
    ~4 GB/s against sha256's ~1 GB/s that is most of the time from the last step to exit."""
    h = blake3.blake3()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(as_bytes(t).numpy())  # type: ignore[arg-type]  # the tensor's memory, no copy (numpy's stubs omit __buffer__)
    return h.hexdigest()


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def to_local(obj: Any) -> Any:
    """A state object with each DTensor replaced by this rank's local shard (what streams)."""
    if is_dtensor(obj):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_local(v) for v in obj)
    return obj


def signature(model_sd: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """(name, dtype, shape) of every model tensor: what a spare must match."""
    return [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in model_sd.items()]


def pack(obj: Any) -> torch.Tensor:
    """One uint8 tensor holding `obj` (a state dict): an 8-byte header length, a msgpack
    header (skeleton, tensor metas), then the raw tensor bytes. A deep copy by
    construction, so a snapshot cannot change when the live object does; no pickle."""
    import msgpack

    tensors: list[torch.Tensor] = []
    skel = flatten(obj, tensors)
    tensors = [t.detach().cpu().contiguous() for t in tensors]
    head = msgpack.packb({"skel": skel, "metas": [tensor_meta(t) for t in tensors]}, use_bin_type=True)
    total = 8 + len(head) + sum(t.nbytes for t in tensors)
    out = torch.empty(total, dtype=torch.uint8)
    out[:8] = torch.frombuffer(bytearray(len(head).to_bytes(8, "little")), dtype=torch.uint8)
    out[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    at = 8 + len(head)
    for t in tensors:
        out[at : at + t.nbytes] = as_bytes(t)
        at += t.nbytes
    return out


def unpack(buf: torch.Tensor) -> Any:
    """The inverse of pack(): fresh tensors, sharing nothing with `buf`."""
    import msgpack

    raw = buf.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    head = msgpack.unpackb(raw[8 : 8 + n], raw=False, strict_map_key=False)
    at, tensors = 8 + n, []
    for meta in head["metas"]:
        t = torch.empty(meta["shape"], dtype=dtype_of(meta["dtype"]))
        if meta["nbytes"]:
            as_bytes(t).copy_(torch.frombuffer(bytearray(raw[at : at + meta["nbytes"]]), dtype=torch.uint8))
        at += meta["nbytes"]
        tensors.append(t)
    return unflatten(head["skel"], tensors)
