"""A standalone etcd for multi-node tests: `python etcd_proc.py [ADDR]` starts one
embedded etcd member (listening on ADDR too), prints its client URL on ADDR and
runs until killed (the etcd guard stops etcd when this process dies)."""

from __future__ import annotations

import signal
import sys
import time

from livemig.rdzv.embedded import EtcdCluster

if __name__ == "__main__":
    host = sys.argv[1] if len(sys.argv) > 1 else None
    cluster = EtcdCluster(1, extra_host=host).start()
    print(cluster.endpoints_on(host) if host else cluster.endpoints, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (cluster.stop(), sys.exit(0)))
    while True:
        time.sleep(1)
