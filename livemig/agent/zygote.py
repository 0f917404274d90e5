"""A pre-imported parent for an agent's workers and spares (`LIVEMIG_PREFORK`, on by default).

Each worker or spare is a fresh `python SCRIPT`, and `import torch` costs it 1.2-1.4 s of
CPU before the first line of the user's script runs. The agent starts one zygote that
imports torch once; every worker and spare is then forked from it and runs the script
with `runpy`, as `python SCRIPT` would (`__main__`, sys.argv, sys.path[0], its own
environment, session and log file). The zygote runs no thread of its own (fork is only
safe with none that can hold a lock: numpy's OpenBLAS pool, stopped around each fork by
its own atfork handlers, is the one allowed; a torch that starts another at import is said
and the agent falls back to spawning), opens no etcd or gRPC channel, and touches no device. It exits when its agent
is gone; its children exit when it is (LIVEMIG_PARENT_PID names the zygote to them).

The wire is JSON lines over a socketpair (no pickle): requests `{"id", "argv", "env",
"cwd", "log"}`, answers `{"id", "pid"}` or `{"id", "error"}`, and `{"exit": pid, "status":
raw wait status}` as each child is reaped.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from livemig.config import ENV_PARENT_PID

log = logging.getLogger("livemig.agent.zygote")

READY_TIMEOUT_S = 60.0  # the zygote's own start (import torch) on a loaded machine


def forkable(argv: list[str]) -> bool:
    """A `python SCRIPT.py ARGS` the zygote can run (not -m, -c, or a wrapper command)."""
    return len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py") and os.path.isfile(argv[1])


class ZygoteProc:
    """The agent's handle of a forked child: what the agent reads of a subprocess.Popen."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._z, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._z.status_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The agent's side: start the zygote, ask it for children, learn their exits."""

    def __init__(self, env: dict[str, str], on_exit: Callable[[], None], stderr_path: str) -> None:
        self._on_exit = on_exit
        mine, theirs = socket.socketpair()
        self._sock = mine
        with open(stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "livemig.agent.zygote", str(theirs.fileno()), str(os.getpid())],
                env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        theirs.close()
        self._lock = threading.Lock()
        self._answers: dict[int, dict] = {}
        self._statuses: dict[int, int] = {}
        self._cond = threading.Condition(self._lock)
        self._ready: bool | None = None
        self._next = 0
        self._dead = False
        threading.Thread(target=self._read, daemon=True, name="livemig-zygote-reader").start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._cond:
                    self._dead = True
                    self._ready = self._ready or False
                    self._cond.notify_all()
                self._on_exit()
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            exited = False
            with self._cond:
                for line in lines:
                    msg = json.loads(line)
                    if "ready" in msg:
                        self._ready = bool(msg["ready"])
                        if not self._ready:
                            log.warning("prefork off: the zygote cannot fork safely", extra={"why": msg.get("why")})
                    elif "exit" in msg:
                        self._statuses[int(msg["exit"])] = os.waitstatus_to_exitcode(int(msg["status"]))
                        exited = True
                    else:
                        self._answers[int(msg["id"])] = msg
                self._cond.notify_all()
            if exited:
                self._on_exit()  # the agent loop wakes at once, as on a pidfd

    def usable(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait until the zygote imported torch (or said it cannot fork safely)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None, timeout)
            return bool(self._ready) and not self._dead

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str, timeout: float = 30.0) -> ZygoteProc:
        with self._cond:
            self._next += 1
            rid = self._next
        req = {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd(), "log": log_path}
        self._sock.sendall(json.dumps(req).encode() + b"\n")
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._answers or self._dead, timeout):
                raise OSError(f"the zygote did not answer a spawn in {timeout:.0f} s")
            msg = self._answers.pop(rid, None)
        if msg is None or "pid" not in msg:
            raise OSError(f"the zygote could not fork {argv[1]}: {(msg or {}).get('error', 'it exited')}")
        return ZygoteProc(self, int(msg["pid"]), argv)

    def status_of(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._statuses:
                return self._statuses[pid]
            dead = self._dead
        if dead and not _running(pid):  # its children exit with it (their parent watch), status lost
            with self._cond:
                self._statuses[pid] = 70
            return 70
        return None

    def close(self) -> None:
        try:  # shutdown, not only close: the reader thread's recv holds the socket open
            self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _name(name: str) -> None:
    """The process name `ps -o comm`, top and /proc/PID/comm show: the script's, not the
    zygote's (the command line /proc/PID/cmdline shows stays the zygote's: it cannot be
    rewritten without exec; LIVEMIG_PREFORK=0 where tools read it)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may stay unreaped where PID 1 reaps nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


# -- the zygote process ----------------------------------------------------------------------
def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def _child(req: dict[str, Any], zygote_pid: int, started: int) -> None:
    """In the forked child: become `python SCRIPT ARGS` and never return."""
    code = 1
    try:
        os.setsid()
        os.write(started, b".")  # the session exists: the agent may signal our group from now on
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.closerange(3, 1 << 16)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = dict(req["env"])
        env[ENV_PARENT_PID] = str(zygote_pid)  # the zygote exits with the agent, and the child with it
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        import tempfile

        tempfile.tempdir = None  # TMPDIR is the run's, not the zygote's
        argv = req["argv"][1:]
        script = os.path.abspath(argv[0])
        _name(os.path.basename(script))
        sys.argv = argv
        sys.path[0] = os.path.dirname(script)
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            c = exc.code
            code = c if isinstance(c, int) else (0 if c is None else 1)
            if c is not None and not isinstance(c, int):
                print(c, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at a normal exit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    agent = int(sys.argv[2])
    try:  # numpy's OpenBLAS starts its thread pool at import; it is fork-safe (pthread_atfork
        import numpy  # noqa: F401 - handlers stop it before a fork and the child restarts it lazily)
    except ImportError:
        pass
    base = _threads()
    import torch  # noqa: F401 - the point of the zygote

    if _threads() > base:  # any other thread makes fork unsafe (a lock it holds stays held in the child)
        _send(sock, {"ready": False, "why": f"{_threads() - base} threads started by import torch"})
        return
    _send(sock, {"ready": True})
    me = os.getpid()
    pidfds: dict[int, int] = {}  # pidfd -> child pid
    buf = b""
    while True:
        if os.getppid() != agent:
            return  # the agent is gone: so are we (our children follow, by their parent watch)
        ready, _, _ = select.select([sock, *pidfds], [], [], 0.2)
        for fd in ready:
            if fd is sock:
                data = sock.recv(65536)
                if not data:
                    return  # the agent closed us (its stop)
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    req = json.loads(line)
                    r, w = os.pipe()
                    try:
                        pid = os.fork()
                    except OSError as exc:
                        os.close(r)
                        os.close(w)
                        _send(sock, {"id": req["id"], "error": str(exc)})
                        continue
                    if pid == 0:
                        sock.close()
                        _child(req, me, w)
                    os.close(w)
                    os.read(r, 1)  # answered once the child has its own session (as Popen's start_new_session)
                    os.close(r)
                    pidfds[os.pidfd_open(pid)] = pid
                    _send(sock, {"id": req["id"], "pid": pid})
            else:
                pid = pidfds.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "status": status})


if __name__ == "__main__":
    main()
