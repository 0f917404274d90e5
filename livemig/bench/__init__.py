"""Benchmarks run by `livemig bench ...`; each prints figures measured side by side."""

from __future__ import annotations

import os


def proc_run_s(pid: int) -> float:
    """Seconds a process's live threads have run on a CPU, from each one's schedstat (in ns:
    /proc/<pid>/stat counts in 10 ms ticks, too coarse for a 20 ms recovery)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used, from /proc (a zombie
    not reaped yet still has its own)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
