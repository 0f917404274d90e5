"""What the coordinator knows about a job's optimizer sharding (no torch import:
the coordinator and the CLI stay light). The mechanics are in comm/zero1.py."""

from __future__ import annotations

import math

from livemig.config import LOCAL_STATE_ENTRY, SHARDING_ENTRY, buddy_stride, zero1_layout


def sharding_of(sig: list) -> tuple[str, bool]:
    """(mode, mirrored) recorded in a job's signature; ("", False) when unsharded."""
    for e in sig:
        if isinstance(e, list | tuple) and len(e) == 3 and e[0] == SHARDING_ENTRY:
            return str(e[1]), bool(e[2] and e[2][0])
    return "", False


def lost_shards(world: int, mirrored: bool, holding: set[int], stride: int = 1,
                carried: dict[int, int] | None = None) -> list[str]:  # fmt: skip
    """Shards with no surviving holder (owner or mirror in zero1_layout), as readable lines."""
    out = []
    for r, (owner, mirror) in zero1_layout(world, carried, stride, mirrored).items():
        if owner in holding or (mirror is not None and mirror in holding):
            continue
        if mirror is not None:
            who = f"its owner rank {owner} and its mirror rank {mirror} both failed"
        elif mirrored:
            who = f"its owner rank {owner} failed and no other process was left to mirror it"
        else:
            who = f"its owner rank {owner} failed and shards are not mirrored (LIVEMIG_ZERO1_MIRROR=0)"
        out.append(f"optimizer shard {r} is lost: {who}")
    return out


def fsdp_shape(sig: list) -> list[int]:
    """The mesh shape of an FSDP2 job's signature ([] for any other job)."""
    for e in sig:
        if isinstance(e, list | tuple) and len(e) == 3 and e[0] == SHARDING_ENTRY and e[1] == "fsdp2":
            return [int(x) for x in e[2]]
    return []


def fsdp_mirrored(sig: list) -> bool:
    """Does the FSDP2 job mirror each rank's shard on its right neighbour?"""
    return any(isinstance(e, list | tuple) and len(e) == 3 and e[0] == "<fsdp2-mirror>" and e[1] == "mirrored"
               for e in sig)  # fmt: skip


def lost_fsdp_shards(shape: list[int], vacant: list[int], holding: set[int], mirrored: bool = False,
                     stride: int = 1) -> list[str]:  # fmt: skip
    """FSDP2: lost ranks whose shard no survivor holds (a replica along the mesh's replicate
    dimension, or its mirror on rank + stride), as readable lines. Rank r holds shard r % shape[-1]."""
    n, world = shape[-1], math.prod(shape)
    stride = buddy_stride(world, stride)
    out = []
    for r in vacant:
        peers = [x for x in holding if x % n == r % n]
        if not peers and not (mirrored and (r + stride) % world in holding):
            if mirrored:
                why = f"its replicas and its mirror rank {(r + stride) % world} were lost too"
            elif len(shape) > 1 and shape[0] > 1:
                why = "every replica of it was lost (ctx.register(mirror=True) mirrors each shard)"
            else:
                why = (
                    "plain FSDP keeps one copy of each shard and its mirror is off "
                    "(ctx.register(mirror=False) or LIVEMIG_FSDP2_MIRROR=0)"
                )
            out.append(f"FSDP2 shard {r % n} of rank {r} is lost: {why}")
    return out


def has_local_state(sig: list) -> bool:
    """Does the job mirror rank-local state (model buffers, `local=`) on the next rank?"""
    return any(isinstance(e, list | tuple) and len(e) == 3 and e[0] == LOCAL_STATE_ENTRY for e in sig)


def lost_local_state(world: int, vacant: list[int], reports: dict[str, dict], boundary: int,
                     stride: int = 1) -> list[str]:  # fmt: skip
    """Vacant ranks whose local state of `boundary` no survivor holds (its mirror is rank +
    stride; a spare that joined a step ago does not hold it yet), as readable lines."""
    out = []
    stride = buddy_stride(world, stride)
    for r in vacant:
        nxt = (r + stride) % world
        rep = reports.get(str(nxt)) or {}
        if boundary >= -1 and boundary not in (rep.get("mirrors") or []):
            out.append(
                f"rank {r}'s local state (buffers, local=) of step {boundary} is lost: its mirror "
                f"rank {nxt} {'failed too' if nxt in vacant else 'does not hold it'}"
            )
    return out


def first_mismatch(expected: list, got: list) -> str | None:
    """A one-line description of the first difference between two signatures."""
    for i, (e, g) in enumerate(zip(expected, got, strict=False)):
        if list(e) != list(g):
            return f"entry {i}: job has {e[0]} {e[1]}{tuple(e[2])}, spare has {g[0]} {g[1]}{tuple(g[2])}"
    if len(expected) != len(got):
        n = min(len(expected), len(got))
        extra = (expected if len(expected) > n else got)[n]
        who = "job" if len(expected) > n else "spare"
        what = f"{extra[0]} {extra[1]}" if str(extra[0]).startswith("<") else extra[0]
        return f"only the {who} has {what} ({len(expected)} vs {len(got)} entries)"
    return None
