"""One rank that switches process groups N times, as a member does at each generation
change (build the new group, use it, retire the old), printing its open file descriptors
after each switch as a JSON list. Used by tests/unit/test_group_fds.py."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch

from livemig.comm import group
from livemig.comm.group import build_group, retire


def main() -> None:
    rank, world, store, switches = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    idle = sys.argv[5] == "idle"
    timeout = timedelta(seconds=20)
    pg, fds = None, []
    for gen in range(1, switches + 1):
        new = build_group(store, gen, rank, world, timeout)
        t = torch.ones(1000)
        new.allreduce([t]).wait()
        assert t[0].item() == world
        retire(pg, idle=idle, timeout=timeout)
        pg = new
        fds.append(len(os.listdir("/proc/self/fd")))
    graveyard = len(group._GRAVEYARD)  # what retire() kept for the exit-time collection (no API: tests only)
    print(json.dumps({"fds": fds, "graveyard": graveyard}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
