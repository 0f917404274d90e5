"""Logging set-up: one line per record, with the `extra=` fields appended
as key=value so a timeline can be rebuilt from the logs."""

from __future__ import annotations

import logging
import os
import sys

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STD}
        if extras:
            base += " " + " ".join(f"{k}={v}" for k, v in sorted(extras.items()))
        return base


def setup(level: str | None = None, role: str = "") -> None:
    level = level or os.environ.get("LIVEMIG_LOG_LEVEL", "WARNING")
    handler = logging.StreamHandler(sys.stderr)
    tag = f" [{role}]" if role else ""
    handler.setFormatter(
        KeyValueFormatter(f"%(asctime)s.%(msecs)03d %(levelname)s %(name)s{tag}: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("livemig")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
