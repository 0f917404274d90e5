"""`livemig bench downtime` and `overhead` by `--sharding`: fsdp2 has its own workload and
baseline (bench/fsdp2_bench.py); none and zero1 are bench/downtime_bench.py's."""

from __future__ import annotations

import argparse

from livemig.bench import downtime_bench, follow_bench, fsdp2_bench
from livemig.bench.downtime_bench import add_downtime_arguments, add_overhead_arguments

__all__ = ["add_downtime_arguments", "add_overhead_arguments", "run_downtime", "run_overhead"]


def run_downtime(a: argparse.Namespace) -> int:
    if getattr(a, "follow", False):  # follow spares against plain warm spares (bench/follow_bench.py)
        return follow_bench.run_follow(a)
    return (fsdp2_bench if a.sharding == "fsdp2" else downtime_bench).run_downtime(a)


def run_overhead(a: argparse.Namespace) -> int:
    return (fsdp2_bench if a.sharding == "fsdp2" else downtime_bench).run_overhead(a)
