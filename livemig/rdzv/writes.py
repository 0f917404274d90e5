"""The leader's etcd writes as a few named transactions, built here and nowhere else.

The coordinator and its collaborators say *what* to write: a new generation (with the
incarnations it fences), the current generation's table rewritten, spares claimed together
with a table, a record put only if none is pending, or plain guarded records (timeline
events, suspects, results, refusals, prunes). Each is one transaction compared on this
leader's election key (`guard`), so a deposed leader's writes are refused by etcd. What goes
into a transaction besides its named part is given as `Put` / `Delete` values: plain data,
unit-testable, with no etcd client behind them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from livemig.rdzv.client import EtcdClient, encode, prefix_end
from livemig.rdzv.membership import Membership, Rendezvous


@dataclass(frozen=True)
class Put:
    """Put `value` (bytes as they are, anything else msgpack-encoded) at `key`, under `lease`."""

    key: str
    value: Any
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    """Delete `key`, or every key under it with `prefix`."""

    key: str
    prefix: bool = False


Op = Put | Delete


@dataclass(frozen=True)
class Claim:
    """A warm spare taken: its key must still be at the revision the leader read (`kv`, an
    rdzv.client.KV) and its assignment key absent; `assignment` is written there and its key
    rewritten as `claimed`, under its own lease."""

    kv: Any
    assignment_key: str
    assignment: dict
    claimed: dict


def txn_ops(client: EtcdClient, ops: Iterable[Op]) -> list:
    """`Put` / `Delete` values as the client's transaction ops."""
    t = client.txn_ops
    out = []
    for op in ops:
        if isinstance(op, Put):
            value = op.value if isinstance(op.value, bytes) else encode(op.value)
            out.append(t.put(op.key, value, op.lease) if op.lease else t.put(op.key, value))
        elif op.prefix:
            out.append(t.delete(op.key, range_end=prefix_end(op.key)))
        else:
            out.append(t.delete(op.key))
    return out


class Writes:
    """One leader's named writes (see the module doc). `guard` gives the compares that hold
    only while this process leads (LeaderElection.guard)."""

    def __init__(self, client: EtcdClient, rdzv: Rendezvous, guard: Callable[[], Any]) -> None:
        self.client = client
        self.rdzv = rdzv
        self._guard = guard

    def guard(self) -> list:
        return [self._guard()]

    def ops(self, ops: Iterable[Op]) -> list:
        return txn_ops(self.client, ops)

    def record(self, *ops: Op) -> bool:
        """Guarded puts and deletes, together: timeline events, suspects, results, refusals, prunes."""
        if not ops:
            return True
        return self.client.txn(self.guard(), self.ops(ops))[0]

    def record_once(self, key: str, value: Any, *more: Op) -> bool:
        """Put `value` at `key` only if nothing is there yet (a request one answer consumes: a
        migration request, the agents' request for fresh processes), with `more` alongside."""
        return put_if_absent(self.client, key, value, also=more, guard=self.guard())

    def new_generation(self, expected: int, new: Membership, fence: Sequence[str] = (),
                       extra: Sequence[Op] = (), claims: Sequence[Claim] = ()) -> bool:  # fmt: skip
        """Generation `expected` -> `expected + 1` with table `new`, the incarnations in `fence`
        fenced, the `claims` taken, `extra` written, in one transaction."""
        compare = [*self.guard(), *self._claim_compares(claims)]
        ops = [*self._claim_ops(claims), *self.ops(extra)]
        return self.rdzv.commit_change(expected, new, fence=fence, guard=compare, extra=ops)

    def update_generation(self, new: Membership, extra: Sequence[Op] = (), claims: Sequence[Claim] = ()) -> bool:
        """The current generation's table rewritten as `new` (a state change within it: built,
        committed, spares claimed for a recovery), the `claims` taken, `extra` written."""
        compare = [*self.guard(), *self._claim_compares(claims)]
        return self.rdzv.update(new, guard=compare, extra=[*self._claim_ops(claims), *self.ops(extra)])

    def first_generation(self, new: Membership, extra: Sequence[Op] = ()) -> bool:
        """Generation 0 -> 1: the job formed (or failed before forming)."""
        return self.rdzv.commit_change(0, new, guard=self.guard(), extra=self.ops(extra))

    def revoke(self, lease: int) -> None:
        """End a fenced process's lease: it learns it is fenced within one keep-alive."""
        self.client.revoke(lease)

    def drop(self, kv: Any) -> None:
        """Delete a fenced process's registration held under a shared lease (--node-leases),
        only as read: a replacement that registered under the key meanwhile keeps its own."""
        delete_if_unchanged(self.client, kv)

    def _claim_compares(self, claims: Sequence[Claim]) -> list:
        t = self.client.txn_ops
        out = []
        for c in claims:
            out += [t.mod(c.kv.key) == c.kv.mod_revision, t.version(c.assignment_key) == 0]
        return out

    def _claim_ops(self, claims: Sequence[Claim]) -> list:
        ops: list[Op] = []
        for c in claims:
            ops += [Put(c.assignment_key, c.assignment), Put(c.kv.key, c.claimed, c.kv.lease)]
        return self.ops(ops)


def put_if_absent(client: EtcdClient, key: str, value: Any, lease: int | None = None, also: Sequence[Op] = (),
                  unchanged: Any = None, guard: Sequence[Any] = (), unless: Sequence[str] = ()) -> bool:  # fmt: skip
    """Put `value` at `key` (and `also`) only if nothing is at `key` yet and, with `unchanged`
    (an rdzv.client.KV), that key is still at the revision read: the first writer of a
    record many may race for (a job's result, its secret, a node's rank in a run, a spare's
    stop order). `guard`: more compares (a leader's); `unless`: keys that must be absent too
    (a job's secret is not made again once the job has a result). True if this write won."""
    t = client.txn_ops
    compare = [*guard, t.version(key) == 0, *(t.version(k) == 0 for k in unless)]
    if unchanged is not None:
        compare.append(t.mod(unchanged.key) == unchanged.mod_revision)
    return client.txn(compare, txn_ops(client, [Put(key, value, lease), *also]))[0]


def delete_prefix_if(client: EtcdClient, prefix: str, key: str, kv: Any) -> bool:
    """Delete everything under `prefix` if `key` is still as read (`kv`, None: absent): an
    ended run's keys cleared by the agent that starts the next one, unless another did first."""
    t = client.txn_ops
    compare = [t.version(key) == 0] if kv is None else [t.mod(key) == kv.mod_revision]
    return client.txn(compare, txn_ops(client, [Delete(prefix, prefix=True)]))[0]


def delete_if_unchanged(client: EtcdClient, kv: Any) -> bool:
    """Delete kv's key only at the mod revision it was read at (a registration under a shared
    lease: whoever put the key since keeps it)."""
    t = client.txn_ops
    ok, _ = client.txn([t.mod(kv.key) == kv.mod_revision], [t.delete(kv.key)])
    return ok
