"""Checkpoints in the background, and loading one: what live recovery cannot cover.

A collaborator of api.Engine (`engine.ckpt`). At a checkpointed step's boundary (the
state when ctx.steps() yields the next step, docs/architecture.md "The boundary rule")
the training thread stages this rank's part to fresh CPU memory, one copy per tensor,
and a writer thread saves it with torch.distributed.checkpoint (DCP) into a directory
of its own (livemig/checkpoint_dir.py has the layout), fsyncs it, writes its marker and
publishes the checkpoint once every rank's marker is there. Training goes on meanwhile;
a write that fails is logged once and counted, never a failure of the job.

What each rank writes, so that nothing is written twice (DCP's own deduplication of
replicated tensors needs its collectives, which would run on the training group):

    rank 0:  "model" (its whole state_dict: parameters and its buffers), "state.optimizer"
             (plain path), "state.boundary" (extras, param-group hyperparameters)
    rank r:  "model" (its buffers), "state.local" (local=), "state.shard" (ZeRO-1: its own shard),
             "state.fsdp" (FSDP2: its local shards of the parameters and the optimizer state; under
             FSDP2 rank 0's "model" holds its buffers only, the parameters are in every rank's part)
    every:   "meta" (msgpack bytes: the skeletons of the flattened sections, the step, the signature)

Non-tensor state is never pickled by livemig: sections are flattened (livemig/state.py)
into tensors and a msgpack skeleton, which DCP stores as a uint8 tensor. DCP's own
`.metadata` file is a pickle: a part's files are checked against their BLAKE3 before it is
read (livemig/checkpoints.verify), so only bytes this job wrote reach it. Rank 0's part is
a plain DCP checkpoint of the model: `dcp.load({"model": model.state_dict()},
checkpoint_id=".../rank_00000")` loads it without livemig (docs/operations.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import torch

from livemig import checkpoint_dir as layout
from livemig.errors import ConfigError
from livemig.state import flatten, unflatten

if TYPE_CHECKING:
    from livemig.runtime.member import MemberRuntime

log = logging.getLogger("livemig.runtime.checkpoint")


class CheckpointHost(Protocol):
    """What the checkpointer uses of its Engine."""

    rank: int
    world_size: int
    reg: Any
    runtime: MemberRuntime  # None outside `livemig run`: tested before use
    timeouts: Any
    faults: Any
    strategy: Any  # the kind of parallelism (runtime/strategies/): the sections it adds to a part
    virtual: Any  # a shrunk job's carried ranks (runtime/virtual.py): their parts are written here too

    def signature(self) -> list: ...


def signature_hash(sig: list) -> str:
    return hashlib.sha256(msgpack.packb(sig, use_bin_type=True, default=str)).hexdigest()[:32]


def _model_sd(reg: Any) -> dict[str, Any]:
    """The model's state_dict; under FSDP2 its buffers only: the parameters travel as local
    shards (the "fsdp" section), and FSDP2's state_dict hooks, run between steps, leave the
    next backward with freed parameter storage."""
    if reg.model is None:
        return {}
    if not reg.layout.params_sharded:
        return reg.model.state_dict()
    names = set(reg.buffer_names)
    return {k: v for k, v in reg.model.named_buffers() if k in names}


def _stage(t: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A copy of `t` in CPU memory (a previous checkpoint's buffer reused when it fits)."""
    t = t.detach()
    if into is not None and into.shape == t.shape and into.dtype == t.dtype:
        return into.copy_(t)
    return t.to("cpu", copy=True)


class Checkpointer:
    """This rank's checkpoints: staged at a boundary, written by a thread, one at a time."""

    def __init__(self, host: CheckpointHost) -> None:
        self._host = host
        self.settings = layout.Settings.from_env()
        self.resume_path = os.environ.get(layout.ENV_RESUME, "")
        self.resumed: int | None = None  # the step whose checkpoint this process loaded
        self._converted = False  # it was of another world size, and --checkpoint-dir is another directory
        self._last = time.monotonic()  # the last staging (--checkpoint-interval counts from it)
        # [step, staged_at, staged_s, written_s, ok, waited_s]: the final record's (bench checkpoint reads it)
        self.records: list[list] = []
        self.failed = 0
        self.timeout = float(os.environ.get(layout.ENV_WRITE_TIMEOUT, "") or 600)
        self._said_wait = False
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()  # no write in flight
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._staged: dict[int, dict[str, torch.Tensor]] = {}  # rank -> its part's staging buffers (reused)
        fail = os.environ.get(layout.ENV_FAIL_WRITE, "")
        self._fail_at = tuple(int(x) for x in fail.split(":")) if fail else None

    def set_from_script(self, root: str, every: int | None, interval: float | None, keep: int,
                        local: bool) -> None:  # fmt: skip
        """ctx.checkpoints(...): the script's settings, unless the command line gave some. The
        directory travels to the coordinator with rank 0's registration (the cold path's)."""
        wanted = layout.Settings.from_script(root, every, interval, keep)  # refused here if malformed
        if self.settings is None and not local:
            self.settings = wanted

    # -- writing ------------------------------------------------------------------------
    def at_boundary(self, step: int) -> None:
        """Called by the step loop at each boundary of the user's own steps."""
        s = self.settings
        if s is None:
            return
        # a checkpoint resharded at the load is written at once into a new --checkpoint-dir, so
        # that a cold restart of this run loads its own world size (it is written nowhere else)
        converted = step == self.resumed and self._converted
        if not converted and (step == self.resumed or not (s.due(step) or self._interval_due(s, step))):
            return
        self._write(step)

    def write_now(self, step: int) -> bool:
        """The checkpoint of this boundary, whether due or not, written before this returns
        (a job that stops, runtime/stop.py): True once this rank's part is durable."""
        if self.settings is None:
            return False
        if not self.records or self.records[-1][0] != step:  # not staged by at_boundary already
            self._write(step)
        self.wait(self.timeout)
        return bool(self._idle.is_set() and self.records and self.records[-1][0] == step and self.records[-1][4])

    def _write(self, step: int) -> None:
        """Stage this rank's part of `step` now and queue it for the writer thread."""
        waited = 0.0
        if not self._idle.is_set():  # every rank writes every checkpoint: the previous write ends first
            w0 = time.monotonic()
            self.wait(self.timeout)
            waited = time.monotonic() - w0
            if not self._idle.is_set():
                self._failed(step, time.time(), 0.0, TimeoutError(
                    f"the previous checkpoint's write is still running after {self.timeout:g} s"))  # fmt: skip
                return
            if not self._said_wait:
                self._said_wait = True
                log.warning("a checkpoint waited for the previous one's write: writes take longer than "
                            "--checkpoint-every steps (raise it)",
                            extra={"step": step, "waited_s": round(waited, 3)})  # fmt: skip
        t0 = self._last = time.monotonic()
        started = time.time()  # staged_at: when staging began (the report adds staged_s and written_s)
        try:
            parts = [(self._host.rank, self._state_dict(step))]
            for v in self._host.virtual.carried():  # shrunk: the carrier writes the ranks it runs
                with self._host.virtual.as_rank(v, step):
                    parts.append((v, self._state_dict(step, v)))
        except Exception as exc:  # what cannot be staged is said, and training goes on
            self._failed(step, started, 0.0, exc)
            return
        rec = [step, started, round(time.monotonic() - t0, 6), None, None, round(waited, 6)]
        self.records.append(rec)
        del self.records[:-200]
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="livemig-checkpoint", daemon=True)
            self._thread.start()
        self._queue.put((step, parts, rec))

    def _interval_due(self, s: layout.Settings, step: int) -> bool:
        """--checkpoint-interval: every `probe` steps the ranks agree (one allreduce of a flag)
        whether every one of them last staged `interval` seconds ago or more; all then write the
        same step. Every rank, not any: the ranks reach a boundary up to a step apart, and with
        'any' the one that staged last would write again sooner than the interval. A probe the
        group cannot finish (a peer lost: the recovery handles it) is a no."""
        if not s.probes(step):
            return False
        h = self._host
        flag = torch.tensor([float(time.monotonic() - self._last < s.interval)])  # not yet due here
        if h.world_size > 1:
            from livemig.comm.group import CollectiveAborted, allreduce_sum

            try:
                allreduce_sum(h.runtime.pg, [flag], h.timeouts.collective, h.runtime.moved_on)
            except CollectiveAborted:
                return False
        return bool(flag.item() == 0)

    def _state_dict(self, step: int, rank: int | None = None) -> dict[str, Any]:
        """Rank `rank`'s part (default this process's own; a carried rank's, its local state
        swapped in, in a shrunk job)."""
        h = self._host
        reg = h.reg
        rank = h.rank if rank is None else rank
        sharded = reg.layout.params_sharded  # every rank writes its own shards; no rank holds the whole model
        model_sd = _model_sd(reg)
        keep = list(model_sd) if rank == 0 and not sharded else list(reg.buffer_names)
        sections: dict[str, Any] = {"local": {k: v.state_dict() for k, v in reg.local.items()}}
        if rank == 0:
            if reg.optimizer is not None and not reg.layout.optimizer_sharded:
                sections["optimizer"] = reg.optimizer.state_dict()
            sections["boundary"] = {"extra": {k: v.state_dict() for k, v in reg.extra.items()},
                                    "hparams": reg.hparams()}  # fmt: skip
        sections.update(h.strategy.parts.checkpoint_part(rank))  # shards: a carried rank's, its carrier owns it
        skeletons: dict[str, Any] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        old = self._staged.get(rank, {})
        staged: dict[str, torch.Tensor] = {}
        model: dict[str, torch.Tensor] = {}
        others: dict[str, Any] = {}
        for k in keep:
            v = model_sd[k]
            if isinstance(v, torch.Tensor):
                key = f"model.{k}"
                model[k] = staged[key] = _stage(v, old.get(key))
            else:
                others[k] = v
        for name, obj in sections.items():
            tensors: list[torch.Tensor] = []
            skeletons[name] = flatten(obj, tensors, name)
            state[name] = {}
            for i, t in enumerate(tensors):
                key = f"state.{name}.{i}"
                state[name][str(i)] = staged[key] = _stage(t, old.get(key))
        self._staged = {r: v for r, v in self._staged.items() if r in (h.rank, *h.virtual.carried())}
        self._staged[rank] = staged
        meta = {"format": layout.FORMAT, "step": step, "rank": rank, "world": h.world_size,
                "signature": signature_hash(h.signature()), "skeletons": skeletons,
                "model_other": flatten(others, [], "model")}  # fmt: skip
        blob = msgpack.packb(meta, use_bin_type=True)
        return {"model": model, "state": state, "meta": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}

    def _writer(self) -> None:
        import warnings

        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")

        h = self._host
        while True:
            step, parts, rec = self._queue.get()
            t0 = time.monotonic()
            s = self.settings
            assert s is not None
            try:
                sig = h.signature()
                meta = {"signature": signature_hash(sig), "job": os.environ.get("LIVEMIG_JOB", ""),
                        "signature_any_layout": signature_hash(h.strategy.parts.portable_signature(sig)),
                        "layout": h.strategy.parts.layout_record()}  # fmt: skip
                for rank, sd in parts:  # one, or the ranks a shrunk job's carrier holds
                    part = layout.part_dir(s.dir, step, rank)
                    os.makedirs(part, exist_ok=True)
                    writer = dcp.FileSystemWriter(part, single_file_per_rank=True, sync_files=True)
                    dcp.save(sd, storage_writer=writer, no_dist=True)
                    if self._fail_at == (rank, step):
                        raise OSError(f"test hook {layout.ENV_FAIL_WRITE}: the write of step {step} fails")
                    h.faults.during_checkpoint(step)  # the plan's kill:...:during=checkpoint lands here
                    layout.fsync_dir(part)
                    layout.mark_done(s.dir, step, rank, {"world": h.world_size})
                    if layout.publish_if_complete(s.dir, step, h.world_size, meta, s.keep):
                        log.info("checkpoint complete", extra={"step": step, "dir": layout.step_dir(s.dir, step)})
                rec[3], rec[4] = round(time.monotonic() - t0, 6), True
            except Exception as exc:
                rec[3], rec[4] = round(time.monotonic() - t0, 6), False
                self._failed(step, rec[1], rec[2], exc, counted=True)
            finally:
                self._idle.set()

    def _failed(self, step: int, at: float, staged_s: float, exc: BaseException, counted: bool = False) -> None:
        self.failed += 1
        if not counted:
            self.records.append([step, at, staged_s, None, False, 0.0])
        log.warning(f"checkpoint of step {step} failed on rank {self._host.rank}: {exc}; training goes on "
                    "(the previous checkpoint stays the newest)",
                    extra={"step": step, "failed": self.failed})  # fmt: skip

    def load(self, step_root: str) -> tuple[int, int]:
        """This rank's boundary state from the complete checkpoint at `step_root` (`load` below)."""
        return load(self._host, step_root)

    def wait(self, timeout: float | None = None) -> None:
        """The last write finished (or `timeout` passed): a process that ends with a write in
        flight would leave its part half-written."""
        self._idle.wait(self.timeout if timeout is None else timeout)

    def final(self) -> dict[str, Any]:
        """The final record's entry (the run report counts failed checkpoints)."""
        return {"records": self.records, "failed": self.failed, "resumed": self.resumed}

    # -- loading ------------------------------------------------------------------------
    def resume(self) -> int | None:
        """Load this rank's state from the checkpoint `livemig run --resume-from` chose
        (LIVEMIG_RESUME_PATH); the step it holds, or None when there is none."""
        if not self.resume_path:
            return None
        step, resharded = load(self._host, self.resume_path)
        self.resumed = step
        s = self.settings
        root = os.path.dirname(self.resume_path.rstrip("/"))
        self._converted = (resharded and s is not None
                           and os.path.realpath(s.dir) != os.path.realpath(root))  # fmt: skip
        return step


def read_part(part: str, want_model: dict[str, torch.Tensor], sections: list[str]) -> tuple[dict, dict]:
    """Load `want_model` in place from the part at `part`, and the named sections (allocated
    from the part's metadata); (meta, {section: object})."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(part)
    md = reader.read_metadata().state_dict_metadata
    meta_md = md.get("meta")
    if not isinstance(meta_md, TensorStorageMetadata):
        raise ConfigError(f"{part} is not a livemig checkpoint part (no meta entry)")
    sd: dict[str, Any] = {"meta": torch.empty(meta_md.size, dtype=torch.uint8), "state": {}}
    if want_model:
        sd["model"] = want_model
    for name in sections:
        prefix = f"state.{name}."
        keys = [k for k in md if k.startswith(prefix)]
        sd["state"][name] = {}
        for k in keys:
            m = md[k]
            assert isinstance(m, TensorStorageMetadata)
            sd["state"][name][k[len(prefix) :]] = torch.empty(m.size, dtype=m.properties.dtype)
    if not sd["state"]:
        del sd["state"]
    dcp.load(sd, storage_reader=reader, no_dist=True)
    meta = msgpack.unpackb(sd["meta"].numpy().tobytes(), raw=False, strict_map_key=False)
    out = {}
    for name in sections:
        tens = sd.get("state", {}).get(name, {})
        out[name] = unflatten(meta["skeletons"][name], [tens[str(i)] for i in range(len(tens))])
    return meta, out


def load(h: CheckpointHost, step_root: str) -> tuple[int, bool]:
    """This rank's boundary state from a complete checkpoint: the replicated state from rank
    0's part (any world size); the sharded state (ZeRO-1 optimizer shards, FSDP2 parameter
    and optimizer shards) from the parts of the same ranks, or, at another world size or
    mesh, cut from all of them; rank-local state from the same rank's part (at another world
    size refused with one line: no rule maps it). Returns the step and whether the state was
    re-cut (a new layout: written again at once into a new --checkpoint-dir)."""
    reg = h.reg
    root, name = os.path.split(step_root.rstrip("/"))
    step = int(name.removeprefix("step_"))
    man = layout.read_manifest(root, step)
    world = int(man["world"])
    parts = h.strategy.parts
    # a checkpoint from before the layout record was written resumes at its own world size only
    reshard = world != h.world_size or ("layout" in man and man["layout"] != parts.layout_record())
    if reshard:
        parts.check_resume_world(step_root, world, man)
    if reshard and "signature_any_layout" in man:
        same = man["signature_any_layout"] == signature_hash(parts.portable_signature(h.signature()))
    else:
        same = man.get("signature") in (None, signature_hash(h.signature()))
    if not same:
        raise ConfigError(f"checkpoint {step_root} was written by a script whose registered state differs "
                          "(another model or optimizer): resume it with the script that wrote it")  # fmt: skip
    if reshard and reg.has_local:
        raise ConfigError(f"checkpoint {step_root} holds rank-local state (model buffers, local=) of {world} "
                          f"ranks laid out as {man.get('layout') or 'they were'}; this run has {h.world_size} "
                          f"laid out as {parts.layout_record() or 'its own'}, and rank-local state has no rule "
                          f"to map it to another layout: resume it with --nproc {world} and the same "
                          "layout")  # fmt: skip
    model_sd = _model_sd(reg)
    buffers = set(reg.buffer_names)
    sharded = reg.layout.params_sharded  # its parameters (DTensors) come from this rank's own part, below
    params = {} if sharded else {k: v for k, v in model_sd.items() if k not in buffers and isinstance(v, torch.Tensor)}
    own_buffers = {k: v for k, v in model_sd.items() if k in buffers and isinstance(v, torch.Tensor)}
    with torch.no_grad():
        zero = [params | (own_buffers if h.rank == 0 or reshard else {})]
        whole_opt = reg.optimizer is not None and not reg.layout.optimizer_sharded
        sections = ["boundary"] + (["optimizer"] if whole_opt else [])
        _, got = read_part(layout.part_dir(root, step, 0), zero[0], sections)
        if whole_opt:
            reg.optimizer.load_state_dict(got["optimizer"])
        reg.load_boundary(got["boundary"])

        def section_of(r: int, name: str) -> Any:
            """Section `name` of rank r's part: the shards a strategy mirrors or re-splits."""
            return read_part(layout.part_dir(root, step, r), {}, [name])[1][name]

        if not reshard:
            own = ["local", *parts.sections]
            _, mine = read_part(layout.part_dir(root, step, h.rank), own_buffers if h.rank else {}, own)
            for k, v in reg.local.items():
                v.load_state_dict(mine["local"][k])
            parts.load_checkpoint_part(mine, section_of)  # its shards, and those it mirrors
        else:
            parts.load_resharded(world, section_of)  # the shards re-cut for this world size and layout
    log.info("state loaded from a checkpoint", extra={"step": step, "dir": step_root, "rank": h.rank,
                                                       "written_by_ranks": world, "resharded": reshard})  # fmt: skip
    return step, reshard
