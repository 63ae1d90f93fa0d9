"""Start a local job's ranks by forking one process that imported torch and nanotrain once.

Why: every rank of a local job is a Python interpreter that imports torch, torch._dynamo (which
``ParallelContext`` imports before the default group exists) and the package: CPU seconds
each, before any work, and on a small machine the ranks import the same modules side by side on
the same cores. A fork server pays that once per job: it is
started with the job's common environment, imports ``PRELOAD``, and then forks one child per
rank, which sets its rank's environment, command line, working directory and output, and runs
the rank's module or script as ``__main__`` (as ``python -m MOD ARGS`` / ``python SCRIPT ARGS``
would). The child then lives and exits as a normal interpreter: its own session (``setsid``),
default signal handlers, normal finalisation at exit (atexit handlers, as in a fresh process).

CPU only: forking a process after CUDA is initialised is not supported by CUDA, and the server
never touches it, but GPU ranks gain nothing worth that risk; `use_fork_server` decides
(``NANOTRAIN_FORK_SERVER=0`` turns it off, ``=1`` on). A ``sitecustomize`` module the server
imported at start-up is run again in each child, after its rank's environment is set, as the
rank's own interpreter would have (the tests' hooks read ``RANK`` there).

Protocol (an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair: one message per datagram): the launcher sends
one JSON request per rank with the file descriptor for the rank's stdout and stderr attached
(``SCM_RIGHTS``); the server answers ``{"rank", "pid"}`` once forked and ``{"rank", "pid",
"code"}`` once it reaped the child (``code`` as ``Popen.returncode``: negative for a signal).
When the launcher's end closes (it exited or was killed), the server kills every child's session
and exits: nothing outlives the job.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "nanotrain.training.trainer",
    "nanotrain.checkpoint",
    "nanotrain.data",
    "nanotrain.runtime.task",
    "nanotrain.runtime.ending",
)
FD_ENV = "NANOTRAIN_FORK_SERVER_FD"
_MAX_MESSAGE = 1 << 20


def use_fork_server(env: dict) -> bool:
    """Fork ranks for this job? ``NANOTRAIN_FORK_SERVER`` 0/1 decides; else on CPU-only jobs
    (no NVIDIA device node, or ``CUDA_VISIBLE_DEVICES`` empty)."""
    choice = env.get("NANOTRAIN_FORK_SERVER", os.environ.get("NANOTRAIN_FORK_SERVER"))
    if choice in ("0", "1"):
        return choice == "1"
    return env.get("CUDA_VISIBLE_DEVICES") == "" or not Path("/dev/nvidiactl").exists()


def python_target(command: list[str]) -> tuple[str, str, list[str]] | None:
    """("module" | "script", name, argv) for ``[sys.executable, (-u), -m MOD | SCRIPT, ARGS...]``;
    None for anything else (started as a plain subprocess)."""
    if not command or command[0] != sys.executable:
        return None
    rest = list(command[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], [rest[1], *rest[2:]]
    if rest and not rest[0].startswith("-"):
        return "script", os.path.abspath(rest[0]), [rest[0], *rest[1:]]
    return None


# ----------------------------------------------------------------------------- launcher side
class ForkedProcess:
    """The ``subprocess.Popen`` surface ``RankProcesses`` uses, for a rank the server forked."""

    def __init__(self, server: "ForkServer", rank: int, pid: int, stdout=None):
        self.server, self.rank, self.pid, self.stdout = server, rank, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            self.server.pump(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One job's fork server (started by ``RankProcesses`` when ``use_fork_server``)."""

    def __init__(self, env: dict):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self._ranks: dict[int, ForkedProcess] = {}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanotrain.launch.forkserver"],
            env={**env, FD_ENV: str(theirs.fileno())},
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()

    def start(
        self, rank: int, argv_target: tuple[str, str, list[str]], env: dict, out_fd: int, stdout=None
    ) -> ForkedProcess:
        kind, name, argv = argv_target
        request = {"rank": rank, "kind": kind, "name": name, "argv": argv, "env": env, "cwd": os.getcwd()}
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_fd])
        deadline = time.monotonic() + 600
        while rank not in self._ranks:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server exited ({self.proc.returncode}) before it started rank {rank}")
            self.pump(0.05)
        proc = self._ranks[rank]
        proc.stdout = stdout
        return proc

    def pump(self, wait_s: float = 0.0) -> None:
        """Read what the server reported (forks, exits); waits up to ``wait_s`` for a first message."""
        with self._lock:
            if self._sock.fileno() < 0:  # closed: the ranks were ended and reaped already
                return
            ready, _, _ = select.select([self._sock], [], [], wait_s)
            while ready:
                data = self._sock.recv(_MAX_MESSAGE)
                if not data:
                    break
                msg = json.loads(data)
                proc = self._ranks.setdefault(msg["rank"], ForkedProcess(self, msg["rank"], msg["pid"]))
                if "code" in msg:
                    proc.returncode = msg["code"]
                ready, _, _ = select.select([self._sock], [], [], 0)

    def close(self) -> None:
        """The server kills what is left of the ranks' sessions and exits when its end closes."""
        self._sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ----------------------------------------------------------------------------- server side
def _serve(sock: socket.socket) -> dict | None:
    """Fork a child per request; report forks and exits. Returns the request in a child."""
    children: dict[int, int] = {}  # pid -> rank
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
            if not data:  # the launcher is gone: end every rank's session
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                for pid in list(children):
                    os.waitpid(pid, 0)
                return None
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                request["fd"] = fds[0]
                return request
            for fd in fds:
                os.close(fd)
            children[pid] = request["rank"]
            sock.send(json.dumps({"rank": request["rank"], "pid": pid}).encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rank = children.pop(pid)
            sock.send(json.dumps({"rank": rank, "pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_rank(request: dict) -> None:
    """In the forked child: this rank's session, signals, output, environment and command line."""
    import io
    import runpy

    os.setsid()
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(request["fd"], 1)
    os.dup2(request["fd"], 2)
    os.close(devnull)
    os.close(request["fd"])
    # unbuffered text streams on the new descriptors, as `python -u`
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, encoding="utf-8")
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, encoding="utf-8", errors="backslashreplace"
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    if "sitecustomize" in sys.modules:  # what the rank's own interpreter would have run at start-up
        importlib.reload(sys.modules["sitecustomize"])
    if request["kind"] == "module":
        sys.path[0] = os.getcwd()
        # The server imported it (PRELOAD) for its imports' sake; `python -m` runs a module that is
        # not imported yet, and runpy warns on stderr of every rank when it is.
        sys.modules.pop(request["name"], None)
        runpy.run_module(request["name"], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(request["name"])
        runpy.run_path(request["name"], run_name="__main__")


def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop(FD_ENV)))
    for name in PRELOAD:
        importlib.import_module(name)
    request = _serve(sock)
    if request is not None:
        _become_rank(request)


if __name__ == "__main__":
    main()
