"""Failure messages for process-level tests: the tail of every process's log."""

from __future__ import annotations


def process_logs(report: dict, lines: int) -> list[str]:
    out = []
    for p in report.get("processes", []):
        try:
            with open(p["log"]) as f:
                out.append(f"--- {p['name']} (exit {p['exit_code']})\n" + "".join(f.readlines()[-lines:]))
        except OSError:
            pass
    return out
