"""The names of the items a member's state server serves: the one place that builds them,
as rdzv/keys.py is for etcd keys. A requester and a server agree on a name and nothing
else, so a name built twice is a protocol written twice."""

from __future__ import annotations

import re

STATE = "state"  # a recovery: the registered state, at the boundary the group commits next
AVG = "avg"  # a recovery: the averaged gradient of the step being redone
SNAPSHOT = "snapshot"  # a planned migration: the leaving worker's state, the spare's start

UPDATES = "updates"  # a planned migration onto a current follower: the leaving worker's updates, no snapshot

_SNAPSHOT_RE = re.compile(r"snapshot(/\d{1,6})?")


def snapshot(resync: int = 0) -> str:
    """A migration's snapshot; a newer one ("snapshot/k") when the spare fell behind k times."""
    return SNAPSHOT if resync == 0 else f"{SNAPSHOT}/{resync}"


def is_snapshot(item: str) -> bool:
    return _SNAPSHOT_RE.fullmatch(item) is not None


def final_snapshot() -> str:
    """The leaving worker's state after the switch step, served while it waits for its spare:
    a spare that fell behind after the switch was voted loads it instead of the updates."""
    return f"{SNAPSHOT}/final"


def step_avg(step: int) -> str:
    """The update of step `step`, served to a migrating spare catching up."""
    return f"avg/{step}"


def step_of_avg(item: str) -> int | None:
    """The step of a step_avg name, None for any other name."""
    head, _, step = item.partition("/")
    return int(step) if head == "avg" and step.isdigit() else None


def tail(step: int) -> str:
    """A migration's last boundary state (buffers, local=) at the switch after `step`."""
    return f"tail/{step}"


def local(rank: int) -> str:
    """Rank `rank`'s local state, served by its buddy (the mirror)."""
    return f"local/{rank}"


def zshard(shard: int) -> str:
    """A ZeRO-1 optimizer shard, served by its owner or its mirror."""
    return f"zshard/{shard}"


def fshard(rank: int) -> str:
    """Rank `rank`'s FSDP2 shard (parameters, optimizer), served by its mirror (runtime/fsdp2_mirror.py)."""
    return f"fshard/{rank}"


STATE_REST = "state/rest"  # a recovery: STATE without the parameters and optimizer (a current follower's take-over)
FEED_SNAPSHOT = "feed/snapshot"  # a follower's start: the feeder's state at a boundary (runtime/follow.py)


def feed_step(step: int) -> str:
    """The update of step `step`, fed to the follow spares (runtime/follow.py)."""
    return f"feed/{step}"


def step_of_feed(item: str) -> int | None:
    """The step of a feed_step name, None for any other name."""
    head, _, step = item.partition("/")
    return int(step) if head == "feed" and step.isdigit() else None
