"""Guard process for one embedded etcd (stdlib only: it must start fast).

Prints etcd's pid on its first line, then waits. SIGTERM/SIGINT or the
death of --parent: stop etcd and delete --dir. SIGUSR1: stop etcd and keep
--dir (a test restarting a member from its data).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    state = {"stop": False, "keep": False}

    def on_signal(signum: int, _frame: object) -> None:
        state["stop"] = True
        state["keep"] = signum == signal.SIGUSR1

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(s, on_signal)
    os.makedirs(a.dir, exist_ok=True)
    log_path = os.path.join(os.path.dirname(a.dir) or ".", os.path.basename(a.dir) + ".log")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
    print(proc.pid, flush=True)
    while not state["stop"]:
        if os.getppid() != a.parent:
            break  # parent died: we were re-parented
        # If etcd itself died (a test killed it), keep waiting for orders.
        time.sleep(0.1)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not state["keep"]:
        shutil.rmtree(a.dir, ignore_errors=True)
        try:
            os.unlink(log_path)
        except OSError:
            pass
        try:  # the cluster's root dir, once its last member is gone
            os.rmdir(os.path.dirname(os.path.abspath(a.dir)))
        except OSError:
            pass
    sys.exit(0)


if __name__ == "__main__":
    main()
