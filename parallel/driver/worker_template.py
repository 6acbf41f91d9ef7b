"""The driver's side of the worker template (``worker/template.py``): starts it once per driver process, asks it
for workers, and stands in for ``subprocess.Popen`` for each worker it forked; runs in the driver.

The template is a child of the driver, started from a thread that lives as long as the driver (a parent-death
signal fires when the thread that forked the child ends). A reader thread takes the template's replies: the pid
of each fork, and each fork's exit status, which ``ForkedWorker.poll`` / ``wait`` then report as Popen does.
Used for CPU pools unless ``WANMESH_WORKER_TEMPLATE=0``, and for GPU pools only with ``WANMESH_WORKER_TEMPLATE=1``
(a template must not have initialised CUDA before it forks; that is checked on CPU builds only).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

TEMPLATE_ENV = "WANMESH_WORKER_TEMPLATE"
READY_TIMEOUT_S = 300.0
SPAWN_TIMEOUT_S = 60.0
MAX_MESSAGE = 1 << 20
POLL_S = 0.2


class TemplateGone(RuntimeError):
    """The template ended before it was asked for a worker (nothing was forked: start the worker the plain way)."""


class ForkedWorker:
    """The part of ``subprocess.Popen`` the local backend uses, for a worker the template forked."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def ended(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def template_wanted(devices: list[str]) -> bool:
    setting = os.environ.get(TEMPLATE_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return all(str(device).startswith("cpu") for device in devices)


class WorkerTemplate:
    """One running template and the workers it forked."""

    def __init__(self, bootstrap: str, pack_dir: str):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()  # one spawn at a time
        self._replies: dict[str, dict] = {}
        self._reply_arrived = threading.Condition()
        self._workers: dict[int, ForkedWorker] = {}
        self._early_exits: dict[int, int] = {}
        self._exits_lock = threading.Lock()  # an exit may be read before its spawn reply is handled
        self._ready = threading.Event()
        self.error: str | None = None
        self.process: subprocess.Popen | None = None
        started = threading.Event()

        def launch_and_hold() -> None:  # forks the template and lives as long as the driver (parent-death signal)
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", bootstrap, pack_dir, str(theirs.fileno()), str(os.getpid()), "--template"],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                self.error = str(exc)
            finally:
                theirs.close()
                started.set()
            threading.Event().wait()

        threading.Thread(target=launch_and_hold, name="wanmesh-template-launcher", daemon=True).start()
        started.wait()
        threading.Thread(target=self._read_forever, name="wanmesh-template-reader", daemon=True).start()

    def alive(self) -> bool:
        return self.error is None and self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float, abandon: threading.Event | None = None) -> bool:
        """Whether the template is ready within ``timeout_s``; False at once when ``abandon`` is set."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(min(POLL_S, max(0.0, deadline - time.monotonic()))):
            if (abandon is not None and abandon.is_set()) or time.monotonic() >= deadline:
                return False
        return self.error is None

    def _read_forever(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self.error = self.error or "the worker template ended"
                self._ready.set()
                with self._reply_arrived:
                    self._reply_arrived.notify_all()
                return
            message = json.loads(data)
            kind = message.get("kind")
            if kind == "ready":
                self._ready.set()
            elif kind == "error":
                self.error = message["message"]
                self._ready.set()
            elif kind == "exited":
                with self._exits_lock:
                    worker = self._workers.pop(message["pid"], None)
                    if worker is None:
                        self._early_exits[message["pid"]] = message["returncode"]
                if worker is not None:
                    worker.ended(message["returncode"])
            elif kind == "spawned":
                with self._reply_arrived:
                    self._replies[message["token"]] = message
                    self._reply_arrived.notify_all()

    def spawn(self, settings: dict[str, Any], env: dict[str, str], worker_fd: int) -> ForkedWorker:
        """Fork a worker with ``settings`` (as the bootstrap's JSON argument), ``env`` and the socket ``worker_fd``."""
        token = secrets.token_hex(8)
        message = json.dumps({"kind": "spawn", "token": token, "settings": settings, "env": env}).encode()
        with self._lock:
            try:
                socket.send_fds(self._sock, [message], [worker_fd, 1, 2])  # this process's standard output and error now
            except OSError as exc:
                self.error = self.error or f"the worker template's socket: {exc}"
                raise TemplateGone(self.error) from exc
            with self._reply_arrived:
                if not self._reply_arrived.wait_for(lambda: token in self._replies or self.error is not None,
                                                    SPAWN_TIMEOUT_S):
                    raise RuntimeError("the worker template did not fork a worker in time")
                if token not in self._replies:
                    raise RuntimeError(self.error)
                pid = self._replies.pop(token)["pid"]
            worker = ForkedWorker(pid)
            with self._exits_lock:
                self._workers[pid] = worker
                early = self._early_exits.pop(pid, None)
            if early is not None:
                worker.ended(early)
            return worker

    def live_workers(self) -> list[int]:
        with self._exits_lock:
            return list(self._workers)  # an ended worker is dropped when its exit is read

    def close(self) -> None:
        # shutdown first: the reader thread is blocked in recv on this socket, and a close alone leaves the socket
        # open under that call (the template would never read its end of file)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the template already ended
        self._sock.close()
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_TEMPLATE: WorkerTemplate | None = None
_TEMPLATE_LOCK = threading.Lock()


def shared_template(bootstrap: str, pack_dir: str, timeout_s: float,
                    abandon: threading.Event | None = None) -> WorkerTemplate | None:
    """This driver's template, started on first use; None when it cannot run (workers then start the plain way)
    or when ``abandon`` is set while it imports (a cancelled pool start; the template goes on importing)."""
    global _TEMPLATE
    with _TEMPLATE_LOCK:
        if _TEMPLATE is None or not _TEMPLATE.alive():
            _TEMPLATE = WorkerTemplate(bootstrap, pack_dir)
        template = _TEMPLATE
    if not template.wait_ready(min(timeout_s, READY_TIMEOUT_S), abandon):
        return None
    return template


def shared_template_pid() -> int | None:
    """The process id of this driver's running template (None when none runs)."""
    template = _TEMPLATE
    return template.process.pid if template is not None and template.alive() else None


def stop_template() -> bool:
    """Stop this driver's template (ComfyUI's free memory: it holds the imported code, about 400 MB); True when
    stopped. A template with live workers stays: a forked worker takes the template for its driver, and would
    leave (as an orphan) when it ends."""
    global _TEMPLATE
    with _TEMPLATE_LOCK:
        template = _TEMPLATE
        if template is None or template.live_workers():
            return False
        _TEMPLATE = None
    template.close()
    return True
