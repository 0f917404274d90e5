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
