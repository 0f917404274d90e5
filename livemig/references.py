"""Fault-free reference runs, shared: the one cache behind the tests and the benches.

A recovery is judged against the run that had no fault: same script, arguments,
world size and settings. Running that reference once per caller (a test, a bench
case) was most of the reference cost of the suite; `References` runs it once per key
for its own lifetime (a pytest session, one `livemig bench` invocation) and hands the
same report to every caller that asks for that key.

The key is the world size, the script's absolute path, the arguments, every
LIVEMIG_* setting the run would see (the caller's environment overlaid with its
`env`) except LIVEMIG_STATE_DIR, which says where files go, not what is computed, and
the caller's other `env` entries. Two callers that differ in any of those never share
a run. A caller that needs the ranks' own output files writes `{out}` in an argument
or an env value: each reference run gets its own directory there (the key holds the
placeholder, not the directory), returned as `Reference.out`.

The store is on disk under `root`, one directory per key (named by the key's hash),
guarded by an flock: several processes that share `root` (pytest-xdist's workers, two
benches) make one run per key between them, and the second finds the first's report.
A failed run leaves nothing behind, so the next caller tries again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.config import ENV_STATE_DIR

OUT = "{out}"


@dataclass(frozen=True)
class Reference:
    """One fault-free run: its report (state_digest, rank_digests, ...) and, if the
    caller asked for one with {out}, the directory its ranks wrote into."""

    report: dict[str, Any]
    out: Path | None

    @property
    def digest(self) -> str:
        return self.report["state_digest"]


class ReferenceFailed(RuntimeError):
    """The fault-free run itself did not finish: nothing to compare against."""


class References:
    """Runs each fault-free reference once (keyed as the module says) under `root`."""

    # lease_ttl: a fault-free run has nothing to detect, and a loaded machine (CI at ~2x load)
    # let a 2 s lease expire mid-reference once, fencing a healthy worker; the TTL changes no state
    def __init__(self, root: str | os.PathLike, lease_ttl: float = 10.0, timeout_s: float = 300.0) -> None:
        self.root = Path(root)
        self.lease_ttl = lease_ttl
        self.timeout_s = timeout_s
        self._cache: dict[tuple, Reference] = {}
        self._lock = threading.Lock()
        self.runs = 0  # how many reference runs this cache made (the rest were hits)

    @staticmethod
    def key(nproc: int, script: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> tuple:
        seen = {**os.environ, **(env or {})}
        settings = {k: v for k, v in seen.items() if k.startswith("LIVEMIG_") and k != ENV_STATE_DIR}
        others = {k: v for k, v in (env or {}).items() if not k.startswith("LIVEMIG_")}
        return (nproc, os.path.abspath(script), tuple(args), tuple(sorted(settings.items())),
                tuple(sorted(others.items())))  # fmt: skip

    def get(self, nproc: int, script: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Reference:
        """The reference of this key, run now if no earlier caller (in this process or
        another one sharing `root`) ran it. Raises ReferenceFailed (with the run's output
        tail) if it did not complete."""
        key = self.key(nproc, script, args, env)
        with self._lock:  # one run per key, also for callers on several threads
            if key not in self._cache:
                self._cache[key] = self._stored(key, nproc, script, list(args), dict(env or {}))
            return self._cache[key]

    def _stored(self, key: tuple, nproc: int, script: str, args: list[str], env: dict[str, str]) -> Reference:
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while the run is made: the other callers wait for it
            where = self.root / name
            stored = where / "reference.json"
            if stored.exists():
                rec = json.loads(stored.read_text())
                return Reference(rec["report"], Path(rec["out"]) if rec["out"] else None)
            ref = self._run(where, name, nproc, script, args, env)
            tmp = where / "reference.json.tmp"
            tmp.write_text(json.dumps({"report": ref.report, "out": str(ref.out) if ref.out else None}))
            os.replace(tmp, stored)
            return ref
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def _run(self, where: Path, name: str, nproc: int, script: str, args: list[str], env: dict[str, str]) -> Reference:
        self.runs += 1
        if where.exists():  # a run that failed before left its files: start clean
            shutil.rmtree(where)
        where.mkdir(parents=True)
        out = None
        if any(OUT in a for a in args) or any(OUT in v for v in env.values()):
            out = where / "out"
            out.mkdir()
            args = [a.replace(OUT, str(out)) for a in args]
            env = {k: v.replace(OUT, str(out)) for k, v in env.items()}
        report = where / "report.json"
        job = f"ref-{name[:8]}"
        cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", str(nproc), "--job", job,
               "--report", str(report), "--lease-ttl", str(self.lease_ttl), script, *args]  # fmt: skip
        full_env = {**os.environ, ENV_STATE_DIR: str(where), **env}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=full_env)
        rep = json.loads(report.read_text()) if report.exists() else {}
        steps = int(args[args.index("--steps") + 1]) if "--steps" in args else None
        ok = (p.returncode == 0 and (rep.get("result") or {}).get("state") == "done" and rep.get("replicas_identical")
              and (steps is None or rep.get("steps_completed") == steps))  # fmt: skip
        if not ok:
            raise ReferenceFailed(f"the fault-free reference ({nproc} workers, {script} {' '.join(args)}) did not "
                                  f"complete (exit {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")  # fmt: skip
        return Reference(rep, out)
