"""Logging set-up: one line per record, with the `extra=` fields appended
as key=value so a timeline can be rebuilt from the logs."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from livemig.config import ENV_LOG_LEVEL

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STD}
        if extras:
            base += " " + " ".join(f"{k}={v}" for k, v in sorted(extras.items()))
        return base


def stacks_on_sigquit() -> None:
    """`kill -QUIT <pid>` of an agent prints every thread's Python stack to its stderr and the
    agent goes on: how to see where a process that should have exited waits (an agent once
    stayed after its job ended, under load; Slurm then kept the job RUNNING)."""
    import faulthandler
    import signal

    sig = getattr(signal, "SIGQUIT", None)
    if sig is not None:
        faulthandler.register(sig, all_threads=True, chain=False)


def say(*lines: str, file: TextIO | None = None) -> None:
    """Print whole lines in one write. Several agents of a job (srun's tasks, spares of one
    node) often share one stdout pipe, and Python unbuffered (PYTHONUNBUFFERED, common in
    containers) writes print()'s text and its newline separately: another process's line
    could land between them. One write below PIPE_BUF (4 KiB) is never split by a pipe."""
    out = file or sys.stdout
    out.write("".join(line + "\n" for line in lines))
    out.flush()


def setup(level: str | None = None, role: str = "") -> None:
    level = level or os.environ.get(ENV_LOG_LEVEL, "WARNING")
    handler = logging.StreamHandler(sys.stderr)
    tag = f" [{role}]" if role else ""
    handler.setFormatter(
        KeyValueFormatter(f"%(asctime)s.%(msecs)03d %(levelname)s %(name)s{tag}: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("livemig")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
