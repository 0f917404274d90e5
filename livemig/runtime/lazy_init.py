"""A claimed spare's model built without its random initial values.

A claimed spare enters the user's function again with its new rank (runtime/standby.py), and
the function builds the model anew before `ctx.register`: for an 8 x Linear(3072, 3072) MLP
that is 0.37 s of `uniform_` on this machine, for values that are thrown away a moment later,
when a follow spare swaps in the parameters it kept (runtime/follow.py). That build was most
of a follower's downtime and the part of it that grew with the model.

So the random fills of that entry are deferred, exactly:
- the spare's first entry (its warm-up) runs the same code and records, per random fill, the
  generator's state before and after it (`_Record`), keyed by the op, its arguments, the
  tensor's shape, strides and dtype, and the state before;
- the entry after the claim (`_Defer`) finds each fill in that memo by the same key: the
  generator is set to the recorded state after it, as if the fill had run, and the fill waits
  (`_Pending`). A fill the memo lacks (a per-rank seed: another state) runs as before;
- anything that reads a pending tensor (an op on its storage other than a view or a metadata
  op: a clone, a `.to()`, an in-place op after the fill; or a read past the dispatcher,
  `_RawReads`: numpy(), tolist(), torch.save) runs the fill first, from its recorded state,
  so the values are those the fill would have given; a whole-storage overwrite (`copy_`,
  `fill_`, `zero_`, another fill) drops it;
- a copy of a pending tensor (`.to(device)`, `.to(dtype)`: a model built on the CPU, then
  moved) is allocated, not made, and waits too (`_Copied`);
- at the take-over (`finish`), a pending fill whose storage nobody holds any more (the
  follower's tensors were swapped in) is dropped; one still held (a tensor the function kept
  apart, a streamed take-over that loads into the built model) runs then.

The global generator leaves the entry in the state the plain build leaves it in, so code
that draws after the build (a synthetic data set, a per-rank shuffle) draws the same values.
The mode is a TorchDispatchMode on the main thread only, pushed for the window between the
entry's start and its state's load, never during training.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import overrides
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils._pytree import tree_flatten

from livemig.config import ENV_LAZY_INIT

log = logging.getLogger("livemig.runtime.lazy_init")

_aten = torch.ops.aten
FILLS = {
    _aten.uniform_.default, _aten.normal_.default, _aten.random_.default, getattr(_aten.random_, "from"),
    _aten.random_.to, _aten.bernoulli_.float, _aten.exponential_.default, _aten.geometric_.default,
    _aten.log_normal_.default, _aten.cauchy_.default,
}  # fmt: skip
OVERWRITES = {_aten.copy_.default, _aten.fill_.Scalar, _aten.zero_.default}  # every element written, none read
METADATA = {_aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
            _aten.detach.default, _aten.alias.default}  # no element read  # fmt: skip


def _generator(t: torch.Tensor, kwargs: dict[str, Any]) -> torch.Generator | None:
    g = kwargs.get("generator")
    if g is not None:
        return g
    if t.device.type == "cpu":
        return torch.default_generator
    if t.device.type == "cuda":
        return torch.cuda.default_generators[t.device.index if t.device.index is not None else 0]
    return None  # another device: its fills run as they are


def _fill_generator(func: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Generator | None:
    """The generator a random fill draws from; None for any other op (or a device we skip)."""
    if func not in FILLS or not isinstance(args[0], torch.Tensor):
        return None
    return _generator(args[0], kwargs)


def _key(func: Any, args: tuple, kwargs: dict[str, Any], state: torch.Tensor) -> tuple:
    t = args[0]
    rest = tuple(repr(a) for a in args[1:])
    kw = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "generator"))
    digest = hashlib.blake2b(state.cpu().numpy().tobytes(), digest_size=16).digest()
    return (str(func), rest, kw, tuple(t.shape), t.stride(), str(t.dtype), t.device.type,
            kwargs.get("generator") is not None, torch.get_num_threads(), digest)  # fmt: skip


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _whole(t: torch.Tensor) -> bool:
    """Does t cover every byte of its storage (an overwrite of t leaves nothing of a fill)?"""
    size = t.numel() * t.element_size()
    return bool(t.is_contiguous() and t.storage_offset() == 0 and size == t.untyped_storage().nbytes())


class _Record(TorchDispatchMode):
    """The first entry: every random fill runs, and what it did to its generator is kept."""

    def __init__(self, memo: dict[tuple, torch.Tensor]) -> None:
        super().__init__()
        self.memo = memo

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        g = _fill_generator(func, args, kwargs)
        if g is None:
            return func(*args, **kwargs)
        before = g.get_state()
        out = func(*args, **kwargs)
        self.memo[_key(func, args, kwargs, before)] = g.get_state()
        return out


@dataclass
class _Pending:
    ref: StorageWeakRef  # weak: a storage nobody else holds dies, and its fill with it
    view: tuple  # the filled tensor on its storage: dtype, device, offset, size, stride
    func: Any
    args: tuple  # after the tensor (a strong reference to it would hold the storage)
    kwargs: dict[str, Any]
    gen: torch.Generator
    before: torch.Tensor  # the generator's state the fill starts from

    def run(self) -> bool:
        """The fill, from its recorded state; False where its storage is gone."""
        t = _revive(self.ref, self.view)
        if t is None:
            return False
        with torch._C.DisableTorchFunction(), no_dispatch():  # the fill itself, past both modes
            self.fill(t)
        return True

    def fill(self, t: torch.Tensor) -> None:
        now = self.gen.get_state()
        self.gen.set_state(self.before)
        try:
            self.func(t, *self.args, **self.kwargs)
        finally:
            self.gen.set_state(now)


@dataclass
class _Copied:
    """A copy (`.to(device)`, `.to(dtype)`: aten._to_copy) of a tensor whose fills wait: its
    values are the source's fills, run on a fresh tensor shaped as the source, then copied."""

    ref: StorageWeakRef  # the copy's storage
    view: tuple
    source: tuple  # the source's view (dtype, device, offset 0, size, stride)
    fills: list[_Pending]

    def run(self) -> bool:
        out = _revive(self.ref, self.view)
        if out is None:
            return False
        dtype, device, _, size, stride = self.source
        with torch._C.DisableTorchFunction(), no_dispatch():
            tmp = torch.empty_strided(size, stride, dtype=dtype, device=device)
            for f in self.fills:
                f.fill(tmp)
            out.copy_(tmp)  # what _to_copy does after its empty_like
        return True


def _view(t: torch.Tensor) -> tuple:
    return (t.dtype, t.device, t.storage_offset(), tuple(t.shape), t.stride())


def _revive(ref: StorageWeakRef, view: tuple) -> torch.Tensor | None:
    """The tensor a pending record fills, on its storage; None where the storage is gone."""
    if ref.expired():
        return None
    dtype, device, offset, size, stride = view
    with torch._C.DisableTorchFunction(), no_dispatch():
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


class _Defer(TorchDispatchMode):
    """The entry after a claim: fills found in the memo wait until something reads them."""

    def __init__(self, memo: dict[tuple, torch.Tensor]) -> None:
        super().__init__()
        self.memo = memo
        self.pending: dict[int, list[_Pending | _Copied]] = {}  # by storage, in the order the fills ran
        self.deferred = self.ran = self.dropped = 0

    def run_pending(self, storage: int) -> None:
        for p in self.pending.pop(storage, []):
            if p.run():
                self.ran += 1
            else:
                self.dropped += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        with torch._C.DisableTorchFunction():  # our own storage lookups are no raw reads (_RawReads)
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if func is _aten._to_copy.default and self.pending and (out := self._copy(args[0], kwargs)) is not None:
            return out
        if self.pending:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if (func in OVERWRITES or func in FILLS) and tensors and _whole(tensors[0]):
                dest = _storage(tensors[0])  # written whole: its earlier fills are dead, unless it is also read
                if dest in self.pending and all(_storage(t) != dest for t in tensors[1:]):
                    self.dropped += len(self.pending.pop(dest))
                tensors = tensors[1:]  # the source of a copy_ is read
            if not (func.is_view or func in METADATA):
                for t in tensors:
                    if _storage(t) in self.pending:
                        self.run_pending(_storage(t))
        g = _fill_generator(func, args, kwargs)
        if g is None:
            return func(*args, **kwargs)
        t = args[0]
        before = g.get_state()
        after = self.memo.get(_key(func, args, kwargs, before))
        if after is None:  # not seen in the warm-up (another seed, another shape): it runs now
            return func(*args, **kwargs)
        g.set_state(after)
        self.pending.setdefault(_storage(t), []).append(
            _Pending(StorageWeakRef(t.untyped_storage()), _view(t), func, args[1:], kwargs, g, before)
        )
        self.deferred += 1
        return t

    def _copy(self, src: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """`.to(device)` / `.to(dtype)` of a tensor whose fills all wait and cover it whole
        (a model built on the CPU, then moved): the copy waits too (`_Copied`). None: it runs."""
        fills = self.pending.get(_storage(src))
        if not fills or not _whole(src) or not all(isinstance(f, _Pending) and f.view == _view(src) for f in fills):
            return None
        out = _aten.empty_like.default(src, **{k: v for k, v in kwargs.items() if k != "non_blocking"})
        record = _Copied(StorageWeakRef(out.untyped_storage()), _view(out), _view(src), list(fills))  # type: ignore[arg-type]
        self.pending.setdefault(_storage(out), []).append(record)
        self.deferred += 1
        return out


_T = torch.Tensor
RAW_READS = {_T.numpy, _T.tolist, _T.data_ptr, _T.untyped_storage, _T.storage, _T.__array__, _T.__reduce_ex__,
             _T.__dlpack__}  # fmt: skip


class _RawReads(TorchFunctionMode):
    """Reads that bypass the dispatcher (numpy(), tolist(), torch.save through untyped_storage(),
    pickling, DLPack): the pending fills of the tensor's storage run first, as for any read."""

    def __init__(self, defer: _Defer) -> None:
        super().__init__()
        self.defer = defer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in RAW_READS and self.defer.pending:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and _storage(t) in self.defer.pending:
                    self.defer.run_pending(_storage(t))
        return func(*args, **kwargs)


class LazyInit:
    """Owned by api.Engine: the record in a spare's first entry, the deferral in the entry
    after its claim (see the module doc)."""

    def __init__(self) -> None:
        self.memo: dict[tuple, torch.Tensor] = {}
        self._mode: _Record | _Defer | None = None
        self._raw: _RawReads | None = None  # beside a deferral
        self._owner = 0  # the thread whose mode stacks hold ours (the function's)
        self.figures: dict[str, float] = {}  # the last deferral's: fills deferred, run, dropped; seconds run

    def enter(self, role: str, joining: Any) -> None:
        """An entry of the function starts: a spare's first (or requeued) entry records, a
        claimed spare's defers; a migration's spare (its state replaces the build's through the
        handover) and every other entry run as they are. LIVEMIG_LAZY_INIT=0 turns it off."""
        if role != "spare" or os.environ.get(ENV_LAZY_INIT, "1") == "0":
            return
        if joining is None:
            self.record()
        elif not (joining.migration or joining.restart or joining.redo):
            self.defer()

    def record(self) -> None:
        """A spare's first entry starts (or a requeued one's again): its fills are the memo."""
        self.finish()
        self.memo = {}
        self._push(_Record(self.memo))

    def defer(self) -> None:
        """A claimed spare's entry starts: fills seen in the warm-up wait."""
        self.finish()
        if self.memo:
            defer = _Defer(self.memo)
            self._push(defer)
            self._raw = _RawReads(defer)
            self._raw.__enter__()

    def loop_starts(self) -> None:
        """ctx.steps() starts: a record ends here (the warm-up's state is built); a deferral
        goes on until the state is loaded (`finish`)."""
        if isinstance(self._mode, _Record):
            self._pop()

    def finish(self, overwritten: list[torch.Tensor] | None = None) -> None:
        """The state is loaded (or the entry ended, or a pull is about to write): fills whose
        storage nobody holds any more are dropped, so are those of `overwritten` (tensors the
        caller writes whole next: a streamed take-over's model), the others run now, and the
        mode is gone."""
        mode = self._mode
        if mode is None:
            return
        if threading.get_ident() != self._owner:  # the modes are the pushing thread's: a pull behind them would clobber
            raise RuntimeError("livemig bug: the claimed entry's deferred fills were finished off the thread that "
                               "entered the function; run with LIVEMIG_LAZY_INIT=0 and report it")  # fmt: skip
        self._pop()
        if not isinstance(mode, _Defer):
            return
        t0 = time.monotonic()
        for t in overwritten or []:
            if _whole(t) and _storage(t) in mode.pending:
                mode.dropped += len(mode.pending.pop(_storage(t)))
        for storage in list(mode.pending):
            mode.run_pending(storage)  # a storage nobody holds any more is gone: its fills are dropped
        self.figures = {"deferred": mode.deferred, "ran": mode.ran, "dropped": mode.dropped,
                        "ran_s": round(time.monotonic() - t0, 4)}  # fmt: skip
        log.info("lazy init", extra=self.figures)

    def _push(self, mode: _Record | _Defer) -> None:
        mode.__enter__()
        self._mode, self._owner = mode, threading.get_ident()

    def _pop(self) -> None:
        """Our modes leave their stacks, also where the function pushed its own above them."""
        raw, self._raw = self._raw, None
        if raw is not None:
            _leave(raw, overrides._get_current_function_mode_stack, overrides._pop_mode, overrides._push_mode)
        mode, self._mode = self._mode, None
        if mode is not None:
            _leave(mode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode)


def _leave(mode: Any, stack: Callable[[], list], pop: Callable[[], Any], push: Callable[[Any], None]) -> None:
    """`mode` leaves its stack: the modes above it (a user's, pushed inside the function and
    still open) are popped, ours exits, and theirs go back in their order."""
    if mode not in stack():
        return
    above = []
    while stack() and stack()[-1] is not mode:
        above.append(pop())
    mode.__exit__(None, None, None)
    for m in reversed(above):
        push(m)
