"""Bugs are not node failures (docs/reliability.md).

An exception raised by the training function (or a livemig ConfigError: a
misuse the same code repeats on every rank) is not a lost node: a spare
would replay it. The member records it in etcd (`errors/<incarnation>`: rank,
step, the error, the traceback) and exits with USER_ERROR; the coordinator
then ends the job at once, naming the rank and the step, and no spare is
consumed. `livemig run --on-error replace:N` (LIVEMIG_ON_ERROR) keeps
recovering on a spare instead, at most N times. A spare whose warm-up raises
writes nothing: it only leaves the pool.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

from livemig.config import Role
from livemig.errors import ConfigError

log = logging.getLogger("livemig.runtime.bugs")

USER_ERROR = 5  # exit code of a member that hit a bug (launcher and coordinator know it)


def exit_on_bug(ctx: Any, exc: BaseException) -> None:
    """Print the error; a member records it for the coordinator and exits with USER_ERROR."""
    one_line = f"{type(exc).__name__}: {exc}"
    tb = one_line if isinstance(exc, ConfigError) else "".join(traceback.format_exception(exc)).rstrip()
    print(f"livemig: error: {one_line}" if isinstance(exc, ConfigError) else tb, file=sys.stderr, flush=True)
    rt = getattr(ctx, "runtime", None)
    member = ctx is not None and (ctx.role == Role.WORKER or getattr(ctx, "joining", None) is not None)
    if not member:  # a spare in standby (refused, or its warm-up raised): it only leaves the pool
        os._exit(getattr(exc, "exit_code", 1))
    if rt is not None and not rt.fenced.is_set():
        try:
            rt.put(rt.keys.error(ctx.incarnation), {
                "rank": ctx.rank, "step": ctx.current, "incarnation": ctx.incarnation, "error": one_line[:500],
                "time": time.time(), "misuse": isinstance(exc, ConfigError),
                "traceback": tb[-4000:]})  # fmt: skip
        except Exception:  # noqa: BLE001 - etcd gone or fenced: the process exit still reports it
            log.warning("could not record the error in etcd", exc_info=True)
    os._exit(USER_ERROR)
