"""The agent's zygote (agent/zygote.py): a forked child is `python SCRIPT ARGS` in every way
the user's script can see (argv, sys.path[0], environment, cwd, its own session and log, its
exit code or signal), and the zygote and its children go when the agent does."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from livemig.agent.zygote import Zygote, forkable

SCRIPT = """
import json, os, sys
if sys.argv[1:] == ["sleep"]:
    import time
    from livemig.config import exit_with_parent
    exit_with_parent()  # as every worker and spare does (api.Engine)
    time.sleep(60)
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "env": os.environ.get("ZYG_TEST"),
                  "cwd": os.getcwd(), "sid": os.getsid(0) == os.getpid(), "name": __name__,
                  "parent": os.environ.get("LIVEMIG_PARENT_PID") == str(os.getppid())}))
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


def test_a_forked_child_is_the_script_it_runs(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    woke = threading.Event()
    monkeypatch.chdir(tmp_path)
    z = Zygote(dict(os.environ), woke.set, str(tmp_path / "zygote.log"))
    try:
        assert z.usable(), (tmp_path / "zygote.log").read_text()
        argv = [sys.executable, str(script), "hello", "3"]
        assert forkable(argv) and not forkable([sys.executable, "-m", "livemig.coordinator"])
        p = z.spawn(argv, {**os.environ, "ZYG_TEST": "x"}, str(tmp_path / "a.log"))
        assert p.wait(timeout=30) == 3 and woke.is_set()
        out = json.loads((tmp_path / "a.log").read_text().splitlines()[-1])
        assert out == {"argv": [str(script), "hello", "3"], "path0": str(tmp_path), "env": "x", "cwd": str(tmp_path),
                       "sid": True, "name": "__main__", "parent": True}, out  # fmt: skip
        q = z.spawn([sys.executable, str(script), "sleep"], dict(os.environ), str(tmp_path / "b.log"))
        assert q.poll() is None
        os.killpg(q.pid, signal.SIGKILL)  # the agent's kill of a child's group
        assert q.wait(timeout=30) == -signal.SIGKILL
        r = z.spawn([sys.executable, str(script), "sleep"], dict(os.environ), str(tmp_path / "c.log"))
    finally:
        z.close()
    # the zygote gone (the agent stopped), its children go too (their parent watch)
    assert z.proc.returncode is not None
    deadline = time.monotonic() + 10
    while r.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.poll() is not None, "a child outlived its zygote"
