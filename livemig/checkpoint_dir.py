"""The checkpoint directory: its layout, completeness, publication and retention.

No torch here: the agent (which picks the checkpoint a run resumes from) and the
coordinator (which decides whether the cold path has something to restart from) read
the same layout as the members that write it (runtime/checkpoint.py).

    DIR/latest                         "step_0000000049": the newest complete checkpoint (a rename)
    DIR/step_0000000049/rank_00000/    rank 0's part: a torch.distributed.checkpoint directory
    DIR/step_0000000049/rank_00000.done  written once that part is durable: its files' sizes and BLAKE3
    DIR/step_0000000049/manifest.json  written once every part is done: the checkpoint is complete
    DIR/finished.json                  {"job", "steps", "time"}: a job that ran to its end (no auto-resume)

A checkpoint is complete when its manifest exists and every part it names matches its
marker: a crash while writing leaves a step directory without a manifest, which is never
loaded, and `latest` still names the previous one. Publication is done by whichever
rank's writer finds every marker present after writing its own (each writes its marker
before looking, so the last one to finish always sees them all).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

from livemig.config import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_EVERY,
    ENV_CHECKPOINT_FAIL_WRITE,
    ENV_CHECKPOINT_INTERVAL,
    ENV_CHECKPOINT_KEEP,
    ENV_CHECKPOINT_PROBE,
    ENV_CHECKPOINT_WRITE_TIMEOUT,
    ENV_RESUME_PATH,
)
from livemig.errors import ConfigError, LivemigError

log = logging.getLogger("livemig.checkpoint_dir")

FORMAT = 1  # bumped only on an incompatible change of the layout or the parts' contents
LATEST = "latest"
MANIFEST = "manifest.json"
FINISHED = "finished.json"  # the last job that ran to its end with this directory (mark_finished)
_STEP = re.compile(r"^step_(\d{10})$")
ENV_DIR, ENV_EVERY, ENV_KEEP = ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_EVERY, ENV_CHECKPOINT_KEEP
ENV_RESUME, ENV_WRITE_TIMEOUT, ENV_FAIL_WRITE = ENV_RESUME_PATH, ENV_CHECKPOINT_WRITE_TIMEOUT, ENV_CHECKPOINT_FAIL_WRITE
ENV_INTERVAL, ENV_PROBE = ENV_CHECKPOINT_INTERVAL, ENV_CHECKPOINT_PROBE
DEFAULT_KEEP = 2
DEFAULT_PROBE = 10


class CheckpointError(LivemigError):
    """A checkpoint that cannot be used (incomplete, corrupt, another job's): one line naming it."""


class FormatError(CheckpointError):
    """A checkpoint of another format version: refused, not skipped (an older one in the same
    directory would be no better, and silently resuming from it would lose the newer steps)."""


@dataclass(frozen=True)
class Settings:
    """What a member checkpoints: set by `livemig run` (its environment), else by the script
    (`ctx.checkpoints`). Every `every` steps, or every `interval` seconds: then the ranks agree
    every `probe` steps whether one is due (runtime/checkpoint.py), so all write the same step."""

    dir: str
    every: int = 0
    keep: int = DEFAULT_KEEP
    interval: float = 0.0
    probe: int = DEFAULT_PROBE

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError("checkpoints need a directory (--checkpoint-dir DIR)")
        if (self.every > 0) == (self.interval > 0):
            raise ConfigError("checkpoints: give one of --checkpoint-every N (steps) or --checkpoint-interval "
                              f"SECONDS (got every={self.every}, interval={self.interval:g})")  # fmt: skip
        if self.every < 0 or self.interval < 0 or self.keep < 1 or self.probe < 1:
            raise ConfigError(f"checkpoints: every={self.every}, interval={self.interval:g}, keep={self.keep}, "
                              f"probe={self.probe}: expected every/interval >= 0, keep and probe >= 1")  # fmt: skip

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings | None:
        env = dict(os.environ if env is None else env)
        root = env.get(ENV_DIR, "")
        if not root:
            return None
        raw = env.get(ENV_INTERVAL, "")
        try:
            interval = float(raw) if raw else 0.0
        except ValueError:
            raise ConfigError(f"--checkpoint-interval {raw!r}: expected seconds") from None
        return cls(root, _positive(env.get(ENV_EVERY, ""), "--checkpoint-every", 0),
                   _positive(env.get(ENV_KEEP, ""), "--checkpoint-keep", DEFAULT_KEEP), interval,
                   _probe(env))  # fmt: skip

    @classmethod
    def from_script(cls, root: str, every: int | None, interval: float | None, keep: int) -> Settings:
        """ctx.checkpoints(...): the script's settings, the probe period still from the environment."""
        return cls(os.path.abspath(root), every or 0, keep, float(interval or 0.0), _probe(dict(os.environ)))

    def to_env(self) -> dict[str, str]:
        return {ENV_DIR: self.dir, ENV_EVERY: str(self.every) if self.every else "", ENV_KEEP: str(self.keep),
                ENV_INTERVAL: f"{self.interval:g}" if self.interval else "", ENV_PROBE: str(self.probe)}  # fmt: skip

    def due(self, step: int) -> bool:
        """Is the boundary of `step` checkpointed? Every `every` steps: after steps every-1,
        2*every-1, ... (so --checkpoint-every 5 over 20 steps saves the boundaries 4, 9, 14, 19)."""
        return self.every > 0 and (step + 1) % self.every == 0

    def probes(self, step: int) -> bool:
        """With an interval: is the boundary of `step` one where the ranks agree on a checkpoint?"""
        return self.interval > 0 and (step + 1) % self.probe == 0


def run_checkpoint_env(run: dict[str, Any]) -> dict[str, str]:
    """The checkpoint settings a run record carries (agent/nodes.join_run), as the environment
    of a process that joins the run from elsewhere (`livemig-spare start`): only the settings'
    own names, and only if they make valid settings; else none, said once."""
    raw = run.get("checkpoint")
    if not isinstance(raw, dict):
        return {}
    names = {ENV_DIR, ENV_EVERY, ENV_KEEP, ENV_INTERVAL, ENV_PROBE}
    env = {k: v for k, v in raw.items() if k in names and isinstance(v, str)}
    try:
        Settings.from_env(env)
    except ConfigError as exc:
        log.warning(f"the run's checkpoint settings are not usable here ({exc}): this process writes none")
        return {}
    return env


def _probe(env: dict[str, str]) -> int:
    return _positive(env.get(ENV_PROBE, ""), ENV_PROBE, DEFAULT_PROBE)


def _positive(raw: str, flag: str, default: int) -> int:
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(f"{flag} {raw!r}: expected a whole number") from None
    if n < 1:
        raise ConfigError(f"{flag} {n}: expected 1 or more")
    return n


def step_name(step: int) -> str:
    return f"step_{step:010d}"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def part_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def part_dir(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), part_name(rank))


def done_path(root: str, step: int, rank: int) -> str:
    return part_dir(root, step, rank) + ".done"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Written, fsynced, renamed into place, the directory fsynced: a reader sees the old
    file or the whole new one, also after a power loss."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def hash_files(directory: str) -> dict[str, list]:
    """{file name: [size, BLAKE3 hex]} of a part's files, read back after they were fsynced
    (from the page cache, at memory speed)."""
    import blake3

    out: dict[str, list] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        h = blake3.blake3()
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                size += len(chunk)
        out[name] = [size, h.hexdigest()]
    return out


def mark_done(root: str, step: int, rank: int, info: dict[str, Any]) -> None:
    files = hash_files(part_dir(root, step, rank))
    body = {"format": FORMAT, "rank": rank, "step": step, "files": files, **info}
    write_atomic(done_path(root, step, rank), json.dumps(body, sort_keys=True).encode())


def publish_if_complete(root: str, step: int, world: int, meta: dict[str, Any], keep: int) -> bool:
    """Every rank's part is durable: write the manifest, point `latest` at it, prune. Safe
    to run by two writers at once (the same bytes, each written by rename)."""
    parts = []
    for r in range(world):
        try:
            with open(done_path(root, step, r), "rb") as f:
                parts.append(json.loads(f.read()))
        except FileNotFoundError:
            return False
    manifest = {"format": FORMAT, "step": step, "world": world, "time": time.time(), "parts": parts, **meta}
    write_atomic(os.path.join(step_dir(root, step), MANIFEST), json.dumps(manifest, sort_keys=True).encode())
    latest = newest_step(root)
    if latest is None or latest <= step:
        write_atomic(os.path.join(root, LATEST), step_name(step).encode())
    prune(root, keep)
    return True


def steps_in(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := _STEP.match(n))), reverse=True)


def read_manifest(root: str, step: int) -> dict[str, Any]:
    path = os.path.join(step_dir(root, step), MANIFEST)
    try:
        with open(path, "rb") as f:
            man = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {step_dir(root, step)} is incomplete (no {MANIFEST})") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {step_dir(root, step)}: unreadable {MANIFEST} ({exc})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        got = man.get("format") if isinstance(man, dict) else None
        raise FormatError(f"checkpoint {step_dir(root, step)} has format {got}, this livemig reads {FORMAT}: "
                          "resume it with the livemig version that wrote it")  # fmt: skip
    return man


def newest_step(root: str) -> int | None:
    """The step `latest` names (None: no complete checkpoint was ever published here)."""
    try:
        with open(os.path.join(root, LATEST), "rb") as f:
            m = _STEP.match(f.read().decode(errors="replace").strip())
    except FileNotFoundError:
        return None
    return int(m.group(1)) if m else None


def verify(root: str, step: int, deep: bool = True) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint, or CheckpointError naming what is wrong.
    deep: every file's BLAKE3 is checked against its marker (a truncated or flipped byte is
    caught here, before torch.distributed.checkpoint reads its metadata)."""
    man = read_manifest(root, step)
    for part in man["parts"]:
        d = part_dir(root, step, int(part["rank"]))
        for name, (size, _) in part["files"].items():
            path = os.path.join(d, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {step_dir(root, step)}: {path} is missing") from None
            if st.st_size != size:
                raise CheckpointError(f"checkpoint {step_dir(root, step)}: {path} has {st.st_size} bytes, "
                                      f"{size} were written")  # fmt: skip
        if deep:
            got = hash_files(d)
            if {k: v[1] for k, v in got.items() if k in part["files"]} != {k: v[1] for k, v in part["files"].items()}:
                raise CheckpointError(f"checkpoint {step_dir(root, step)}: rank {part['rank']}'s part is corrupt "
                                      "(its files' BLAKE3 differ from what was written)")  # fmt: skip
    return man


def choose(root: str, signature: str | None = None, deep: bool = True) -> tuple[int, dict[str, Any]] | None:
    """The newest usable checkpoint in `root` (its step and manifest), skipping each that is
    incomplete or corrupt with one line naming it; None if there is none. A checkpoint of
    another script signature or format version is refused, not skipped (resuming from it
    would be a mistake of the command, not damage)."""
    if not os.path.isdir(root):
        return None
    for step in steps_in(root):
        try:
            man = verify(root, step, deep)
        except FormatError:
            raise
        except CheckpointError as exc:
            log.warning(f"skipping {exc}", extra={"step": step})
            continue
        if signature is not None and man.get("signature") not in (None, signature):
            raise CheckpointError(
                f"checkpoint {step_dir(root, step)} was written by a script whose registered state differs "
                "(another model or optimizer): resume it with the script that wrote it, or use another directory"
            )
        return step, man
    return None


def mark_finished(root: str, job: str, steps: int) -> None:
    """Job `job` ran to its end: a later run of it with this directory starts afresh instead
    of resuming from a checkpoint it went past (`resumable`). A directory that cannot be
    written (its checkpoints failed too, and were counted) holds no checkpoint to resume: a
    line in the log, never a failure of a job that finished."""
    try:
        os.makedirs(root, exist_ok=True)
        write_atomic(os.path.join(root, FINISHED), json.dumps({"job": job, "steps": steps,
                                                               "time": time.time()}).encode())  # fmt: skip
    except OSError as exc:
        log.warning(f"could not mark {root} finished: {exc}", extra={"job": job})


def resumable(root: str, job: str) -> tuple[int, dict[str, Any]] | None:
    """--checkpoint-dir's automatic resume: the newest complete checkpoint in `root` that a
    job named `job` wrote, unless a job of that name finished after writing it. A job stopped
    at a checkpoint (runtime/stop.py), requeued, preempted or killed whole goes on from where
    it was; a finished one run again, or another job sharing the directory, starts afresh."""
    got = choose(root)
    if got is None or got[1].get("job") != job:
        return None
    try:
        with open(os.path.join(root, FINISHED)) as f:
            fin = json.load(f)
    except (OSError, ValueError):
        fin = None
    if isinstance(fin, dict) and fin.get("job") == job and float(fin.get("time", 0)) >= float(got[1].get("time", 0)):
        return None
    return got


def prune(root: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and incomplete ones older
    than the newest complete (a write that failed or was cut short). Newer incomplete ones are
    writes in progress: left alone."""
    complete = [s for s in steps_in(root) if os.path.exists(os.path.join(step_dir(root, s), MANIFEST))]
    if not complete:
        return
    kept = set(complete[:keep])
    for s in steps_in(root):
        if s in kept or s > complete[0]:
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(step_dir(root, s))
