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
