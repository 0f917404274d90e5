"""The coordinator's mirrors report the keys changed between two reads (PrefixMirror
`by_key_changes`), on which its passes keep what they derived (coordinator/snapshot.py)."""

from __future__ import annotations

import time
from datetime import timedelta

from livemig.rdzv.client import EtcdClient
from livemig.rdzv.watch import PrefixMirror


def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "the mirror did not catch up"
        time.sleep(0.01)


def test_a_mirror_reports_the_keys_changed_since_its_last_read_and_none_after_a_reload(etcd):
    client = EtcdClient(etcd.endpoints, timedelta(seconds=5))
    client.put("/p/a", b"1")
    client.put("/p/b", b"1")
    mirror = PrefixMirror(client, "/p/", track_changes=True)
    try:
        kvs, _, changes = mirror.by_key_changes()
        assert set(kvs) == {"/p/a", "/p/b"} and changes is None  # the first read: not known
        client.put("/p/a", b"2")
        client.put("/p/c", b"1")
        client.delete("/p/b")
        client.put("/q/x", b"1")  # outside the prefix
        _until(lambda: "/p/c" in mirror.by_key()[0] and "/p/b" not in mirror.by_key()[0])
        kvs, _, changes = mirror.by_key_changes()
        assert changes == {"/p/a", "/p/b", "/p/c"} and set(kvs) == {"/p/a", "/p/c"}
        assert kvs["/p/a"].value == b"2"
        assert mirror.by_key_changes()[2] == set()  # taken: nothing changed since
        mirror._reload()  # a watch gap (compaction): everything may have changed
        assert mirror.by_key_changes()[2] is None
        untracked = PrefixMirror(client, "/p/")
        client.put("/p/d", b"1")
        _until(lambda: "/p/d" in untracked.by_key()[0])
        assert untracked.by_key_changes()[2] is None  # a mirror that does not track collects nothing
        untracked.cancel()
    finally:
        mirror.cancel()
        client.close()


def test_a_lending_mirror_leaves_the_dict_it_lent_as_it_was_until_the_next_view(etcd):
    """PrefixMirror(lend=True) hands its one reader its own dict (no copy a pass): events that
    arrive meanwhile wait, the dict the reader holds does not change under it, and the next
    view applies them, with the changed keys and a revision that covers them; a reload makes a
    new dict and leaves the lent one alone."""
    client = EtcdClient(etcd.endpoints, timedelta(seconds=5))
    client.put("/l/a", b"1")
    mirror = PrefixMirror(client, "/l/", track_changes=True, lend=True)
    try:
        kvs, rev, changes = mirror.view_changes()
        assert set(kvs) == {"/l/a"} and changes is None
        client.put("/l/a", b"2")
        client.put("/l/b", b"1")
        client.delete("/l/a")
        client.put("/l/c", b"1")
        wrote = client.write_revision
        _until(lambda: mirror.revision >= wrote)
        assert set(kvs) == {"/l/a"} and kvs["/l/a"].value == b"1", "the lent dict changed under its reader"
        copy, _ = mirror.by_key()  # another reader's copy holds the queued events; the lent dict still not
        assert set(copy) == {"/l/b", "/l/c"} and set(kvs) == {"/l/a"}
        again, rev2, changes = mirror.view_changes()
        assert again is kvs and set(again) == {"/l/b", "/l/c"} and rev2 >= wrote
        assert changes == {"/l/a", "/l/b", "/l/c"}
        copy, _ = mirror.by_key()
        assert copy == again and copy is not again
        mirror._reload()
        fresh, _, changes = mirror.view_changes()
        assert fresh is not kvs and set(fresh) == {"/l/b", "/l/c"} and changes is None
    finally:
        mirror.cancel()
        client.close()
