"""Shrink, the coordinator's side: when a job with too few warm spares trains on its survivors
(`livemig run --min-nproc M`), who carries which lost rank, and which carried rank a returning
spare takes back. Decisions only (no etcd, no torch); the coordinator commits them. The
mechanics are in runtime/virtual.py and, for ZeRO-1's shards, comm/zero1.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from livemig.config import shrink_settings, zero1_layout
from livemig.rdzv.membership import Membership


@dataclass(frozen=True)
class Decision:
    """What a recovery with `picks` warm spares for more lost ranks does now: "wait" (within
    --shrink-wait), "shrink" (the spares take the lowest lost ranks, `carry` the rest), or "no"
    (`why`: the job cannot shrink; it waits for spares, the cold path or fails as without it)."""

    action: str
    carry: list[int]
    why: str = ""


class ShrinkPolicy:
    """Owned by the Coordinator: --min-nproc and --shrink-wait (LIVEMIG_MIN_NPROC, LIVEMIG_SHRINK_WAIT)."""

    def __init__(self, world_size: int) -> None:
        self.min_nproc, self.wait_s = shrink_settings(world_size)

    def decide(self, m: Membership, vacant: list[int], picks: int, mode: str, waited: float) -> Decision:
        if self.min_nproc >= m.world_size:
            return Decision("no", [])  # the default: no shrink, nothing to say
        if mode == "fsdp2":
            return Decision("no", [], f"shrinking a sharding={mode} job is not supported yet")
        if len(m.members) + picks < self.min_nproc:
            return Decision("no", [], f"{len(m.members)} survivor(s) are fewer than --min-nproc {self.min_nproc}")
        if waited <= self.wait_s:
            return Decision("wait", [])
        return Decision("shrink", vacant[picks:])

    @staticmethod
    def carriers(m: Membership, vacant: list[int], stride: int, mode: str) -> dict[int, int]:
        """The carried map once `vacant` is carried: each by its buddy (rank + stride, its local
        state's mirror), with ZeRO-1 by the holder of its shard's mirror (which then owns the
        shard), else the next survivor; ranks already carried keep a live carrier."""
        n = m.world_size
        carried = {v: c for v, c in m.carried.items() if c in m.members}
        layout = zero1_layout(n, m.carried, stride) if mode == "zero1" else {}
        for v in vacant:
            mirror = layout[v][1] if v in layout else None
            c = mirror if mirror is not None and mirror in m.members else (v + stride) % n
            while c not in m.members:
                c = (c + 1) % n
            carried[v] = c
        return carried

    @staticmethod
    def grow(m: Membership) -> tuple[int, dict[int, int]]:
        """A warm spare while shrunk takes back the lowest carried rank: (that rank, the carried
        map without it)."""
        v = min(m.carried)
        return v, {r: c for r, c in m.carried.items() if r != v}
