"""Benchmarks run by `livemig bench ...`; each prints figures measured side by side."""

from __future__ import annotations

import os


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used, from /proc (a zombie
    not reaped yet still has its own)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
