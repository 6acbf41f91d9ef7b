"""The worker template: one process per driver that imports the model code once and forks workers from it; runs
as its own process, started by ``driver/worker_template.py``.

A worker started in a fresh interpreter imports torch, diffusers and transformers first: about 7 s of CPU per
rank, most of a pool's start at small sizes. The template pays that once; each worker it forks starts with the
code loaded (and frozen out of the garbage collector's sight, as ``WorkerRuntime.preload_model_code`` does).

It stays single-threaded (a fork copies only the calling thread, and a lock another thread held would stay held
in the child): one loop waits on its socket with a timeout and reaps ended children with ``waitpid``. Messages
are JSON datagrams on a SOCK_SEQPACKET socket; a spawn request carries, as passed file descriptors, the worker's
socket to the driver and the driver's current standard output and error. The template reports each fork's pid
and, when it ends, its exit status as ``subprocess`` would give it (``-signal`` for a signal). It exits when the
driver closes the socket or dies (parent-death signal, or a changed parent pid); its workers then get their own
parent-death signal and leave as orphans do.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading

MAX_MESSAGE = 1 << 20
MAX_FDS = 3  # the worker's socket, stdout, stderr
POLL_S = 0.2


def send(sock: socket.socket, message: dict) -> None:
    sock.sendmsg([json.dumps(message).encode()])


def preload() -> None:
    """What every worker imports (its main, executor and ``PRELOADED_MODULES``), then frozen."""
    from . import main as _main  # noqa: F401
    from . import executors  # noqa: F401
    from .runtime import PRELOADED_MODULES

    for name in PRELOADED_MODULES:
        importlib.import_module(name, __package__)
    try:
        import setproctitle  # noqa: F401 - each fork retitles itself (_set_title)
    except ImportError:
        pass
    gc.freeze()


def run_child(request: dict, fds: list[int]) -> None:
    """In the fork: become the worker the request describes (never returns)."""
    code = 1
    try:
        os.setsid()
        worker_fd, stdout_fd, stderr_fd = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        for fd in (devnull, stdout_fd, stderr_fd):
            os.close(fd)
        # the worker's parent is this template; the driver (the parent the settings name) is watched as well
        settings = {**request["settings"], "fd": worker_fd, "parent_pid": os.getppid(),
                    "driver_pid": request["settings"]["parent_pid"]}
        argv = [json.dumps(settings), "--rank", str(settings["rank"])]
        _set_title(settings)  # before the environment changes: setproctitle moves it on its first call
        os.environ.clear()
        os.environ.update(request["env"])
        from .main import main as worker_main

        worker_main(argv)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _set_title(settings: dict) -> None:
    """The worker's command line as ``ps`` shows it: its pool folder and ``--rank N`` (as workers are found), when
    setproctitle is installed; a fork otherwise shows the template's. The settings are left out (a retitled
    command line has only the room of the template's command line and environment)."""
    try:
        import setproctitle
    except ImportError:
        return
    words = [sys.executable, "-m", "wanmesh-worker", "--pool", settings["pool_dir"], "--rank", str(settings["rank"])]
    setproctitle.setproctitle(" ".join(words))


def serve(sock: socket.socket, parent_pid: int) -> None:
    children: set[int] = set()
    while os.getppid() == parent_pid:
        ready, _, _ = select.select([sock], [], [], POLL_S)
        _reap(sock, children)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        if not data:
            return  # the driver closed the socket
        request = json.loads(data)
        if request.get("kind") != "spawn" or len(fds) != MAX_FDS:
            for fd in fds:
                os.close(fd)
            send(sock, {"kind": "error", "message": f"bad request {request.get('kind')!r} with {len(fds)} fds"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            run_child(request, fds)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        send(sock, {"kind": "spawned", "pid": pid, "token": request["token"]})


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if done:
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            send(sock, {"kind": "exited", "pid": pid, "returncode": code})


def main(argv: list[str]) -> None:
    """``argv``: the control socket's fd and the driver's pid."""
    control_fd, parent_pid = int(argv[0]), int(argv[1])
    sock = socket.socket(fileno=control_fd)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the driver
    try:
        preload()
        threads = threading.active_count()
        if threads != 1:  # a fork would copy a process whose other threads may hold locks
            raise RuntimeError(f"the imports started {threads - 1} threads; workers cannot be forked from it")
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which starts workers the plain way
        send(sock, {"kind": "error", "message": f"{type(exc).__name__}: {exc}"})
        return
    send(sock, {"kind": "ready", "pid": os.getpid()})
    serve(sock, parent_pid)
